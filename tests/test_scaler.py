"""gradroute._scaler: the one GradScaler of a Router tells which group's optimizer to skip and is updated once per
step (against PyTorch's AMP recipe, ``tests/_step_setup.py``); the adapter's answers against GradScaler's own.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from gradroute._scaler import Scaler
from tests._state import assert_same
from tests._step_setup import Setup, assert_params, losses, make_batches, reference_step


@pytest.mark.parametrize("opt_kind", ["adamw-foreach", "adamw-fused", "sgd"])
def test_inf_in_one_group_skips_only_that_optimizer(opt_kind: str) -> None:
    ours, ref = Setup(opt_kind, "fp16-scaler"), Setup(opt_kind, "fp16-scaler")
    router = ours.router(max_t=1.0)
    batches = make_batches(3)
    on_device = opt_kind == "adamw-fused"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, batch in enumerate(batches):
            inject = k == 1
            unet_before = [p.detach().clone() for p in ours.unet.parameters()]
            opt_u_before = copy.deepcopy(ours.opt_u.state_dict())
            scale_before = ours.scaler.get_scale()
            reference_step(ref, batch, 1.0, None, inf_unet=inject)
            loss_tenc, loss_unet = losses(ours.tenc, ours.unet, batch, ours.dtype, inf_unet=inject)
            router.backward(tenc=loss_tenc, unet=loss_unet)
            stats = router.step()
            assert stats["unet"].skipped is inject
            assert stats["tenc"].skipped is False
            assert_params(ours.params(), ref.params(), rtol=1e-5, atol=1e-7)
            if inject:
                assert not math.isfinite(stats["unet"].grad_norm)
                assert math.isfinite(stats["tenc"].grad_norm)
                for before, p in zip(unet_before, ours.unet.parameters(), strict=True):
                    assert torch.equal(before, p)  # the skipped network is unchanged, bit for bit
                assert_same(opt_u_before, ours.opt_u.state_dict())
                assert ours.scaler.get_scale() == scale_before * 0.5  # backed off once, not once per optimizer
                # a fused optimizer skips on the device: its schedule advances, as in torch's recipe
                assert ours.sched_u.last_epoch == (2 if on_device else 1) and ours.sched_t.last_epoch == 2
            assert ours.scaler.get_scale() == ref.scaler.get_scale()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    assert ours.sched_u.last_epoch == ref.sched_u.last_epoch == (3 if on_device else 2)


# ---------------------------------------------------------------------- the adapter, against GradScaler's own behaviour


def _two_optimizers(inf_in_b: bool, scale: float = 2.0**8) -> tuple[list, list, torch.amp.GradScaler]:
    """Two one-parameter SGD optimizers with scaled gradients (``b``'s made infinite), and their scaler."""
    params = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5)) for _ in range(2)]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1)
    for k, p in enumerate(params):
        loss = (p * torch.arange(1.0, 6.0)).sum()
        if k == 1 and inf_in_b:
            loss = loss * math.inf
        scaler.scale(loss).backward()
    return params, opts, scaler


@pytest.mark.parametrize("inf_in_b", [False, True])
def test_found_inf_says_which_optimizer_scaler_step_skips(inf_in_b: bool) -> None:
    params, opts, scaler = _two_optimizers(inf_in_b)
    adapter = Scaler(scaler)
    for opt in opts:
        scaler.unscale_(opt)
    told = [adapter.found_inf(opt, [p]) for opt, p in zip(opts, params, strict=True)]
    told_tensor = [bool(adapter.found_inf_tensor(opt, [p])) for opt, p in zip(opts, params, strict=True)]
    before = [p.detach().clone() for p in params]
    for opt in opts:
        scaler.step(opt)
    skipped = [torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True)]
    assert told == told_tensor == skipped == [False, inf_in_b]


def test_used_stage_is_the_stage_in_which_the_scaler_refuses_the_optimizer() -> None:
    _, opts, scaler = _two_optimizers(False)
    adapter = Scaler(scaler)
    assert adapter.used_stage(opts[0]) is None
    scaler.unscale_(opts[0])
    assert adapter.used_stage(opts[0]) == "UNSCALED" and adapter.used_stage(opts[1]) is None
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(opts[0])
    scaler.step(opts[0])
    assert adapter.used_stage(opts[0]) == "STEPPED"
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(opts[0])
    scaler.update()
    assert adapter.used_stage(opts[0]) is None


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("inf_in_b", [False, True])
@pytest.mark.parametrize("failed_after", ["unscale_", "update"])
def test_restore_puts_the_scaler_back_before_its_iteration(failed_after: str, inf_in_b: bool, sync: bool) -> None:
    params, opts, scaler = _two_optimizers(inf_in_b)
    twin_params, twin_opts, twin = _two_optimizers(inf_in_b)
    adapter = Scaler(scaler)
    snap = adapter.snapshot(sync=sync)
    for opt in opts:
        scaler.unscale_(opt)  # unscales the gradients in place: put back by hand below, as the step does
    if failed_after == "update":
        scaler.update()
        assert scaler.get_scale() != twin.get_scale()  # grew or backed off
    adapter.restore(snap)
    assert scaler.state_dict() == twin.state_dict()
    for p, q in zip(params, twin_params, strict=True):
        p.grad = q.grad.clone()
    for s, os_ in ((scaler, opts), (twin, twin_opts)):  # the scaler accepts the iteration again, as the twin does
        for opt in os_:
            s.unscale_(opt)
            s.step(opt)
        s.update()
    assert scaler.state_dict() == twin.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params, strict=True))


@pytest.mark.parametrize(
    ("init_scale", "growth_factor", "backoff_factor", "exact"),
    [(2.0**16, 2.0, 0.5, True), (2.0**8, 4.0, 0.25, True), (1000.0, 2.0, 0.5, False), (2.0**8, 1.5, 0.5, False)],
)
def test_unscale_is_exact_when_every_scale_is_a_power_of_two(
    init_scale: float, growth_factor: float, backoff_factor: float, exact: bool
) -> None:
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor
    )
    assert Scaler(scaler).unscale_is_exact() is exact
    if exact:  # what the claim is for: unscaled gradients multiplied back by the scale are the scaled ones
        p = torch.nn.Parameter(torch.zeros(1000))
        p.grad = scaler.scale(torch.randn(1000))
        scaled = p.grad.clone()
        scaler.unscale_(torch.optim.SGD([p], lr=0.1))
        torch.testing.assert_close(p.grad * scaler.get_scale(), scaled, rtol=0, atol=0)


def test_enabled_only_with_an_enabled_scaler() -> None:
    assert Scaler(None).enabled is False
    assert Scaler(torch.amp.GradScaler("cpu", enabled=False)).enabled is False
    assert Scaler(torch.amp.GradScaler("cpu")).enabled is True
    assert Scaler(None).snapshot() is None
