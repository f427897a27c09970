"""Two threads of routed backwards and plain backwards in the main thread, in a process of their own.

Run by ``tests/test_session.py`` as ``python -m tests._threaded_routing``; prints one JSON line with what the
test asserts. Two routers train two independent model pairs (each with ``gradroute.checkpoint`` segments) from
two threads while the main thread runs plain backwards through ``gradroute.checkpoint``.

NOTE [Why the threaded test runs in a process of its own]
1. CI hung twice in this scenario with the GIL held (pytest-timeout's thread method never reported); it never
   hung here in thousands of runs, and the cause was not found. (The router then paused the cycle collector
   process-wide with a lock shared by threads; that pause is gone.)
2. In a process of its own, a hang stops this scenario only: faulthandler (armed below) dumps every thread's
   Python stack, then the parent takes the C stacks (gdb, where it can attach), kills it and fails the test
   with both. There is no retry: a hang fails the test like anything else the scenario finds.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import sys
import threading
import time

import torch
from torch import nn

import gradroute
from gradroute import _session
from tests._reference import assert_grads_match, reference_grads

D = torch.float64
RUN_S = 1.5  # every thread runs this long, and at least MIN_STEPS routed backwards
MIN_STEPS = 20
GIVE_UP_S = 60.0  # a thread still running then fails the test, with every thread's stack
DUMP_S = 80.0  # a process still running then (a hang, the GIL held or not) dumps every thread's stack


def pair(seed: int) -> tuple[nn.Module, nn.Module]:
    g = torch.Generator().manual_seed(seed)
    a = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(D)
    b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(D)
    with torch.no_grad():
        for p in [*a.parameters(), *b.parameters()]:
            p.copy_(torch.randn(p.shape, dtype=D, generator=g) * 0.5)
    return a, b


class Counted(nn.Module):
    """Counts its forwards: the original one and each recomputation."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def _train(seed: int, until: float, errors: list[str], spans: list[tuple[float, float]]) -> None:
    try:
        a, b = pair(seed)
        router = gradroute.Router(a=a, b=b)
        x = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(seed))

        def forward() -> dict[str, torch.Tensor]:
            out = gradroute.checkpoint(b, gradroute.checkpoint(a, x))
            return {"a": out.pow(2).mean(), "b": (out - 1).abs().mean()}

        groups = {"a": list(a.parameters()), "b": list(b.parameters())}
        expected = reference_grads(forward, groups)
        while time.monotonic() < until or len(spans) < MIN_STEPS:
            router.zero_grad()
            start = time.monotonic()
            router.backward(**forward())
            spans.append((start, time.monotonic()))
            assert_grads_match([*groups["a"], *groups["b"]], expected, rtol=1e-12, atol=1e-14)
    except BaseException as e:  # reported by the main thread
        errors.append(repr(e))


def _plain_backward(segment: Counted, spans: list[tuple[float, float]]) -> int:
    before = segment.calls
    start = time.monotonic()
    gradroute.checkpoint(segment, torch.randn(3, 6, dtype=D)).sum().backward()
    spans.append((start, time.monotonic()))
    return segment.calls - before  # 1 forward + 1 recomputation


def _overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> int:
    """How many spans of ``a`` overlap some span of ``b``."""
    return sum(any(s < e2 and s2 < e for s2, e2 in b) for s, e in a)


def main() -> dict[str, object]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    errors: list[str] = []
    routed: list[list[tuple[float, float]]] = [[], []]
    until = time.monotonic() + RUN_S
    threads = [threading.Thread(target=_train, args=(s, until, errors, routed[s]), daemon=True) for s in (0, 1)]
    segment = Counted(nn.Linear(6, 6).to(D))
    for t in threads:
        t.start()
    plain_spans: list[tuple[float, float]] = []
    plain = []
    give_up = time.monotonic() + GIVE_UP_S
    while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
        plain.append(_plain_backward(segment, plain_spans))
    for t in threads:
        t.join(timeout=max(0.0, give_up - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    if hung:
        faulthandler.dump_traceback(all_threads=True)
    after = [_plain_backward(segment, []) for _ in range(5)]
    gc.collect()
    return {
        "hung": hung,
        "errors": errors,
        "steps": [len(s) for s in routed],
        "routed_overlapping": _overlaps(routed[0], routed[1]),
        "plain_overlapping": _overlaps(plain_spans, routed[0] + routed[1]),
        "recomputations": sorted(set(plain)),
        "recomputations_after": after,
        "session_left": _session.current() is not None,
        "sessions_alive": sum(type(o) is _session.Session for o in gc.get_objects()),
    }


if __name__ == "__main__":
    faulthandler.dump_traceback_later(DUMP_S)  # needs no GIL: works in a hang held under it
    print(json.dumps(main()), flush=True)
    sys.exit(0)
