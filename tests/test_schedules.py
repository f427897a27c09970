"""gradroute.schedules.warmup_power: values at known steps (by formula), jitter, resume, argument errors."""

from __future__ import annotations

import doctest
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LinearLR, PolynomialLR, SequentialLR

import gradroute
from gradroute.schedules import warmup_power


def _optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=1.0)


def _expected_factor(s: int, warmup: int, exponent: float, total: int, min_ratio: float) -> float:
    """The documented formula, written out independently of the implementation."""
    if s < warmup:
        return (s + 1) / warmup
    if s >= total:
        return min_ratio
    remaining = 1.0 - (s - warmup) / (total - warmup)
    return min_ratio + (1.0 - min_ratio) * remaining**exponent


def _lrs(opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[list[float]]:
    """The learning rates each of ``steps`` optimizer steps uses (read before the scheduler steps)."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
@pytest.mark.parametrize(
    ("warmup", "exponent", "total"), [(30, 5.0, 100), (3, 1.0, 10), (0, 2.0, 5), (4, 0.5, 4), (2, 0.0, 6)]
)
def test_warmup_power_matches_formula(warmup: int, exponent: float, total: int, min_lr_ratio: float) -> None:
    opt = _optimizer(1e-3, 2e-2)
    sched = warmup_power(opt, warmup, exponent, total, min_lr_ratio=min_lr_ratio)
    for s, lrs in enumerate(_lrs(opt, sched, total + 3)):
        factor = _expected_factor(s, warmup, exponent, total, min_lr_ratio)
        assert lrs == pytest.approx([1e-3 * factor, 2e-2 * factor], rel=1e-12, abs=1e-300)


def test_warmup_power_known_values_of_the_seed_schedule() -> None:
    # custom_scheduler(warmup_steps=30, exponent=5): lr / 30 on the first step, full lr on steps 30 and 31,
    # (1/2) ** 5 of it half way through the decay, 0 at the end.
    opt = _optimizer(1.0)
    lrs = [lr for (lr,) in _lrs(opt, warmup_power(opt, 30, 5, 100), 101)]
    assert lrs[0] == pytest.approx(1 / 30, rel=1e-12)
    assert lrs[14] == pytest.approx(0.5, rel=1e-12)
    assert lrs[29] == lrs[30] == 1.0
    assert lrs[65] == pytest.approx(1 / 32, rel=1e-12)
    assert lrs[100] == 0.0


def test_warmup_power_jitter_is_seeded_bounded_and_leaves_global_rng_alone() -> None:
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    runs = {}
    for key, kwargs in {"a": {"seed": 1}, "a-again": {"seed": 1}, "b": {"seed": 2}, "off": {}}.items():
        opt = _optimizer(1.0)
        random_arg = 0.2 if key != "off" else False
        runs[key] = [lr for (lr,) in _lrs(opt, warmup_power(opt, 5, 2, 20, random=random_arg, **kwargs), 20)]
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    assert runs["a"] == runs["a-again"]
    assert runs["a"] != runs["b"]
    for s, (jittered, plain) in enumerate(zip(runs["a"], runs["off"], strict=True)):
        assert plain == pytest.approx(_expected_factor(s, 5, 2, 20, 0.0), rel=1e-12)
        assert plain * 0.8 - 1e-12 <= jittered <= plain * 1.2 + 1e-12
    assert sum(j != p for j, p in zip(runs["a"], runs["off"], strict=True)) >= 15


def test_warmup_power_random_true_means_amplitude_one_tenth() -> None:
    opt_a, opt_b = _optimizer(1.0), _optimizer(1.0)
    a = _lrs(opt_a, warmup_power(opt_a, 2, 1, 10, random=True, seed=3), 10)
    b = _lrs(opt_b, warmup_power(opt_b, 2, 1, 10, random=0.1, seed=3), 10)
    assert a == b


def test_warmup_power_resumes_from_its_state_dict(tmp_path: Path) -> None:
    opt = _optimizer(1e-3)
    sched = warmup_power(opt, 4, 3, 12, min_lr_ratio=0.05, random=0.3, seed=9)
    full = _lrs(opt, sched, 12)

    opt_b = _optimizer(1e-3)
    sched_b = warmup_power(opt_b, 4, 3, 12, min_lr_ratio=0.05, random=0.3, seed=9)
    first = _lrs(opt_b, sched_b, 5)
    torch.save({"opt": opt_b.state_dict(), "sched": sched_b.state_dict()}, tmp_path / "s.pt")
    saved = torch.load(tmp_path / "s.pt", weights_only=True)

    opt_c = _optimizer(1.0)
    sched_c = warmup_power(opt_c, 1, 1, 2)  # other settings: the state dict carries the schedule's own
    opt_c.load_state_dict(saved["opt"])
    sched_c.load_state_dict(saved["sched"])
    assert first + _lrs(opt_c, sched_c, 7) == full


def test_warmup_power_last_epoch_continues_a_schedule() -> None:
    opt = _optimizer(0.5)
    for g in opt.param_groups:
        g["initial_lr"] = 0.5
    sched = warmup_power(opt, 10, 2, 20, last_epoch=4)
    assert sched.last_epoch == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * _expected_factor(5, 10, 2, 20, 0.0), rel=1e-12)


def test_warmup_power_is_a_lambda_lr_usable_as_a_group_scheduler() -> None:
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = warmup_power(opt, 2, 1, 4)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    router = gradroute.Router(net=gradroute.Group(net, optimizer=opt, scheduler=sched))
    router.backward(net=net(torch.ones(1, 2)).sum())
    assert router.step()["net"].lr == pytest.approx(0.5e-3, rel=1e-12)
    assert sched.last_epoch == 1


def test_schedules_docstring_example_runs() -> None:
    import gradroute.schedules

    result = doctest.testmod(gradroute.schedules, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("warmup", [-1, -30])
def test_warmup_power_negative_warmup_fails(warmup: int) -> None:
    with pytest.raises(ValueError, match=rf"`warmup_steps` must be >= 0, got {warmup}"):
        warmup_power(_optimizer(1.0), warmup, 1.0, 10)


@pytest.mark.parametrize("warmup", [2.0, "3", None, True])
def test_warmup_power_non_int_warmup_fails(warmup: Any) -> None:
    with pytest.raises(TypeError, match=r"`warmup_steps` must be an int, got"):
        warmup_power(_optimizer(1.0), warmup, 1.0, 10)


def test_warmup_power_total_before_warmup_fails() -> None:
    with pytest.raises(ValueError, match=r"`total_steps` \(5\) must be at least `warmup_steps` \(6\)"):
        warmup_power(_optimizer(1.0), 6, 1.0, 5)


def test_warmup_power_zero_total_fails() -> None:
    with pytest.raises(ValueError, match=r"`total_steps` must be >= 1, got 0"):
        warmup_power(_optimizer(1.0), 0, 1.0, 0)


@pytest.mark.parametrize("exponent", [-1.0, -0.5])
def test_warmup_power_negative_exponent_fails(exponent: float) -> None:
    with pytest.raises(ValueError, match=r"`exponent` must be >= 0"):
        warmup_power(_optimizer(1.0), 1, exponent, 10)


@pytest.mark.parametrize("exponent", [float("nan"), float("inf")])
def test_warmup_power_non_finite_exponent_fails(exponent: float) -> None:
    with pytest.raises(ValueError, match=r"`exponent` must be finite"):
        warmup_power(_optimizer(1.0), 1, exponent, 10)


def test_warmup_power_exponent_not_a_number_fails() -> None:
    with pytest.raises(TypeError, match=r"`exponent` must be a number, got str"):
        warmup_power(_optimizer(1.0), 1, "5", 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_warmup_power_min_lr_ratio_out_of_range_fails(ratio: float) -> None:
    with pytest.raises(ValueError, match=r"`min_lr_ratio` must be in \[0, 1\]"):
        warmup_power(_optimizer(1.0), 1, 1.0, 10, min_lr_ratio=ratio)


@pytest.mark.parametrize("amplitude", [1.0, -0.1, 2])
def test_warmup_power_jitter_amplitude_out_of_range_fails(amplitude: float) -> None:
    with pytest.raises(ValueError, match=r"`random` as a jitter amplitude must be in \[0, 1\)"):
        warmup_power(_optimizer(1.0), 1, 1.0, 10, random=amplitude)


def test_warmup_power_random_of_wrong_type_fails() -> None:
    with pytest.raises(TypeError, match=r"`random` must be a number, got str"):
        warmup_power(_optimizer(1.0), 1, 1.0, 10, random="yes")  # type: ignore[arg-type]


def test_warmup_power_without_optimizer_fails() -> None:
    with pytest.raises(TypeError, match=r"`optimizer` must be a torch.optim.Optimizer, got list"):
        warmup_power([torch.zeros(1)], 1, 1.0, 10)  # type: ignore[arg-type]


# ---------------------------------------------------------------- against torch's and transformers' schedules


def _reference_lrs(make: Any, steps: int) -> list[list[float]]:
    """The learning rate of each of two parameter groups (base lrs 1.0 and 0.5) at every optimizer step."""
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (1.0, 0.5)]
    opt = torch.optim.SGD(groups, lr=1.0)
    return _lrs(opt, make(opt), steps)


@pytest.mark.parametrize("warmup", [1, 3, 7])
@pytest.mark.parametrize("exponent", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("total", [10, 25])
def test_warmup_power_equals_torch_sequential_linear_then_polynomial(warmup: int, exponent: float, total: int):
    # without a floor or jitter: LinearLR from 1/warmup to 1 over the warmup, then PolynomialLR down to 0
    ours = _reference_lrs(lambda o: warmup_power(o, warmup, exponent, total), total + 3)
    theirs = _reference_lrs(
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
    ours = _reference_lrs(lambda o: warmup_power(o, warmup, exponent, total, min_lr_ratio=min_lr_ratio), total + 3)
    theirs = _reference_lrs(
        lambda o: transformers.get_polynomial_decay_schedule_with_warmup(
            o, warmup, total, lr_end=min_lr_ratio * 1.0, power=exponent
        ),
        total + 3,
    )
    torch.testing.assert_close(torch.tensor(ours[warmup:]), torch.tensor(theirs[warmup:]), rtol=1e-12, atol=1e-15)
