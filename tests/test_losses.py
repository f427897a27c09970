"""Groups routed the same loss: one plain backward into all their parameters (NOTE [One loss routed to several
groups] in ``_losses.py``), against per-loss references and a plain backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradroute
from tests._reference import assert_grads_match, reference_grads

D = torch.float64


def _nets() -> tuple[nn.Module, nn.Module, nn.Module]:
    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).to(D)

    return mlp(), mlp(), mlp()


def _loss(tenc: nn.Module, unet: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(5, 4, generator=g, dtype=D), torch.randn(5, 4, generator=g, dtype=D)
    return (unet(tenc(x)) - target).pow(2).mean()


def test_same_loss_routed_to_two_groups_is_one_plain_backward():
    tenc, unet, _ = _nets()
    params = [*tenc.parameters(), *unet.parameters()]
    plain = torch.autograd.grad(_loss(tenc, unet), params)
    router = gradroute.Router(tenc=tenc, unet=unet)
    loss = _loss(tenc, unet)
    plan = router.plan(tenc=loss, unet=loss)
    assert len(plan.calls) == 1 and not any(plan.leaks.values())
    assert any("`tenc`, `unet` are routed the same loss" in n for n in plan.notes)
    router.backward(tenc=loss, unet=loss)
    for p, g in zip(params, plain, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_same_loss_with_another_group_routed_its_own_loss_exact():
    tenc, unet, head = _nets()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters()), "head": list(head.parameters())}

    def forward() -> dict[str, torch.Tensor]:
        loss = _loss(tenc, unet)
        return {"tenc": loss, "unet": loss, "head": head(unet(tenc(torch.ones(2, 4, dtype=D)))).pow(2).mean()}

    expected = reference_grads(forward, groups)
    router = gradroute.Router(groups)
    losses = forward()
    router.backward(**losses)
    assert_grads_match([p for ps in groups.values() for p in ps], expected, rtol=1e-12, atol=1e-14)


def test_same_loss_to_groups_sharing_a_parameter_gives_it_the_sum():
    # a parameter in both groups needs the loss's gradient once per group: those groups are routed as usual
    tenc, unet, _ = _nets()
    groups = {"tenc": [*tenc.parameters(), unet[0].weight], "unet": list(unet.parameters())}

    def forward() -> dict[str, torch.Tensor]:
        loss = _loss(tenc, unet)
        return {"tenc": loss, "unet": loss}

    expected = reference_grads(forward, groups)
    loss = _loss(tenc, unet)
    router = gradroute.Router(groups)
    assert not any(n.startswith("`tenc`, `unet`") for n in router.plan(tenc=loss, unet=loss).notes)
    router.backward(tenc=loss, unet=loss)
    params = list({id(p): p for ps in groups.values() for p in ps}.values())
    assert_grads_match(params, expected, rtol=1e-12, atol=1e-14)  # the shared weight: twice the loss's gradient


@pytest.mark.parametrize("accumulate", [1, 2])
def test_same_loss_scaled_once_for_accumulation(accumulate):
    tenc, unet, _ = _nets()
    params = [*tenc.parameters(), *unet.parameters()]
    plain = torch.autograd.grad(_loss(tenc, unet) / accumulate, params)
    router = gradroute.Router(tenc=tenc, unet=unet, accumulate=accumulate)
    loss = _loss(tenc, unet)
    router.backward(tenc=loss, unet=loss)
    for p, g in zip(params, plain, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_same_loss_grads_reports_each_group_on_its_own():
    tenc, unet, _ = _nets()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    loss = _loss(tenc, unet)
    got = gradroute.Router(groups).grads(tenc=loss, unet=loss)
    plain = torch.autograd.grad(_loss(tenc, unet), groups["tenc"] + groups["unet"])
    for g, want in zip([*got["tenc"], *got["unet"]], plain, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert all(p.grad is None for ps in groups.values() for p in ps)


def test_same_loss_that_reaches_none_of_one_group_fails():
    tenc, unet, _ = _nets()
    loss = unet(tenc(torch.ones(2, 4, dtype=D)).detach()).pow(2).mean()
    router = gradroute.Router(tenc=tenc, unet=unet)
    with pytest.raises(ValueError, match=r"loss for group `tenc` reaches none of that group's 4 parameters"):
        router.backward(tenc=loss, unet=loss)
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])
    expected = torch.autograd.grad(loss, list(unet.parameters()), retain_graph=True)
    # the refused call ran nothing of the graph (NOTE [One plain call without a walk], rule 3): it is still whole
    gradroute.Router(tenc=tenc, unet=unet, allow_unreached=["tenc"]).backward(tenc=loss, unet=loss)
    for p, g in zip(unet.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


# ---------------------------------------------------------------- one plain call (NOTE [One plain call without a walk])

_STEPS = ["chain", "outside", "frozen", "accumulate", "hooked", "chain", "tied", "late_branch", "chain"]


def _step_losses(kind: str, tenc: nn.Module, unet: nn.Module, head: nn.Module, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    x, target = torch.randn(5, 4, generator=g, dtype=D), torch.randn(5, 4, generator=g, dtype=D)
    hidden = tenc(x)
    if kind == "outside":  # a module in no group requires grad: a plain backward would write it, routing must not
        hidden = hidden + head(x)
    if kind == "detached":  # a stray detach: the loss reaches none of the text encoder
        hidden = hidden.detach()
    if kind == "late_branch":  # a second path from the text encoder into the loss, from this step on
        return (unet(hidden) - target).pow(2).mean() + hidden.pow(2).mean()
    return (unet(hidden) - target).pow(2).mean()


_WALKED = ("frozen", "accumulate", "hooked")  # a parameter frozen since the forward, a .grad to add to, a hook


def _same_loss_sequence(kinds: list[str]) -> None:
    """Route one loss to both groups on each step of ``kinds``, every step against per-loss references."""
    tenc, unet, head = _nets()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    router = gradroute.Router(groups)
    plain_expected = walked_expected = 0
    for k, kind in enumerate(kinds):
        tenc[0].bias.requires_grad_(kind != "frozen")
        tied = {"tenc": [*groups["tenc"], unet[0].weight], "unet": groups["unet"]} if kind == "tied" else groups
        r = gradroute.Router(tied) if kind == "tied" else router
        handle = tenc[0].weight.register_hook(lambda g: g * 2) if kind == "hooked" else None
        live = {n: [p for p in ps if p.requires_grad] for n, ps in tied.items()}

        def forward(kind: str = kind, k: int = k) -> dict[str, torch.Tensor]:
            loss = _step_losses(kind, tenc, unet, head, k)
            return {"tenc": loss, "unet": loss}

        expected = reference_grads(forward, live)  # with the hook (doubling a gradient) in place
        for p in [*tenc.parameters(), *unet.parameters(), *head.parameters()]:
            p.grad = None
        if kind == "accumulate":  # a gradient to add to: the walk's path, then compared without it
            before = {id(p): torch.full_like(p, 0.5) for ps in live.values() for p in ps}
            for ps in live.values():
                for p in ps:
                    p.grad = before[id(p)].clone()
            expected = {i: g + before[i] for i, g in expected.items()}
        losses = forward()
        if kind == "detached":  # the loss reaches none of the text encoder: refused, nothing run
            with pytest.raises(ValueError, match=r"loss for group `tenc` reaches none"):
                r.backward(**losses)
            assert all(p.grad is None for ps in live.values() for p in ps)
            losses["unet"].backward()  # the graph is still whole
            continue
        r.backward(**losses)
        if handle is not None:
            handle.remove()
        if r is router:
            walked_expected += kind in _WALKED
            plain_expected += kind not in _WALKED
        assert_grads_match([p for ps in live.values() for p in ps], expected, rtol=0, atol=0)
        assert all(p.grad is None for p in head.parameters()), kind
        assert tenc[0].bias.grad is None or kind != "frozen"
    assert router.graph_counts.plain == plain_expected
    assert router.graph_counts.walked == walked_expected


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_same_loss_sequence_of_changing_graphs_exact(order):
    _same_loss_sequence(_STEPS if order == "forward" else _STEPS[::-1])


@settings(max_examples=20, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from([*_STEPS, "detached"]), min_size=3, max_size=10))
def test_same_loss_generated_sequences_exact(kinds):
    _same_loss_sequence(kinds)


@pytest.mark.parametrize("failure", ["freed", "hook"])
def test_same_loss_failure_in_the_engine_leaves_every_grad_none(failure):
    tenc, unet, _ = _nets()
    hidden = tenc(torch.ones(2, 4, dtype=D))
    loss = unet(hidden).pow(2).mean()
    if failure == "freed":
        hidden.sum().backward(inputs=list(tenc.parameters()))  # frees the text encoder's part of the graph
        for p in tenc.parameters():
            p.grad = None
        error: type[Exception] = gradroute.GraphFreedError
    else:

        def fail(g: torch.Tensor) -> torch.Tensor:
            raise KeyError("from a hook")

        hidden.register_hook(fail)  # runs after the UNet's parameters were written
        error = KeyError
    with pytest.raises(error):
        gradroute.Router(tenc=tenc, unet=unet).backward(tenc=loss, unet=loss)
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])
