"""gradroute._planner.cache: the plan cache, seen through ``Router.graph_counts`` (``planned``: the analyses
made), ``router.plan(...)`` and its walk note; its least-recently-used order on ``PlanCache`` itself.

Every routed gradient is compared with a fresh forward and ``torch.autograd.grad`` per loss.
"""

from __future__ import annotations

import pytest
import torch

import gradroute
from gradroute._planner import PlanCache
from tests._reference import assert_grads_match, reference_grads

D = torch.float64


def test_cache_reuses_the_analysis_for_the_same_graph(tenc_unet_setup):
    tenc, unet, forward = tenc_unet_setup
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=False)  # no candidate plans: one analysis per graph
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    for _step in range(3):
        for p in [*tenc.parameters(), *unet.parameters()]:
            p.grad = None
        expected = reference_grads(forward, groups)
        router.backward(**forward())
        assert_grads_match([*tenc.parameters(), *unet.parameters()], expected, rtol=1e-9, atol=1e-12)
    assert router.graph_counts == gradroute.GraphCounts(walked=3, followed=0, planned=1)
    # another shape of call is planned anew
    router.backward(tenc=forward()["tenc"])
    assert router.graph_counts.planned == 2


def _two_graphs(**router_options):
    """A router over two linear layers, and two graphs of one call shape: ``longer`` has one more node."""
    a, b = torch.nn.Linear(3, 3).to(D), torch.nn.Linear(3, 3).to(D)
    x = torch.randn(2, 3, dtype=D)

    def plain() -> dict[str, torch.Tensor]:
        return {"a": b(a(x)).sum(), "b": b(a(x)).pow(2).sum()}

    def longer() -> dict[str, torch.Tensor]:
        return {"a": b(a(x).relu()).sum(), "b": b(a(x)).pow(2).sum()}

    return gradroute.Router(a=a, b=b, **router_options), plain, longer


def test_cache_reuses_the_plan_for_a_graph_of_other_tensor_sizes():
    # the signature records structure, not sizes: a batch of another size gets the first batch's plan, exact
    a, b = torch.nn.Linear(3, 3).to(D), torch.nn.Linear(3, 3).to(D)
    router = gradroute.Router(a=a, b=b, autotune=False)
    groups = {"a": list(a.parameters()), "b": list(b.parameters())}
    for rows in (2, 5, 1, 2):
        x = torch.randn(rows, 3, dtype=D)

        def forward(x=x) -> dict[str, torch.Tensor]:
            h = b(torch.tanh(a(x)))
            return {"a": h.pow(2).sum(), "b": (h - 1).abs().sum()}

        expected = reference_grads(forward, groups)
        router.zero_grad()
        router.backward(**forward())
        assert_grads_match([*groups["a"], *groups["b"]], expected, rtol=1e-12, atol=1e-14)
    assert router.graph_counts == gradroute.GraphCounts(walked=4, followed=0, planned=1)


def test_cache_misses_when_the_graph_changes():
    router, plain, longer = _two_graphs()
    router.backward(**plain())
    router.backward(**longer())
    assert router.graph_counts.planned == 2


def test_cache_keeps_each_of_two_alternating_graphs():
    router, plain, longer = _two_graphs(autotune=False)
    for _ in range(3):
        router.backward(**plain())
        router.backward(**longer())
    assert router.graph_counts == gradroute.GraphCounts(walked=6, followed=0, planned=2)


