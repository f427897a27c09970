"""The plan: what it does on the demo's text-encoder -> UNet setup, how it prints, and its cache."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gradroute
from gradroute import _compat
from gradroute._planner import PlanCache
from gradroute.cli.data import make_batch
from gradroute.cli.models import make_models, route_losses
from tests._reference import assert_grads_match, reference_grads

D = torch.float64


@pytest.fixture
def tenc_unet_setup():
    tenc, unet = make_models(seed=0, width=8)
    tenc, unet = tenc.to(D), unet.to(D)
    batch = make_batch(3, torch.Generator().manual_seed(0))
    batch = {k: v.to(D) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}

    def forward():
        pred = unet(batch["noisy"], batch["timesteps"], tenc(batch["tokens"]))
        loss_tenc, loss_unet = route_losses(pred, batch)
        return {"tenc": loss_tenc, "unet": loss_unet}

    return tenc, unet, forward


def test_text_encoder_unet_exact(tenc_unet_setup):
    tenc, unet, forward = tenc_unet_setup
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    gradroute.Router(tenc=tenc, unet=unet).backward(**forward())
    assert_grads_match([*tenc.parameters(), *unet.parameters()], expected, rtol=1e-9, atol=1e-12)


def test_tenc_unet_plan_cuts_at_text_encoder_output(tenc_unet_setup):
    tenc, unet, forward = tenc_unet_setup
    plan = gradroute.Router(tenc=tenc, unet=unet).plan(**forward())
    # the text-encoder loss goes first (its loss node keeps nothing: no call of its own), retaining only
    # through the shared UNet (input gradients only),
    # then the UNet loss frees the UNet while computing its weight gradients, then the text encoder's part
    # of the first pass runs from the cut at its output and frees it
    assert plan.passes == (("tenc",), ("unet",))
    assert [(c.groups[0], c.retain) for c in plan.calls] == [
        ("tenc", True),
        ("unet", False),
        ("tenc", False),
    ]
    assert plan.kept_nodes == 0
    assert plan.leaks == {"tenc": ("unet",), "unet": ("tenc",)}
    retaining = [c for c in plan.calls if c.retain]
    assert len(retaining) == 1 and retaining[0].params == 0 and retaining[0].groups == ("tenc",)
    assert plan.calls[-1].edges_in == retaining[0].edges_out
    # the text encoder's output reaches the cross-attention projections through a view each: cut once, at
    # the tensor, as a hand cut does (NOTE [Stateless nodes at a cut])
    assert retaining[0].edges_out == 1
    n_tenc = len(list(tenc.parameters()))
    n_unet = len(list(unet.parameters()))
    assert sum(c.params for c in plan.calls if c.groups == ("tenc",)) == n_tenc
    assert sum(c.params for c in plan.calls if c.groups == ("unet",)) == n_unet
    # every node is executed; shared nodes twice (retain, then final), and no call runs without work
    assert all(c.nodes > 0 for c in plan.calls)


def test_plan_prints_a_readable_table(tenc_unet_setup):
    tenc, unet, forward = tenc_unet_setup
    text = str(gradroute.Router(tenc=tenc, unet=unet).plan(**forward()))
    assert text.startswith("gradroute plan: 2 routed loss(es), 2 pass(es)")
    assert "tenc -> unet" in text and "LEAK" in text and "(own)" in text
    assert "passes (in order): tenc  then  unet" in text
    for column in ("retain", "starts from", "edges out", "params", "nodes"):
        assert column in text


def test_plan_runs_nothing_and_holds_no_graph(tenc_unet_setup):
    tenc, unet, _forward = tenc_unet_setup
    router = gradroute.Router(tenc=tenc, unet=unet)
    hidden = tenc(torch.randint(0, 8, (2, 4)))
    ref = weakref.ref(hidden)  # saved by the UNet's cross-attention projections
    x = torch.zeros(2, 3, 32, 32, dtype=D)
    pred = unet(x, torch.zeros(2, dtype=torch.long), hidden)
    losses = {"tenc": pred.mean(), "unet": pred.pow(2).mean()}
    del hidden, pred
    plan = router.plan(**losses)
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])
    del losses
    gc.collect()
    assert ref() is None, "the plan keeps the autograd graph alive"
    assert plan.graph_nodes > 0


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
        walks = min(backwards, 16)
        assert f"(median of the last {walks}). If it is the same on every step, Router(static_graph=True)" in notes[0]
        assert notes[0] in str(plan)


def test_plan_notes_no_walk_when_the_graph_alternates():
    router, plain, longer = _two_graphs(autotune=False)
    for _ in range(8):
        router.backward(**plain())
        router.backward(**longer())
    assert _walk_notes(router.plan(**plain())) == []


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


def test_plan_suggests_gradroute_checkpoint_for_torch_checkpointed_shared_segments():
    from torch.utils.checkpoint import checkpoint

    a, b = torch.nn.Linear(3, 3).to(D), torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()).to(D)
    x = torch.randn(2, 3, dtype=D)
    out = checkpoint(b, a(x), use_reentrant=False)
    plan = gradroute.Router(a=a, b=b, autotune=False).plan(a=out.sum(), b=out.pow(2).sum())
    if _compat.SAVED_DATA:
        assert len(plan.notes) == 1 and "gradroute.checkpoint recomputes each once per backward" in plan.notes[0]
        assert "note: " in str(plan)
    else:  # torch without SavedTensor.data cannot tell which nodes torch's checkpoint saved (gradroute._compat)
        assert plan.notes == ()
    out = gradroute.checkpoint(b, a(x))
    notes = gradroute.Router(a=a, b=b, autotune=False).plan(a=out.sum(), b=out.pow(2).sum()).notes
    assert len(notes) == 1 and notes[0].startswith("1 chunk(s) of gradroute.checkpoint segments are shared")


def test_reentrant_checkpoint_fails_clearly():
    from torch.utils.checkpoint import checkpoint

    a, b = torch.nn.Linear(3, 3).to(D), torch.nn.Linear(3, 3).to(D)
    x = torch.randn(2, 3, dtype=D)
    out = checkpoint(b, a(x), use_reentrant=True)
    with pytest.raises(ValueError, match=r"reentrant torch.utils.checkpoint segment \(use_reentrant=True\)"):
        gradroute.Router(a=a, b=b).backward(a=out.sum(), b=out.pow(2).sum())
    assert all(p.grad is None for p in [*a.parameters(), *b.parameters()])


def test_plan_with_no_call_prints():
    # the only loss reaches none of its group's parameters (allowed): the plan has no engine call
    a, b = torch.nn.Linear(3, 3).to(D), torch.nn.Linear(3, 3).to(D)
    loss = b(torch.randn(2, 3, dtype=D)).pow(2).mean()
    plan = gradroute.Router(a=a, b=b, allow_unreached=True).plan(a=loss)
    assert plan.calls == ()
    lines = str(plan).splitlines()
    assert lines[0].startswith("gradroute plan: 1 routed loss(es), 0 pass(es), 0 engine call(s), ")
    assert ["#", "pass", "retain", "starts", "from", "edges", "out", "params", "nodes"] in [ln.split() for ln in lines]


def test_plan_shows_leaks_into_groups_the_call_does_not_name():
    actor, critic = torch.nn.Linear(3, 2).to(D), torch.nn.Linear(5, 1).to(D)
    s = torch.randn(4, 3, dtype=D)
    q = critic(torch.cat([s, actor(s)], 1))
    plan = gradroute.Router(actor=actor, critic=critic).plan(actor=-q.mean())
    assert plan.others == ("critic",)
    assert plan.reach["actor"] == {"actor": 2, "critic": 2}
    assert plan.leaks["actor"] == ("critic",)
    text = str(plan)
    assert "critic" in text.splitlines()[3] and "actor -> critic" in text


def _custom(x: torch.Tensor) -> torch.Tensor:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    return Twice.apply(x)


def _copy_slices(x: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[0] = 0.0
    return y


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (lambda x: x.view(-1), True),
        (lambda x: x.t(), True),
        (lambda x: x + x, True),
        (lambda x: torch.cat([x, x]), True),
        (lambda x: x * x, False),
        (lambda x: x.sin(), False),
        (lambda x: x @ x, False),
        (_custom, False),
        (_copy_slices, False),
    ],
)
def test_stateless_nodes_are_those_that_save_no_tensors(op, expected):
    # a stateless node may run in any number of engine calls, retaining or not (the planner relies on it)
    from gradroute._graph import stateless

    x = torch.randn(3, 3, requires_grad=True)
    out = op(x)
    assert stateless(out.grad_fn) is expected
    if expected:  # released by a call without retain_graph, it runs again
        total = out.sum()
        first = torch.autograd.grad(total, x)
        torch.testing.assert_close(torch.autograd.grad(total, x), first, rtol=0, atol=0)


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
