"""Running a plan: hooks fire once per pass, handed-off gradients are stolen, not copied (float64 references)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradroute
from gradroute import _compat

from ._reference import assert_grads_match, reference_grads, route_into_grad

D = torch.float64
CK = Callable[..., Any] | None
CKS: dict[str, CK] = {
    "none": None,
    "gradroute": gradroute.checkpoint,
    "torch": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
}


class Block(nn.Module):
    """``x + mlp(x)``: the residual add inside, so that a checkpoint segment is the whole block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class Net(nn.Module):
    """Residual blocks, each a checkpoint segment when ``ck`` is given."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor, ck: CK = None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if ck is None else ck(b, x)
        return x


def make() -> tuple[Net, Net, torch.Tensor, torch.Tensor, torch.Tensor]:
    tenc, unet = Net(4, 2).to(D), Net(4, 3).to(D)
    x, target = torch.randn(6, 4, dtype=D), torch.randn(6, 4, dtype=D)
    mask = (torch.rand(6, 4) > 0.5).to(D)
    return tenc, unet, x, target, mask


def masked_losses(unet: Net, hidden: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, ck: CK):
    loss = (unet(hidden, ck) - target) ** 2
    return {"tenc": loss.mean(), "unet": (loss * mask).mean()}


def groups(tenc: Net, unet: Net) -> dict[str, list[torch.Tensor]]:
    return {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}


def calls_that_cut_and_accumulate(router: gradroute.Router, losses: dict[str, torch.Tensor]) -> int:
    return sum(1 for c in router.plan(**losses).calls if c.edges_out and c.params)


@pytest.mark.parametrize("ck", ["none", "gradroute", "torch"])
def test_parameter_hooks_run_once_and_their_result_is_kept(ck: str) -> None:
    tenc, unet, x, target, mask = make()
    params = [*tenc.parameters(), *unet.parameters()]
    seen: Counter[int] = Counter()
    for k, p in enumerate(params):
        p.register_hook(functools.partial(lambda k, g: (seen.update([k]), g * (k + 2))[1], k))

    def forward() -> dict[str, torch.Tensor]:
        return masked_losses(unet, tenc(x, CKS[ck]), target, mask, CKS[ck])

    expected = reference_grads(forward, groups(tenc, unet))  # the hooks run (once per parameter) here too
    seen.clear()
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=False)  # the default plan, which cuts
    if ck == "gradroute":  # the case that made hooks run twice: calls capture, then accumulate
        assert calls_that_cut_and_accumulate(router, forward()) > 0
    router.backward(**forward())
    assert seen == Counter(range(len(params)))  # once each
    assert_grads_match(params, expected)


@pytest.mark.parametrize("ck", ["none", "gradroute"])
def test_post_accumulate_grad_hooks_run_once_on_the_final_grad(ck: str) -> None:
    tenc, unet, x, target, mask = make()
    params = [*tenc.parameters(), *unet.parameters()]
    seen: dict[int, list[torch.Tensor]] = {}
    for k, p in enumerate(params):
        p.register_post_accumulate_grad_hook(
            functools.partial(lambda k, q: seen.setdefault(k, []).append(q.grad.clone()), k)
        )
    router = gradroute.Router(tenc=tenc, unet=unet)
    router.backward(**masked_losses(unet, tenc(x, CKS[ck]), target, mask, CKS[ck]))
    assert sorted(seen) == list(range(len(params)))
    for k, p in enumerate(params):
        assert len(seen[k]) == 1
        torch.testing.assert_close(seen[k][0], p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("ck", ["none", "gradroute", "torch"])
@pytest.mark.parametrize("how", ["reverse", "retain_grad"])
def test_hook_on_the_boundary_sees_its_gradient_once(ck: str, how: str) -> None:
    # every plan here cuts the text-encoder pass at the boundary: the gradient is captured there by one
    # engine call and fed back in by a later one, where the hook must not apply a second time
    tenc, unet, x, target, mask = make()
    hidden = tenc(x, CKS[ck])
    if how == "reverse":  # gradient reversal, as in domain-adversarial training
        hidden.register_hook(lambda g: -g)
    else:
        hidden.retain_grad()
    router = gradroute.Router(tenc=tenc, unet=unet)
    router.backward(**masked_losses(unet, hidden, target, mask, CKS[ck]))

    ref_hidden = tenc(x).detach().requires_grad_()
    ref_loss = masked_losses(unet, ref_hidden, target, mask, None)["tenc"]
    (g_hidden,) = torch.autograd.grad(ref_loss, ref_hidden)
    sign = -1.0 if how == "reverse" else 1.0
    expected = dict(
        zip(map(id, tenc.parameters()), torch.autograd.grad(tenc(x), list(tenc.parameters()), sign * g_hidden))
    )
    assert_grads_match(list(tenc.parameters()), expected)
    if how == "retain_grad":
        torch.testing.assert_close(hidden.grad, g_hidden, rtol=1e-12, atol=1e-14)


class AccumulateGradOps(TorchDispatchMode):
    """The aten ops run while an ``AccumulateGrad`` node executes (a copy into a fresh ``.grad`` shows here)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        node = _compat.current_autograd_node()
        if node is not None and node.name() == "torch::autograd::AccumulateGrad":
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ck", ["none", "gradroute"])
def test_captured_parameter_gradients_are_stolen_into_grad(ck: str) -> None:
    tenc, unet, x, target, mask = make()
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = masked_losses(unet, tenc(x, CKS[ck]), target, mask, CKS[ck])
    with AccumulateGradOps() as mode:
        router.backward(**losses)
    assert set(mode.ops) == {"aten.detach.default"}  # empty .grad: every gradient moved in (detached), none copied

    losses = masked_losses(unet, tenc(x, CKS[ck]), target, mask, CKS[ck])
    with AccumulateGradOps() as mode:
        router.backward(**losses)  # into existing .grad: in-place adds only
    assert set(mode.ops) == {"aten.add_.Tensor"}


