"""``warmup_power`` against the schedules torch and transformers ship, where their behaviours overlap."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import LinearLR, LRScheduler, PolynomialLR, SequentialLR

from gradroute.schedules import warmup_power


def _lrs(make, steps: int) -> list[list[float]]:
    """The learning rate of each of two parameter groups (base lrs 1.0 and 0.5) at every optimizer step."""
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (1.0, 0.5)]
    opt = torch.optim.SGD(groups, lr=1.0)
    sched: LRScheduler = make(opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("warmup", [1, 3, 7])
@pytest.mark.parametrize("exponent", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("total", [10, 25])
def test_warmup_power_equals_torch_sequential_linear_then_polynomial(warmup: int, exponent: float, total: int):
    # without a floor or jitter: LinearLR from 1/warmup to 1 over the warmup, then PolynomialLR down to 0
    ours = _lrs(lambda o: warmup_power(o, warmup, exponent, total), total + 3)
    theirs = _lrs(
        lambda o: SequentialLR(
            o, [LinearLR(o, 1 / warmup, 1.0, max(warmup - 1, 1)), PolynomialLR(o, total - warmup, exponent)], [warmup]
        ),
        total + 3,
    )
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("warmup", [0, 4])
@pytest.mark.parametrize("exponent", [1.0, 3.0])
@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_warmup_power_decay_equals_transformers_polynomial_decay(warmup: int, exponent: float, min_lr_ratio: float):
    # transformers' warmup runs its first step at lr 0 (factor s / warmup, ours (s + 1) / warmup); from the end of
    # the warmup on, and with no warmup everywhere, the two schedules agree, lr_end being min_lr_ratio * lr
    transformers = pytest.importorskip("transformers")
    total = 12
    ours = _lrs(lambda o: warmup_power(o, warmup, exponent, total, min_lr_ratio=min_lr_ratio), total + 3)
    theirs = _lrs(
        lambda o: transformers.get_polynomial_decay_schedule_with_warmup(
            o, warmup, total, lr_end=min_lr_ratio * 1.0, power=exponent
        ),
        total + 3,
    )
    torch.testing.assert_close(torch.tensor(ours[warmup:]), torch.tensor(theirs[warmup:]), rtol=1e-12, atol=1e-15)
