"""``gradroute.checkpoint`` gives bitwise the gradients of torch's non-reentrant checkpoint and of no checkpointing.

On the tiny Stable Diffusion stack (transformers' CLIPTextModel -> diffusers' UNet2DConditionModel, float32
weights), through both libraries' own switches, in float32 and under CPU autocast to bfloat16 and float16.
Routed, the passes interleave through shared segments only where cut points let them, and then add some
gradients in another order: bounded there, bitwise everywhere else (docs/checkpointing.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradroute

from ._helpers import PRECISIONS, sd_stack, switch_alone


def _params(tenc: nn.Module, unet: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*(("tenc." + n, p) for n, p in tenc.named_parameters()), *unet.named_parameters()]


def _one_loss_grads(switch: str, precision: str, cuts: bool = False) -> dict[str, torch.Tensor]:
    tenc, unet, forward = sd_stack(switch, PRECISIONS[precision], cuts)
    forward()["tenc"].backward()  # one loss into both networks, no router
    return {n: p.grad for n, p in _params(tenc, unet)}


def _per_loss_reference(precision: str) -> list[torch.Tensor]:
    """Each group's gradients of its own loss, from a fresh forward each, without checkpointing."""
    tenc, unet, forward = sd_stack("none", PRECISIONS[precision])
    return [
        *torch.autograd.grad(forward()["tenc"], list(tenc.parameters())),
        *torch.autograd.grad(forward()["unet"], list(unet.parameters())),
    ]


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize(
    "setup",
    [("gradroute", False), ("gradroute", True), ("enable_checkpointing", False)],
    ids=["switches", "switches+cut_points", "enable_checkpointing"],
)
def test_one_loss_gradients_are_bitwise_those_of_torchs_checkpoint_and_of_none(
    precision: str, setup: tuple[str, bool]
) -> None:
    # cut points (by hand, or gradroute.enable_checkpointing's) hand every consumer of the UNet layers'
    # outputs a view of its own: the gradients must still be added in the order of the plain graph
    none = _one_loss_grads("none", precision)
    theirs = _one_loss_grads("torch", precision)
    ours = _one_loss_grads(setup[0], precision, setup[1])
    for name, want in none.items():
        torch.testing.assert_close(theirs[name], want, rtol=0, atol=0, msg=f"torch's checkpoint: {name}")
        torch.testing.assert_close(ours[name], want, rtol=0, atol=0, msg=f"gradroute.checkpoint: {name}")


@switch_alone
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_routed_gradients_are_bitwise_the_per_loss_references(precision: str) -> None:
    # without cut points the planner cannot interleave its passes through the UNet's segments and plans as
    # for torch's checkpoint: nothing is added in another order; three backwards: the autotuner's
    # candidate plans are tried one after the other
    expected = _per_loss_reference(precision)
    tenc, unet, forward = sd_stack("gradroute", PRECISIONS[precision])
    params = _params(tenc, unet)
    router = gradroute.Router(tenc=tenc, unet=unet)
    for step in range(3):
        for _, p in params:
            p.grad = None
        router.backward(**forward())
        for (name, p), want in zip(params, expected, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0, msg=f"step {step}: {name}")


#: unit roundoff of the dtype the gradients are added in (autocast's: its ops' gradients are in that dtype)
_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize(
    "remake_min_bytes", [None, pytest.param(0, marks=pytest.mark.slow)], ids=["default", "remade tensors"]
)
def test_routed_gradients_through_cut_points_differ_by_summation_order_only(
    precision: str, remake_min_bytes: int | None
) -> None:
    # With cut points the passes interleave chunk by chunk through shared recomputations, and the gradient
    # of a tensor read on both sides of a cut (the text encoder's states, read by every cross-attention) is
    # formed across several engine calls: the same terms, grouped otherwise than one backward groups them
    # (``(a + b) + (c + d)`` for ``((a + b) + c) + d``; 2e-15 relative in float64: rounding only).
    # Regrouping a sum of n terms of magnitude at most S changes it by at most about n * u * S (u: the unit
    # roundoff of the dtype they are added in), and the backward below carries that on linearly. The terms
    # here are gradients of the group's own size (S: the largest reference gradient of the group), n is a
    # handful of consumers, and the layers below amplify little: a bound of 64 u S per group, where about
    # 8 u S is reached in float32 and 3 to 4 u S under autocast. A wrong gradient (a missing or doubled term)
    # is of the order of S itself, far above it.
    expected = _per_loss_reference(precision)
    tenc, unet, forward = sd_stack("enable_checkpointing", PRECISIONS[precision])  # cut points included
    params = _params(tenc, unet)
    options = gradroute.PlanOptions() if remake_min_bytes is None else gradroute.PlanOptions(remake_min_bytes=0)
    router = gradroute.Router(tenc=tenc, unet=unet, plan_options=options)
    notes = router.plan(**forward()).notes
    assert any("chunk(s) of gradroute.checkpoint segments" in n for n in notes), notes
    assert not any("recomputed once per call" in n for n in notes), notes
    n_tenc = len(list(tenc.parameters()))
    scale = {
        "tenc": max(g.abs().max().item() for g in expected[:n_tenc]),
        "unet": max(g.abs().max().item() for g in expected[n_tenc:]),
    }
    for step in range(3):
        for _, p in params:
            p.grad = None
        router.backward(**forward())
        for k, ((name, p), want) in enumerate(zip(params, expected, strict=True)):
            bound = 64 * _ROUNDOFF[precision] * scale["tenc" if k < n_tenc else "unet"]
            torch.testing.assert_close(p.grad, want, rtol=0, atol=bound, msg=f"step {step}: {name}")


def test_enable_checkpointing_plans_as_the_documented_switches_and_cut_points() -> None:
    # one call per model gives the plan of the diffusers switch plus the hand-placed cut points of
    # docs/checkpointing.md (the same engine calls, so the same cost); the switch alone recomputes per call
    plans = {}
    for switch, cuts in (("gradroute", False), ("gradroute", True), ("enable_checkpointing", False)):
        tenc, unet, forward = sd_stack(switch, None, cuts)
        plans[switch, cuts] = gradroute.Router(tenc=tenc, unet=unet).plan(**forward())
    assert any("recomputed once per call" in n for n in plans["gradroute", False].notes)
    by_hand, one_call = plans["gradroute", True], plans["enable_checkpointing", False]
    assert one_call.calls == by_hand.calls and one_call.notes == by_hand.notes
    assert len(one_call.calls) > len(plans["gradroute", False].calls)  # interleaved
