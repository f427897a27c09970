"""The public functions: checkpoint as a drop-in for torch's, checkpoint_modules, cut_points, their errors."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from gradroute import _session

from .._reference import assert_grads_match, reference_grads
from ._helpers import CK, CKS, Counted, D, GatedFF, checkpoint_kinds, losses, make, recomputed, sd_tiny, switch_alone


@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize("ck", ["gradroute", "torch"])
def test_router_matches_reference_with_dropout(ck: str, method: str) -> None:
    tenc, unet = make()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(lambda: losses(tenc, unet, None), groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    ls = losses(tenc, unet, CKS[ck])
    params = groups["tenc"] + groups["unet"]
    if method == "backward":
        router.backward(**ls)
    else:
        got = router.grads(**ls)
        for p, g in zip(params, [*got["tenc"], *got["unet"]], strict=True):
            p.grad = g
    assert_grads_match(params, expected)


@pytest.mark.parametrize(("ck", "passes"), [("gradroute", 1), ("torch", 2)])
def test_nested_checkpoint_exact_under_router(ck: str, passes: int) -> None:
    tenc, unet = make()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(lambda: losses(tenc, unet, None), groups)

    def outer(t: torch.Tensor) -> torch.Tensor:
        for b in unet.blocks:
            t = CKS[ck](b, t)
        return t

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    target = torch.randn(5, D, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, D, generator=g) > 0.5).double()
    torch.manual_seed(7)
    loss = (CKS[ck](outer, tenc(x, None)) - target) ** 2
    gradroute.Router(tenc=tenc, unet=unet).backward(tenc=loss.mean(), unet=(loss * mask).mean())
    assert_grads_match(groups["tenc"] + groups["unet"], expected)
    # per pass: the outer recomputation runs the inner blocks' forwards and stops (early stop) once it has
    # saved the last block's input; each inner recomputation adds one
    assert recomputed(unet) == [2 * passes, 2 * passes, passes]


def test_kwargs_and_non_tensor_args() -> None:
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64)

    def f(t: torch.Tensor, k: int, *, scale: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return torch.sin(t @ w) * scale * k + shift

    scale = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
    y = gradroute.checkpoint(f, x, 3, scale=scale, shift=1.5)
    torch.testing.assert_close(y, f(x, 3, scale=scale, shift=1.5), rtol=0, atol=0)
    gw, gs = torch.autograd.grad(y.sum(), [w, scale])
    rw, rs = torch.autograd.grad(f(x, 3, scale=scale, shift=1.5).sum(), [w, scale])
    torch.testing.assert_close(gw, rw, rtol=0, atol=0)
    torch.testing.assert_close(gs, rs, rtol=0, atol=0)


def test_no_grad_runs_plainly() -> None:
    f = Counted(lambda t: t * 2)
    with torch.no_grad():
        y = gradroute.checkpoint(f, torch.ones(2, requires_grad=True))
    assert f.calls == 1 and y.grad_fn is None


def test_autocast_state_replayed() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    grads = {}
    for name, ck in CKS.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ck(lambda t: torch.relu(lin(t)) @ lin.weight, x)
        assert y.dtype == torch.bfloat16
        grads[name] = torch.autograd.grad(y.float().sum(), [lin.weight, lin.bias])
    for a, b in zip(grads["gradroute"], grads["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_use_reentrant_true_fails() -> None:
    with pytest.raises(ValueError, match="`use_reentrant` must be False or None, got True"):
        gradroute.checkpoint(torch.sin, torch.ones(1, requires_grad=True), use_reentrant=True)


def test_debug_fails() -> None:
    with pytest.raises(ValueError, match="`debug=True` is not supported"):
        gradroute.checkpoint(torch.sin, torch.ones(1, requires_grad=True), debug=True)


def test_determinism_check_fails() -> None:
    with pytest.raises(ValueError, match=r"`determinism_check` must be one of .* got 'strict'"):
        gradroute.checkpoint(torch.sin, torch.ones(1, requires_grad=True), determinism_check="strict")


@pytest.mark.parametrize("bad", [3, "unet", torch.zeros(2)])
def test_checkpoint_modules_non_module_fails(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`modules` item 1 must be an nn.Module"):
        gradroute.checkpoint_modules(nn.Linear(2, 2), bad)


@pytest.mark.parametrize("bad", [3, "unet", torch.zeros(2)])
def test_cut_points_non_module_fails(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`modules` item 1 must be an nn.Module, got"):
        gradroute.cut_points(nn.Linear(2, 2), bad)


@switch_alone
def test_diffusers_and_transformers_switches_accept_gradroute_checkpoint() -> None:
    tenc, unet, forward = sd_tiny(gradroute.checkpoint)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    ls = forward()
    assert checkpoint_kinds(ls["tenc"]) == {None, "gradroute"}
    gradroute.Router(tenc=tenc, unet=unet).backward(**ls)
    unet.disable_gradient_checkpointing()
    tenc._set_gradient_checkpointing(enable=False)
    expected = reference_grads(forward, groups)  # fresh forward per loss, no checkpointing
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_checkpoint_modules_recomputes_diffusers_blocks_once_per_routed_backward() -> None:
    tenc, unet, forward = sd_tiny(gradroute.checkpoint)
    unet.disable_gradient_checkpointing()
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    counts = [0] * len(blocks)
    for k, b in enumerate(blocks):
        gradroute.checkpoint_modules(b)
        inner = b.forward.args[0]  # what the segment runs, in the forward and in the recomputation

        def counted(*a: Any, _k: int = k, _inner: Any = inner, **kw: Any) -> Any:
            if _session.current() is not None:
                counts[_k] += 1
            return _inner(*a, **kw)

        b.forward = functools.partial(gradroute.checkpoint, counted)
    gradroute.Router(tenc=tenc, unet=unet).backward(**forward())
    assert counts == [1] * len(blocks)


def test_parameter_passed_into_a_segment_routes_exactly() -> None:
    # segment inputs hand each consuming op a view (like outputs); a leaf parameter among them still gets
    # its gradient, routed or not
    w = nn.Parameter(torch.randn(D, D, dtype=torch.float64))
    v = nn.Parameter(torch.randn(D, D, dtype=torch.float64))
    x = torch.randn(4, D, dtype=torch.float64)

    def f(weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ weight) + h * weight.sum()

    def forward(ck: CK | None = None) -> dict[str, torch.Tensor]:
        h = x @ v
        out = ck(f, w, h) if ck is not None else f(w, h)
        return {"v": out.pow(2).mean(), "w": out.sin().sum()}

    expected = reference_grads(forward, {"v": [v], "w": [w]})
    gradroute.Router(v=[v], w=[w]).backward(**forward(gradroute.checkpoint))
    assert_grads_match([v, w], expected, rtol=1e-9, atol=1e-12)
    w.grad = None
    forward(gradroute.checkpoint)["w"].backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(forward()["w"], w)[0], rtol=1e-9, atol=1e-12)


class _Two(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.a, self.b = inner if inner is not None else GatedFF(D), GatedFF(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(gradroute.checkpoint(self.a, x))


def _compile(m: nn.Module) -> Any:
    return torch.compile(m, backend="aot_eager", dynamic=False)


@pytest.mark.usefixtures("no_donated_buffers")
@pytest.mark.parametrize("where", ["whole model", "segment", "inside a segment"])
def test_torch_compile_with_segments_routes_exactly(where: str) -> None:
    # torch.compile around the model (it traces torch's checkpoint instead), a compiled module as the
    # segment (plain tensors in, no remade tensors), a compiled module inside a segment (no remade tensors): all exact
    torch._dynamo.reset()
    tenc = nn.Linear(D, D).double()
    unet = _Two(_compile(GatedFF(D)) if where == "inside a segment" else None).double()
    run = _compile(unet) if where == "whole model" else unet
    if where == "segment":
        unet.a = _compile(unet.a)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}

    def forward(model: Any) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(3, 4, D, generator=g, dtype=torch.float64), torch.randn(3, 4, D, generator=g)
        loss = (model(tenc(x)) - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :2].mean()}

    expected = reference_grads(lambda: forward(run), groups)
    router = gradroute.Router(**groups, plan_options=gradroute.PlanOptions(remake_min_bytes=0))
    for _ in range(2):  # the second step runs the cached compiled code
        got = router.grads(**forward(run))
        for name, params in groups.items():
            for p, gr in zip(params, got[name], strict=True):
                torch.testing.assert_close(gr, expected[id(p)], rtol=1e-9, atol=1e-12)
