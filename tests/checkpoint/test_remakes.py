"""Remade tensors: what cheap ops made from saved tensors is dropped after each call and made again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from gradroute import _session

from .._reference import assert_grads_match, reference_grads
from ._helpers import CK, D, GatedFF, gated, torch_ck


def _gated_losses(scale_in_place: bool) -> tuple[nn.Module, Callable[[], dict[str, torch.Tensor]], Any, Any, Any]:
    """The gated model, its groups, the reference gradients and one forward's losses (recomputations unseen)."""
    tenc, unet, forward = gated(scale_in_place)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    ls = forward()
    for m in unet:
        m.made.clear()
    return unet, forward, groups, expected, ls


@pytest.mark.parametrize("scale_in_place", [False, True])
def test_shared_recomputation_drops_what_pointwise_ops_make_and_makes_it_again(scale_in_place: bool) -> None:
    # two engine calls through the same segments: the GELU and the gated product (pointwise ops and a view of
    # saved tensors) are dropped once the first call has used them and made again for the second; the
    # projection's output (a matrix product) is kept between them. A GELU modified in place is not remade.
    unet, _, groups, expected, ls = _gated_losses(scale_in_place)
    with _session.routed_backward(remake_min_bytes=0):
        first = torch.autograd.grad(ls["unet"], groups["unet"], retain_graph=True)
        made = {n: [s for m in unet for k, s in m.made if k == n] for n in ("proj", "gelu", "prod")}
        assert [len(v) for v in made.values()] == [2, 2, 2]  # one recomputation
        assert not any(s.expired() for s in made["proj"])
        assert all(s.expired() for s in made["prod"])
        assert [s.expired() for s in made["gelu"]] == [not scale_in_place] * 2
        second = torch.autograd.grad(ls["unet"], groups["unet"], retain_graph=True)
        tenc_grads = torch.autograd.grad(ls["tenc"], groups["tenc"])
        assert len(made["prod"]) == 2
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, g in zip(groups["unet"] + groups["tenc"], [*second, *tenc_grads], strict=True):
        p.grad = g
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_shared_recomputation_under_autocast_makes_the_same_tensors_again() -> None:
    # remakes record the ops after autocast's casts (bf16 here) and run them again outside autocast, even
    # when the routed backward itself is called under autocast: the gradients are those of torch's checkpoint
    tenc, unet = nn.Linear(D, D), nn.ModuleList(GatedFF(D) for _ in range(2))
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}

    def forward(ck: CK) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(3, 4, D, generator=g), torch.randn(3, 4, D, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = tenc(x)
            for m in unet:
                h = ck(m, h)
        loss = (h.float() - target) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :2].mean()}

    router = gradroute.Router(**groups, plan_options=gradroute.PlanOptions(remake_min_bytes=0))
    expected = router.grads(**forward(torch_ck))
    for m in unet:
        m.made.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router.grads(**forward(gradroute.checkpoint))
    prods = [s for m in unet for k, s in m.made if k == "prod"]
    assert len(prods) == 2 and all(s.expired() for s in prods)  # made again, not kept
    for name in groups:
        for a, b in zip(got[name], expected[name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("min_bytes", [0, 10**9])
def test_small_segments_keep_their_recomputation_between_calls(min_bytes: int) -> None:
    # remade tensors cost host time on every op of the recomputation: segments saving less than the threshold keep
    # everything between calls, like before; exact either way
    unet, forward, groups, expected, ls = _gated_losses(False)
    with _session.routed_backward(remake_min_bytes=min_bytes):
        torch.autograd.grad(ls["unet"], groups["unet"], retain_graph=True)
        prods = [s for m in unet for k, s in m.made if k == "prod"]
        assert len(prods) == 2 and [s.expired() for s in prods] == [min_bytes == 0] * 2
    router = gradroute.Router(**groups, plan_options=gradroute.PlanOptions(remake_min_bytes=min_bytes))
    router.backward(**forward())
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)
