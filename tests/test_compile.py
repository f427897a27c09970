"""`gradroute.compile`: routed passes through compiled modules are exact and compute what eager ones compute.

Compiling is slow on CI's 2 cores: the models are tiny, most tests use ``aot_eager`` (AOTAutograd's graphs run
with eager kernels), and inductor runs in one slow test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradroute
from tests._reference import reference_grads

D = 8


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Unet(nn.Module):
    """A UNet stand-in: an MLP, optionally with its middle as a ``gradroute.checkpoint`` segment."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.mid = nn.Sequential(nn.Linear(2 * D, 2 * D), nn.GELU())
        self.checkpointed = checkpointed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(h))
        h = gradroute.checkpoint(self.mid, h) if self.checkpointed else self.mid(h)
        return self.out(h)


def _nets(dtype: torch.dtype, checkpointed: bool = False) -> tuple[nn.Module, nn.Module]:
    tenc = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).to(dtype)
    return tenc, _Unet(checkpointed).to(dtype)


def _forward(tenc: Callable, unet: Callable, dtype: torch.dtype, autocast: bool, rows: int = 6) -> Callable:
    """The seed's losses from a fixed batch: ``tenc`` on the whole loss, ``unet`` on a masked part."""

    def losses() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        x, target = torch.randn(rows, D, generator=g, dtype=dtype), torch.randn(rows, D, generator=g, dtype=dtype)
        mask = (torch.rand(rows, D, generator=g) > 0.5).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (unet(tenc(x)).float() - target.float()) ** 2
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return losses


