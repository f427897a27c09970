"""gradroute._scaler: the one GradScaler of a Router tells which group's optimizer to skip, and is updated
once per step (against PyTorch's AMP recipe, ``tests/_step_setup.py``)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

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
