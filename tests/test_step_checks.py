"""gradroute._step_checks: every bad argument or state of Router.step() and load_state_dict is refused before
anything is touched (construction, each step(), each load), with an error that names what it got."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from gradroute.schedules import warmup_power
from tests._state import assert_same, whole_state
from tests._step_setup import Setup, backward_again, losses, make_batches, make_nets, trained_once

# ---------------------------------------------------------------------- construction


def test_optimizer_missing_group_parameters_fails() -> None:
    tenc, unet = make_nets()
    partial = torch.optim.SGD(tenc[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"is missing 2 parameter\(s\): `tenc\.2\.weight` \(8x8\), `tenc\.2\.bias`"):
        gradroute.Router(tenc=gradroute.Group(tenc, optimizer=partial), unet=unet)


def test_optimizer_with_extra_parameters_fails() -> None:
    tenc, unet = make_nets()
    both = torch.optim.SGD([*tenc.parameters(), *unet.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"also holds 4 parameter\(s\): `unet\.0\.weight` \(8x8\)"):
        gradroute.Router(tenc=gradroute.Group(tenc, optimizer=both), unet=unet)


def test_same_parameters_in_two_stepped_groups_fails() -> None:
    tenc, _ = make_nets()
    with pytest.raises(ValueError, match="is in groups `a` and `b`, which both have an optimizer"):
        gradroute.Router(
            a=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)),
            b=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)),
        )


@pytest.mark.parametrize("accumulate", [0, -2])
def test_accumulate_below_one_fails(accumulate: int) -> None:
    tenc, unet = make_nets()
    with pytest.raises(ValueError, match=rf"`accumulate` must be >= 1, got {accumulate}"):
        gradroute.Router(tenc=tenc, unet=unet, accumulate=accumulate)


@pytest.mark.parametrize("accumulate", [2.0, "4", True, None])
def test_accumulate_not_an_int_fails(accumulate: Any) -> None:
    tenc, unet = make_nets()
    with pytest.raises(TypeError, match=r"`accumulate` must be an int >= 1, got"):
        gradroute.Router(tenc=tenc, unet=unet, accumulate=accumulate)


def test_scheduler_of_another_groups_optimizer_fails() -> None:
    tenc, unet = make_nets()
    opt_t, opt_u = torch.optim.SGD(tenc.parameters(), lr=0.1), torch.optim.SGD(unet.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler of group `tenc` is bound to the optimizer of group `unet`"):
        gradroute.Router(
            tenc=gradroute.Group(tenc, optimizer=opt_t, scheduler=warmup_power(opt_u, 1, 1.0, 3)),
            unet=gradroute.Group(unet, optimizer=opt_u),
        )


def test_scheduler_without_optimizer_fails() -> None:
    tenc, unet = make_nets()
    sched = warmup_power(torch.optim.SGD(tenc.parameters(), lr=0.1), 1, 1.0, 3)
    with pytest.raises(ValueError, match="group `tenc` has a `scheduler` but no `optimizer`"):
        gradroute.Router(tenc=gradroute.Group(tenc, scheduler=sched), unet=unet)


def test_reduce_lr_on_plateau_scheduler_fails() -> None:
    tenc, unet = make_nets()
    opt = torch.optim.SGD(tenc.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match="ReduceLROnPlateau, which steps on a metric"):
        gradroute.Router(tenc=gradroute.Group(tenc, optimizer=opt, scheduler=plateau), unet=unet)


def test_scaler_of_wrong_type_fails() -> None:
    tenc, unet = make_nets()
    with pytest.raises(TypeError, match=r"`scaler` must be a torch.amp.GradScaler or None, got float"):
        gradroute.Router(tenc=tenc, unet=unet, scaler=65536.0)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_skip_nonfinite_not_a_bool_fails(value: Any) -> None:
    with pytest.raises(TypeError, match=rf"`skip_nonfinite` must be True or False, got {type(value).__name__}"):
        gradroute.Router(a=nn.Linear(2, 2), skip_nonfinite=value)


@pytest.mark.parametrize(("value", "error"), [(1, TypeError), (None, TypeError), ("yes", ValueError)])
def test_atomic_step_other_than_true_false_copy_fails(value: Any, error: type) -> None:
    name = type(value).__name__
    with pytest.raises(error, match=rf"`atomic_step` must be True, False or 'copy', got .*{value!r}") as info:
        gradroute.Router(a=nn.Linear(2, 2), atomic_step=value)
    assert error is ValueError or name in str(info.value)


# ---------------------------------------------------------------------- each step(), before anything is touched


def test_step_with_a_group_without_optimizer_fails() -> None:
    tenc, unet = make_nets()
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)), unet=unet
    )
    loss_tenc, loss_unet = losses(tenc, unet, make_batches(1)[0], None)
    router.backward(tenc=loss_tenc, unet=loss_unet)
    grads = [p.grad.clone() for m in (tenc, unet) for p in m.parameters()]
    params = [p.detach().clone() for m in (tenc, unet) for p in m.parameters()]
    with pytest.raises(RuntimeError, match="needs an optimizer for every group; group `unet` has none"):
        router.step()
    for g, p, q in zip(grads, params, [p for m in (tenc, unet) for p in m.parameters()], strict=True):
        assert torch.equal(g, q.grad) and torch.equal(p, q.detach())


def test_optimizer_changed_after_construction_fails() -> None:
    s, router = trained_once()
    backward_again(s, router)
    s.opt_t.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    before = whole_state(router)
    with pytest.raises(RuntimeError, match=r"also holds 1 parameter\(s\).*changed after the Router was built"):
        router.step()
    assert_same(before, whole_state(router))


def test_scheduler_changed_to_another_optimizer_fails() -> None:
    s, router = trained_once()
    backward_again(s, router)
    s.sched_t.optimizer = s.opt_u
    before = whole_state(router)
    with pytest.raises(RuntimeError, match=r"bound to the optimizer of group `unet`.*changed after the Router"):
        router.step()
    assert_same(before, whole_state(router))


def test_step_after_manual_unscale_fails() -> None:
    s, router = trained_once()
    backward_again(s, router)
    s.scaler.unscale_(s.opt_u)
    before = whole_state(router)
    with pytest.raises(RuntimeError, match=r"scaler was already used on group `unet`'s optimizer.*stage UNSCALED"):
        router.step()
    assert_same(before, whole_state(router))


def test_float16_gradients_with_scaler_fails() -> None:
    tenc, unet = make_nets(dtype=torch.float16)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)),
        unet=gradroute.Group(unet, optimizer=torch.optim.SGD(unet.parameters(), lr=0.1)),
        scaler=torch.amp.GradScaler("cpu", init_scale=1.0),
    )
    x, target, mask = make_batches(1, dtype=torch.float16)[0]
    loss = (unet(tenc(x)) - target).pow(2)  # not mse_loss: torch 2.5 has no float16 mse_loss backward on the CPU
    router.backward(tenc=loss.mean(), unet=(loss * mask).mean())
    grads = [p.grad.clone() for m in (tenc, unet) for p in m.parameters()]
    with pytest.raises(ValueError, match=r"`tenc\.0\.weight` \(8x4\) of group `tenc` has float16 gradients"):
        router.step()
    assert all(
        torch.equal(g, p.grad) for g, p in zip(grads, [p for m in (tenc, unet) for p in m.parameters()], strict=True)
    )


# ---------------------------------------------------------------------- load_state_dict checks everything first


def test_load_state_dict_of_something_else_fails() -> None:
    s = Setup("sgd", "fp32")
    with pytest.raises(ValueError, match=r"is not from Router\.state_dict"):
        s.router().load_state_dict(s.opt_t.state_dict())


def _saved_keys() -> list[str]:
    """The keys of what ``Router.state_dict()`` writes, but its format tag (read once, at collection)."""
    _, router = trained_once()
    return [k for k in router.state_dict() if k != "format"]


@pytest.mark.parametrize("key", _saved_keys())
def test_load_state_dict_missing_key_fails(key: str) -> None:
    _, router = trained_once()
    saved = router.state_dict()
    del saved[key]
    before = whole_state(router)
    with pytest.raises(ValueError, match=rf"`state_dict` has no key '{key}'"):
        router.load_state_dict(saved)
    assert_same(before, whole_state(router))


def test_load_state_dict_with_other_groups_fails() -> None:
    _, router = trained_once()
    saved = router.state_dict()
    other = Setup("adamw-foreach", "fp16-scaler", seed=3)
    lone = gradroute.Router(tenc=gradroute.Group(other.tenc, optimizer=other.opt_t), scaler=other.scaler)
    before = copy.deepcopy(other.opt_t.state_dict())
    with pytest.raises(ValueError, match=r"has optimizers for groups \['tenc', 'unet'\], this Router for groups"):
        lone.load_state_dict(saved)
    assert_same(before, other.opt_t.state_dict())


def test_load_state_dict_without_scaler_fails() -> None:
    _, router = trained_once()
    saved = router.state_dict()
    fresh = Setup("adamw-foreach", "fp32", seed=3)
    target = fresh.router()
    before = whole_state(target)
    with pytest.raises(ValueError, match="holds a scaler's state; this Router has no `scaler`"):
        target.load_state_dict(saved)
    assert_same(before, whole_state(target))


def test_load_state_dict_from_another_window_size_fails() -> None:
    s = Setup("sgd", "fp32")
    router = s.router(accumulate=3)
    backward_again(s, router)
    router.step()
    saved = router.state_dict()
    other = Setup("sgd", "fp32")
    with pytest.raises(ValueError, match="saved inside an accumulation window of 3 micro-batches; this Router has"):
        other.router(accumulate=4).load_state_dict(saved)


def test_load_state_dict_with_moments_of_other_shapes_fails() -> None:
    """Same parameter counts, other shapes: the saved AdamW moments cannot belong to these parameters."""
    _, router = trained_once()
    saved = router.state_dict()
    torch.manual_seed(5)
    tenc = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(8, 8))  # the first layer transposed
    _, unet = make_nets(5)
    opt_t, opt_u = torch.optim.AdamW(tenc.parameters()), torch.optim.AdamW(unet.parameters())
    target = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opt_t, scheduler=warmup_power(opt_t, 2, 2.0, 6)),
        unet=gradroute.Group(unet, optimizer=opt_u, scheduler=warmup_power(opt_u, 2, 2.0, 6)),
        scaler=torch.amp.GradScaler("cpu"),
    )
    before = whole_state(target)
    with pytest.raises(
        ValueError, match=r"`state_dict\['optimizers'\]\['tenc'\]\['state'\]\[0\]\['exp_avg'\]` has shape \(8, 4\)"
    ):
        target.load_state_dict(saved)
    assert_same(before, whole_state(target))


def test_load_state_dict_with_gradients_of_another_dtype_fails() -> None:
    s, router = trained_once()
    backward_again(s, router)
    saved = router.state_dict()
    saved["grads"]["unet"][0] = saved["grads"]["unet"][0].double()
    before = whole_state(router)
    with pytest.raises(ValueError, match=r"gradient 0 of group `unet` has shape \(8, 8\), torch.float64"):
        router.load_state_dict(saved)
    assert_same(before, whole_state(router))


@pytest.mark.parametrize("value", ["1.5", [1.0], None])
def test_load_state_dict_with_a_loss_that_is_not_a_number_fails(value: Any) -> None:
    s, router = trained_once()
    backward_again(s, router)
    saved = router.state_dict()
    saved["losses"]["tenc"] = value
    with pytest.raises(TypeError, match=r"`state_dict\['losses'\]\['tenc'\]` must be a scalar float tensor"):
        router.load_state_dict(saved)