@pytest.mark.parametrize(
    ("shape", "index", "copied"),
    [
        ((4, 6), (slice(None), slice(0, 3)), True),
        ((4, 6), (slice(None), slice(0, 4)), False),
        ((4, 6), (slice(None),), False),
    ],
)
def test_cut_gradient_held_for_a_later_call_does_not_keep_a_larger_buffer(
    shape: tuple[int, ...], index: tuple[slice, ...], copied: bool
) -> None:
    # the backward of torch.cat hands out slices of one buffer (a UNet's skip connections): a slice held across
    # engine calls is copied when it would keep a buffer of twice its size or more alive
    from gradroute._execute import _compact

    g = torch.randn(shape)[index]
    got = _compact(g)
    assert got is not None
    torch.testing.assert_close(got, g, rtol=0, atol=0)
    assert (got.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()) == copied
    assert _compact(None) is None


@pytest.mark.parametrize("method", ["backward", "grads"])
def test_exact_through_the_engine_entry(method: str) -> None:
    # the executor calls the engine's entry directly, in calls that cut and accumulate too
    tenc, unet, x, target, mask = make()

    def forward() -> dict[str, torch.Tensor]:
        return masked_losses(unet, tenc(x, CKS["gradroute"]), target, mask, CKS["gradroute"])

    expected = reference_grads(forward, groups(tenc, unet))
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=False)  # the default plan: calls cut and accumulate
    assert calls_that_cut_and_accumulate(router, forward()) > 0
    params = [*tenc.parameters(), *unet.parameters()]
    route_into_grad(router, method, forward(), params)
    assert_grads_match(params, expected)


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("entry", ["engine entry", "public functions"])
def test_run_engine_matches_torch_with_and_without_the_engine_entry(entry: str, accumulate: bool) -> None:
    # a torch without the engine's entry gets torch.autograd.backward/grad: both give torch's gradients
    from gradroute._compat import engine_run_backward
    from gradroute._execute import run_engine

    w1 = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64)

    def loss() -> torch.Tensor:
        return (torch.tanh(x @ w1) @ w2).pow(2).sum()

    expected = torch.autograd.grad(loss(), [w1, w2])
    out = loss()
    got = run_engine(
        [out],
        [torch.ones_like(out)],
        False,
        [w1, w2],
        accumulate=accumulate,
        entry=engine_run_backward if entry == "engine entry" else None,
    )
    if accumulate:  # written into .grad
        got = (w1.grad, w2.grad)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("penalty", [False, True])
@pytest.mark.parametrize("hooks", [False, True])
def test_boundaries_of_one_shape_keep_their_gradients_apart_over_steps_of_new_shapes(
    hooks: bool, penalty: bool
) -> None:
    # two boundaries of the same shape are handed off in one engine call (both encoders' pass is cut at each),
    # their zero placeholders are shared, and every step has another batch size (more shapes than are kept);
    # two routers take turns. With ``penalty``, a second text-encoder loss on one boundary starts in that same
    # call, so the boundary's node also receives a gradient of its own there. Each step against the per-loss
    # references, with hooks that scale differently.
    enc_a, enc_b = nn.Linear(4, 4).to(D), nn.Linear(4, 4).to(D)
    dec_a, dec_b = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(D), nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(D)
    grouped = {
        "tenc": [*enc_a.parameters(), *enc_b.parameters()],
        "unet": [*dec_a.parameters(), *dec_b.parameters()],
    }
    params = [*grouped["tenc"], *grouped["unet"]]
    routers = [gradroute.Router(grouped, autotune=False), gradroute.Router(grouped, autotune=False)]
    for step in range(70):
        x = torch.randn(1 + step, 4, dtype=D)
        mask = (torch.rand(1 + step, 4) > 0.5).to(D)

        def forward(x: torch.Tensor = x, mask: torch.Tensor = mask) -> dict[str, torch.Tensor]:
            a, b = enc_a(x), enc_b(x)
            if hooks:
                a.register_hook(lambda g: 2 * g)
                b.register_hook(lambda g: -g)
            loss = (dec_a(a) * dec_b(b) - 1) ** 2
            tenc = [loss.mean(), a.pow(2).mean()] if penalty else loss.mean()
            return {"tenc": tenc, "unet": (loss * mask).mean()}

        expected = reference_grads(forward, grouped)
        router = routers[step % 2]
        if step == 0:
            assert max(c.edges_in for c in router.plan(**forward()).calls) == 2  # the case this test is about
        router.backward(**forward())
        assert_grads_match(params, expected)
        for p in params:
            p.grad = None