def _groups(tenc: nn.Module, unet: nn.Module) -> dict[str, list[torch.Tensor]]:
    return {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_routed_through_compiled_modules_matches_eager(checkpointed: bool, autocast: bool) -> None:
    dtype = torch.float32 if autocast else torch.float64
    tenc, unet = _nets(dtype, checkpointed)
    groups = _groups(tenc, unet)
    expected = reference_grads(_forward(tenc, unet, dtype, autocast), groups)  # eager, a forward per loss
    c_tenc, c_unet = (gradroute.compile(m, backend="aot_eager") for m in (tenc, unet))
    router = gradroute.Router(**groups)
    tol = {"rtol": 1e-2, "atol": 1e-4} if autocast else {"rtol": 1e-9, "atol": 1e-12}
    for _ in range(2):  # the second step runs the cached variants
        got = router.grads(**_forward(c_tenc, c_unet, dtype, autocast)())
        for name, params in groups.items():
            for p, g in zip(params, got[name], strict=True):
                torch.testing.assert_close(g, expected[id(p)], **tol)
    router.backward(**_forward(c_tenc, c_unet, dtype, autocast)())
    for p in groups["tenc"] + groups["unet"]:
        torch.testing.assert_close(p.grad, expected[id(p)], **tol)
    st = gradroute.compile_stats(c_unet)
    assert st is not None and st.unaligned == 0
    assert tuple() not in st.masks  # every variant the engine asked for computes something


def _flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _routed_flops(tenc: Callable, unet: Callable, router: gradroute.Router) -> int:
    losses = _forward(tenc, unet, torch.float64, False, rows=32)()
    flops = _flops(lambda: router.backward(**losses))
    router.zero_grad()
    return flops


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_routed_backward_computes_what_the_eager_one_does(dynamic: bool) -> None:
    # the text encoder's pass through the compiled UNet computes the input-gradient chain and no UNet weight
    # gradient: the routed backward's FLOPs are the eager routed backward's (torch.compile's are higher)
    tenc, unet = _nets(torch.float64)
    router = gradroute.Router(**_groups(tenc, unet))
    eager = _routed_flops(tenc, unet, router)
    plain = [torch.compile(m, backend="aot_eager", dynamic=dynamic) for m in (tenc, unet)]
    with torch._functorch.config.patch(donated_buffer=False):
        unpruned = _routed_flops(*plain, router)
    routed = [gradroute.compile(m, backend="aot_eager", dynamic=dynamic) for m in (tenc, unet)]
    _routed_flops(*routed, router)  # compiles
    assert _routed_flops(*routed, router) == eager < unpruned
    st = gradroute.compile_stats(routed[1])
    assert st is not None and st.unaligned == 0 and st.backwards == 1
    assert st.variants == 2  # the input gradient only (text encoder's pass), the weights only (UNet's pass)


@pytest.mark.parametrize("first", ["plain backward", "routed backward"])
def test_plain_and_routed_backwards_mix_without_donated_buffer_setting(first: str) -> None:
    # torch.compile donates saved activations to a backward compiled during a plain backward, and a later routed
    # pass that retains then fails; gradroute.compile's backwards never take donations
    tenc, unet = _nets(torch.float64)
    groups = _groups(tenc, unet)
    forward = _forward(tenc, unet, torch.float64, False)
    expected = reference_grads(forward, groups)
    c_tenc, c_unet = (gradroute.compile(m, backend="aot_eager") for m in (tenc, unet))
    router = gradroute.Router(**groups)
    compiled = _forward(c_tenc, c_unet, torch.float64, False)
    steps = ["plain", "routed"] if first == "plain backward" else ["routed", "plain"]
    for step in steps:
        router.zero_grad()
        losses = compiled()
        if step == "plain":
            (losses["tenc"] + losses["unet"]).backward()
            continue
        router.backward(**losses)
        for p in groups["tenc"] + groups["unet"]:
            torch.testing.assert_close(p.grad, expected[id(p)], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("compiled", ["tenc", "unet", "both"])
def test_default_router_through_plain_torch_compile_exact_from_the_first_step(compiled: str) -> None:
    # plain torch.compile donates saved activations to its backward, which then refuses retain_graph: the
    # measured choice must not try a plan that retains through a compiled region the default plan frees
    tenc, unet = _nets(torch.float64)
    groups = _groups(tenc, unet)
    expected = reference_grads(_forward(tenc, unet, torch.float64, False), groups)
    c_tenc = torch.compile(tenc, backend="aot_eager") if compiled in ("tenc", "both") else tenc
    c_unet = torch.compile(unet, backend="aot_eager") if compiled in ("unet", "both") else unet
    router = gradroute.Router(**groups)
    for _ in range(6):
        router.zero_grad()
        router.backward(**_forward(c_tenc, c_unet, torch.float64, False)())
        for p in groups["tenc"] + groups["unet"]:
            torch.testing.assert_close(p.grad, expected[id(p)], rtol=1e-9, atol=1e-12)


def test_plain_backward_through_compiled_module_computes_every_gradient() -> None:
    tenc, unet = _nets(torch.float64)
    losses = _forward(tenc, unet, torch.float64, False)()
    expected = torch.autograd.grad(losses["tenc"] + losses["unet"], [*tenc.parameters(), *unet.parameters()])
    c_tenc, c_unet = (gradroute.compile(m, backend="aot_eager") for m in (tenc, unet))
    losses = _forward(c_tenc, c_unet, torch.float64, False)()
    (losses["tenc"] + losses["unet"]).backward()
    for p, want in zip([*tenc.parameters(), *unet.parameters()], expected, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"backend": torch._dynamo.lookup_backend("aot_eager")}, TypeError, "`backend` must be one of"),
        ({"backend": "cudagraphs"}, ValueError, "got 'cudagraphs'"),
        ({"backend": "aot_eager", "mode": "max-autotune"}, ValueError, "`mode` and `options` are inductor's"),
    ],
)
def test_compile_bad_backend_fails(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        gradroute.compile(nn.Linear(2, 2), **kwargs)


@pytest.mark.slow
def test_routed_through_inductor_compiled_modules_matches_eager() -> None:
    tenc, unet = _nets(torch.float32)
    groups = _groups(tenc, unet)
    expected = reference_grads(_forward(tenc, unet, torch.float32, False), groups)
    c_tenc, c_unet = gradroute.compile(tenc), gradroute.compile(unet)
    router = gradroute.Router(**groups)
    for _ in range(2):
        got = router.grads(**_forward(c_tenc, c_unet, torch.float32, False)())
        for name, params in groups.items():
            for p, g in zip(params, got[name], strict=True):
                torch.testing.assert_close(g, expected[id(p)], rtol=1e-4, atol=1e-6)
    st = gradroute.compile_stats(c_unet)
    assert st is not None and st.unaligned == 0 and st.variants == 2


class _ConvUnet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.silu(self.norm(self.a(h))))