def _segmented(mode: str, tenc: torch.nn.Module, layers: torch.nn.ModuleList) -> dict[str, torch.Tensor]:
    """The tenc -> 4-layer chain with its layers checkpointed by ``gradroute.checkpoint`` one by one, in pairs,
    a pair holding a nested segment, or not at all."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=D)
    h = tenc(x)
    pair = lambda i: lambda t: layers[i + 1](layers[i](t))  # noqa: E731
    nested = lambda t: layers[1](gradroute.checkpoint(layers[0], t))  # noqa: E731
    blocks = {
        "none": [],
        "each": [layers[i] for i in range(4)],
        "pairs": [pair(0), pair(2)],
        "nested": [nested, pair(2)],
    }[mode]
    for block in blocks:
        h = gradroute.checkpoint(block, h)
    if mode == "none":
        for layer in layers:
            h = layer(h)
    loss = h.pow(2)
    return {"tenc": loss.mean(), "unet": (loss * (x > 0)).mean()}


def test_cache_tells_graphs_apart_by_their_checkpointed_segments():
    # the analysis reads the segments (chunks, recomputation per call), which the signature does not list: it
    # must still differ between segmentations (gradroute.checkpoint gives a segment's outputs views of their
    # own), or one segmentation's plan would run on another's graph
    torch.manual_seed(0)
    tenc = torch.nn.Linear(4, 4).to(D)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(4)).to(D)
    groups = {"tenc": list(tenc.parameters()), "unet": list(layers.parameters())}
    router = gradroute.Router(**groups, autotune=False)
    modes = ["none", "each", "pairs", "nested"]
    for mode in modes * 2:
        expected = reference_grads(lambda mode=mode: _segmented(mode, tenc, layers), groups)
        for p in groups["tenc"] + groups["unet"]:
            p.grad = None
        router.backward(**_segmented(mode, tenc, layers))
        assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)
        fresh = gradroute.Router(**groups, autotune=False).plan(**_segmented(mode, tenc, layers))
        assert router.plan(**_segmented(mode, tenc, layers)) == fresh, mode
    assert router.graph_counts.planned == len(modes)


def _found(entry):
    return None if entry is None else (entry.signature, entry.planned)


def test_cache_drops_the_least_recently_used_graph_when_full():
    cache = PlanCache(size=2)
    planned = [object(), object(), object()]
    sigs = [[1], [1, 2], [1, 2, 3]]
    cache.store(("k",), sigs[0], planned[0])  # type: ignore[arg-type]
    cache.store(("k",), sigs[1], planned[1])  # type: ignore[arg-type]
    assert _found(cache.lookup(("k",), [1])) == (sigs[0], planned[0])  # now the most recently used
    cache.store(("other",), sigs[2], planned[2])  # type: ignore[arg-type]
    assert len(cache) == 2
    assert cache.lookup(("k",), [1, 2]) is None
    assert _found(cache.lookup(("k",), [1])) == (sigs[0], planned[0])
    assert _found(cache.lookup(("other",), [1, 2, 3])) == (sigs[2], planned[2])
    assert cache.lookup(("other",), [1]) is None  # another call shape


def test_walk_note_counts_walks_in_a_row_of_one_graph_and_forgets_a_dropped_one():
    # README: "once 8 backwards in a row have walked the same graph", the plan printout says what it costs
    cache = PlanCache(size=2)
    first, second, third = object(), object(), object()
    entry = cache.store(("k",), [1], first)  # type: ignore[arg-type]
    other = cache.store(("k",), [1, 2], second)  # type: ignore[arg-type]
    for _ in range(7):
        cache.walked(("k",), entry, 1e-3)
    assert cache.walk_note(first, nodes=5) is None  # type: ignore[arg-type]
    cache.walked(("k",), entry, 3e-3)
    note = cache.walk_note(first, nodes=5)  # type: ignore[arg-type]
    assert note is not None and note.startswith("walk: the last 8 routed backwards had this graph; walking its 5 ")
    assert "took 1.00 ms each (median of the last 8)" in note
    cache.walked(("k",), other, 1e-3)  # another graph of the call shape ends the row
    cache.walked(("k",), entry, 1e-3)
    assert cache.walk_note(first, nodes=5) is None  # type: ignore[arg-type]
    for _ in range(8):
        cache.walked(("k",), entry, 1e-3)
    assert cache.walk_note(first, nodes=5) is not None  # type: ignore[arg-type]
    cache.lookup(("k",), [1, 2])  # `other` is now the most recently used: storing a third drops `entry`
    cache.store(("k",), [1, 2, 3], third)  # type: ignore[arg-type]
    assert cache.walk_note(first, nodes=5) is None  # type: ignore[arg-type]


def _walk_notes(plan: gradroute.Plan) -> list[str]:
    return [n for n in plan.notes if n.startswith("walk: ")]


@pytest.mark.parametrize("static_graph", [False, True])
@pytest.mark.parametrize("backwards", [7, 8, 12])
def test_plan_notes_the_walk_of_a_graph_seen_on_eight_backwards_in_a_row(backwards, static_graph):
    router, plain, _ = _two_graphs(autotune=False, static_graph=static_graph)
    for _ in range(backwards):
        router.backward(**plain())
    plan = router.plan(**plain())  # plan() walks too; it is not counted
    notes = _walk_notes(plan)
    if backwards < 8 or static_graph:
        assert notes == []
    else:
        assert len(notes) == 1
        assert notes[0].startswith(
            f"walk: the last {backwards} routed backwards had this graph; walking its {plan.graph_nodes} nodes took "
        )
        tail = f"(median of the last {backwards}). If it is the same on every step, Router(static_graph=True)"
        assert tail in notes[0]
        assert notes[0] in str(plan)


def test_plan_notes_no_walk_when_the_graph_alternates():
    router, plain, longer = _two_graphs(autotune=False)
    for _ in range(8):
        router.backward(**plain())
        router.backward(**longer())
    assert _walk_notes(router.plan(**plain())) == []
