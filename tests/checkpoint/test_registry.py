"""The segment registry: bounded, and correct per thread (autograd's sequence numbers are per thread)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradroute
from gradroute import _compat
from gradroute._checkpoint import segments
from gradroute._checkpoint._registry import this_thread

from .._reference import assert_grads_match, reference_grads


def test_segment_record_does_not_grow_without_a_router() -> None:
    lin = nn.Linear(3, 3)
    sizes = []
    for _ in range(1000):
        gradroute.checkpoint(lin, torch.randn(2, 3, requires_grad=True)).sum().backward()
        sizes.append(len(this_thread()))
    # bounded whatever the pruning threshold: the second 500 backwards never hold more than the first 500 did
    assert max(sizes[500:]) <= max(sizes[:500]) < 500


def _model(width: int, seed: int) -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(seed)
    tenc = nn.Linear(width, width).double()
    unet = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3)).double()
    return tenc, unet


def _forward(
    tenc: nn.Module, unet: nn.ModuleList, width: int, ranges: list[tuple[int, int]] | None = None
) -> dict[str, torch.Tensor]:
    """The tenc -> unet chain, each unet layer checkpointed when ``ranges`` is given (then filled with each
    segment's sequence-number range, read around the call)."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(4, width, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, width, generator=g) > 0.5).double()
    h = tenc(x)
    for layer in unet:
        if ranges is None:
            h = layer(h)
            continue
        first = _compat.next_sequence_nr()
        h = gradroute.checkpoint(layer, h)
        ranges.append((first, _compat.next_sequence_nr()))
    loss = h.pow(2)
    return {"tenc": loss.mean(), "unet": (loss * mask).mean()}


def _nodes(losses: dict[str, torch.Tensor]) -> list[Any]:
    seen: list[Any] = []
    stack = [t.grad_fn for t in losses.values()]
    while stack:
        n = stack.pop()
        if n is not None and n not in seen:
            seen.append(n)
            stack.extend(f for f, _ in n.next_functions)
    return seen


def _within(got: list[tuple[int, int]], around: list[tuple[int, int]]) -> bool:
    return len(got) == len(around) and all(a == c and b <= d for (a, b), (c, d) in zip(got, around, strict=True))


def _in_threads(*jobs: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_building_checkpointed_graphs_concurrently_get_their_own_segments() -> None:
    # both threads' graphs are alive at once and their sequence numbers overlap (each thread counts from its
    # own counter): each thread's registry answers with its own segments only, the graph's nodes tell the
    # planner whose segments they are, and each thread's routed backward is exact
    widths = (5, 7)
    models = {w: _model(w, seed=w) for w in widths}
    groups = {w: {"tenc": list(t.parameters()), "unet": list(u.parameters())} for w, (t, u) in models.items()}
    expected = {w: reference_grads(lambda w=w: _forward(*models[w], w), groups[w]) for w in widths}
    built = threading.Barrier(len(widths))
    # this test is about the registries: one routed backward at a time (concurrent ones are tests/test_session.py's,
    # in a process of their own)
    one_backward_at_a_time = threading.Lock()
    seen: dict[int, Any] = {}
    nodes: dict[int, list[Any]] = {}

    def job(width: int) -> None:
        tenc, unet = models[width]
        for _ in range(3):
            ranges: list[tuple[int, int]] = []
            losses = _forward(tenc, unet, width, ranges)
            nodes[width] = _nodes(losses)
            built.wait()  # both graphs alive now: ask for the other thread's graph, and for both at once
            other = next(w for w in widths if w != width)
            seen[width] = (ranges, segments(), segments(nodes[other]), segments(nodes[width] + nodes[other]))
            built.wait()
            for p in groups[width]["tenc"] + groups[width]["unet"]:
                p.grad = None
            with one_backward_at_a_time:
                gradroute.Router(**groups[width]).backward(**losses)
            assert_grads_match(groups[width]["tenc"] + groups[width]["unet"], expected[width], rtol=1e-9, atol=1e-12)
            built.wait()
            del losses

    _in_threads(*(lambda w=w: job(w) for w in widths))
    (ranges_a, own_a, b_seen_by_a, both_a), (ranges_b, own_b, a_seen_by_b, both_b) = seen[5], seen[7]
    # each range is the one read around its call (less the output's view node, made after the segment)
    assert _within(own_a, ranges_a) and _within(own_b, ranges_b)
    assert any(a < d and c < b for a, b in ranges_a for c, d in ranges_b)  # the numbers did overlap
    if _compat.SAVED_DATA:
        assert a_seen_by_b == own_a and b_seen_by_a == own_b
    else:  # the nodes cannot tell whose segments they are (gradroute._compat): none while both threads have some
        assert a_seen_by_b == b_seen_by_a == []
    assert both_a == both_b == []  # overlapping ranges of two threads in one graph: none can be told apart


def test_segments_of_a_graph_without_checkpoint_are_none_while_another_thread_has_some() -> None:
    # a graph an earlier test left in a reference cycle keeps its segments recorded until the collector runs
    # (seen on torch 2.5 with tests/test_step.py collected after this package): collect it first
    gc.collect()
    tenc, unet = _model(5, seed=0)
    plain = _nodes(_forward(tenc, unet, 5))
    kept: list[Any] = []
    _in_threads(lambda: kept.append(_forward(tenc, unet, 5, ranges=[])))
    assert segments(plain) == [] and segments() == []
    kept.clear()
