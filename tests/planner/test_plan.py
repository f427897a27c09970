"""The plan: what it does on the demo's text-encoder -> UNet setup, how it prints, what it notes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gradroute
from gradroute import _compat
from tests._reference import assert_grads_match, reference_grads

D = torch.float64


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
