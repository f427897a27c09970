"""Routing state is per call: concurrent routed backwards and plain backwards in other threads.

Two routers train two independent model pairs (each with ``gradroute.checkpoint`` segments) from two threads
while the main thread runs plain backwards through ``gradroute.checkpoint``. Every routed backward must be
exact, every plain backward must recompute its segment exactly once, and when the threads are done no
routing session may be left current or alive (the leak the issue reported: a session left current after two
overlapping calls, whose pending callbacks grew by one on every later plain backward).
"""

from __future__ import annotations

import faulthandler
import gc
import sys
import threading
import time

import torch
from torch import nn

import gradroute
from gradroute import _checkpoint, _session
from tests._reference import assert_grads_match, reference_grads

D = torch.float64


def _pair(seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(D)
    b = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(D)
    return a, b


class _Counted(nn.Module):
    """Counts its forwards: the original one and each recomputation."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def _train(seed: int, until: float, errors: list[BaseException], counts: list[int]) -> None:
    try:
        a, b = _pair(seed)
        router = gradroute.Router(a=a, b=b)
        x = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(seed))

        def forward() -> dict[str, torch.Tensor]:
            out = gradroute.checkpoint(b, gradroute.checkpoint(a, x))
            return {"a": out.pow(2).mean(), "b": (out - 1).abs().mean()}

        groups = {"a": list(a.parameters()), "b": list(b.parameters())}
        expected = reference_grads(forward, groups)
        while time.monotonic() < until or counts[0] < 20:
            router.zero_grad()
            router.backward(**forward())
            assert_grads_match([*groups["a"], *groups["b"]], expected, rtol=1e-12, atol=1e-14)
            counts[0] += 1
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def _plain_backward(segment: _Counted) -> int:
    before = segment.calls
    gradroute.checkpoint(segment, torch.randn(3, 6, dtype=D)).sum().backward()
    return segment.calls - before  # 1 forward + 1 recomputation


def test_concurrent_routed_backwards_and_plain_backwards_leave_nothing_behind() -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # switch threads often, so that the calls overlap
    try:
        errors: list[BaseException] = []
        counts = [[0], [0]]
        until = time.monotonic() + 1.5
        threads = [threading.Thread(target=_train, args=(s, until, errors, counts[s]), daemon=True) for s in (0, 1)]
        segment = _Counted(nn.Linear(6, 6).to(D))
        for t in threads:
            t.start()
        plain = []
        give_up = time.monotonic() + 120  # a hung thread fails the test (with every thread's stack), never the run
        while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
            plain.append(_plain_backward(segment))
        for t in threads:
            t.join(timeout=max(0.0, give_up - time.monotonic()))
        hung = [t for t in threads if t.is_alive()]
        if hung:
            faulthandler.dump_traceback(all_threads=True)
    finally:
        sys.setswitchinterval(interval)
    assert not hung, f"{len(hung)} training thread(s) still running after 120 s (stacks above)"
    assert not errors, errors[0]
    assert all(c[0] >= 20 for c in counts)
    assert set(plain) == {2}
    assert _session.current() is None
    assert [_plain_backward(segment) for _ in range(5)] == [2] * 5
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is _session.Session]


def _device_thread_sessions(*, segment: bool) -> list[tuple[object, object]]:
    """What ``_session.current()`` answers on a simulated device thread (no thread-local session) in the
    unpacks of a routed backward, with the local session for comparison; ``segment``: ``b`` runs in a
    ``gradroute.checkpoint`` segment."""
    a, b = _pair(0)
    seen: list[tuple[object, object]] = []

    def unpack(x: torch.Tensor) -> torch.Tensor:  # where gradroute.checkpoint asks for the session
        local = _session._local.session
        _session._local.session = None  # as on autograd's device threads
        try:
            seen.append((_session.current(), local))
        finally:
            _session._local.session = local
        return x

    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, unpack):
        h = a(torch.randn(4, 6, dtype=D))
        out = gradroute.checkpoint(b, h) if segment else b(h)
    gradroute.Router(a=a, b=b).backward(a=out.pow(2).mean(), b=out.abs().mean())
    assert _session.current() is None
    return seen


def test_engine_threads_find_the_routed_call_by_graph_task() -> None:
    """A device thread (CUDA work) has no thread-local session: while a gradroute.checkpoint segment is alive
    (its unpacks are what asks), it finds the call by its graph task."""
    seen = _device_thread_sessions(segment=True)
    assert len(seen) > 2
    assert all(found is local is not None for found, local in seen)


def test_engine_threads_are_not_watched_without_a_live_segment() -> None:
    """No gradroute.checkpoint segment alive anywhere: nothing would ask, so the engine calls carry no pre-hooks
    for it (a host cost per call); the calling thread still knows its session."""
    gc.collect()  # segments of earlier tests
    _checkpoint.segments()  # prunes the calling thread's records of them
    assert not _checkpoint.maybe_live(), "a segment of an earlier test is still alive"
    seen = _device_thread_sessions(segment=False)
    assert len(seen) > 4
    assert all(found is None and local is not None for found, local in seen)