@pytest.mark.parametrize("compile_fn", ["torch.compile", "gradroute.compile"])
def test_compiled_conv_routed_backward_computes_what_the_eager_one_does(compile_fn: str) -> None:
    # convolution_backward and group_norm_backward compute the input's, weight's and bias's gradients in one op:
    # their output_mask is narrowed in each variant, or the text encoder's pass computes the UNet's conv weights
    tenc, unet = nn.Conv2d(3, 4, 3, padding=1).double(), _ConvUnet().double()
    router = gradroute.Router(tenc=tenc, unet=unet)
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64), torch.randn(2, 4, 8, 8, generator=g)

    def routed_flops(t: Callable, u: Callable) -> int:
        loss = (u(t(x)) - target.double()) ** 2
        flops = _flops(lambda: router.backward(tenc=loss.mean(), unet=loss[:1].mean()))
        router.zero_grad()
        return flops

    eager = routed_flops(tenc, unet)
    if compile_fn == "torch.compile":
        with torch._functorch.config.patch(donated_buffer=False):
            compiled = torch.compile(unet, backend="aot_eager")
            routed_flops(tenc, compiled)
            assert routed_flops(tenc, compiled) > eager
        return
    compiled = gradroute.compile(unet, backend="aot_eager")
    routed_flops(tenc, compiled)
    assert routed_flops(tenc, compiled) == eager


def test_compiled_module_as_a_checkpoint_segment_matches_eager() -> None:
    # gradroute.checkpoint(compiled, h): the segment is recomputed once per routed backward, through the
    # compiled forward, and each engine call through it runs its own backward variant
    tenc, unet = _nets(torch.float64)
    groups = _groups(tenc, unet)
    expected = reference_grads(_forward(tenc, unet, torch.float64, False), groups)
    unet.mid = gradroute.compile(unet.mid, backend="aot_eager")
    unet.checkpointed = True
    router = gradroute.Router(**groups)
    for _ in range(2):
        router.zero_grad()
        router.backward(**_forward(tenc, unet, torch.float64, False)())
        for p in groups["tenc"] + groups["unet"]:
            torch.testing.assert_close(p.grad, expected[id(p)], rtol=1e-9, atol=1e-12)
    st = gradroute.compile_stats(unet.mid)
    assert st is not None and st.unaligned == 0 and () not in st.masks


def test_plan_notes_say_which_compiled_regions_are_pruned() -> None:
    tenc, unet = _nets(torch.float64)
    router = gradroute.Router(**_groups(tenc, unet))
    eager = router.plan(**_forward(tenc, unet, torch.float64, False)())
    assert not any("compiled region" in n for n in eager.notes)
    plain = router.plan(**_forward(torch.compile(tenc, backend="aot_eager"), unet, torch.float64, False)())
    assert any("1 compiled region(s) not pruned" in n for n in plain.notes), plain.notes
    routed = router.plan(**_forward(tenc, gradroute.compile(unet, backend="aot_eager"), torch.float64, False)())
    assert any("1 compiled region(s) of gradroute.compile" in n for n in routed.notes), routed.notes
    assert not any("not pruned" in n for n in routed.notes), routed.notes
