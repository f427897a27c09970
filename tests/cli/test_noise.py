"""The demo's noise schedule: decreasing, invertible, deterministic sampling."""

from __future__ import annotations

import math

import pytest
import torch

from gradroute.cli.noise import NoiseSchedule


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_schedule_is_decreasing_in_unit_interval():
    a = NoiseSchedule(50).alphas_cumprod
    assert a.shape == (50,)
    assert bool((a[1:] < a[:-1]).all())
    assert 0 < float(a[-1]) < 0.01 and 0.99 < float(a[0]) <= 1


def test_predict_x0_inverts_add_noise():
    s = NoiseSchedule(100)
    x0 = torch.rand(4, 3, 8, 8) * 1.8 - 0.9
    noise = torch.randn(4, 3, 8, 8)
    t = torch.tensor([0, 10, 50, 90])
    torch.testing.assert_close(s.predict_x0(s.add_noise(x0, noise, t), noise, t), x0, rtol=0, atol=2e-4)


def test_sample_is_deterministic_and_uses_the_model():
    s = NoiseSchedule(100)
    calls = []

    def eps(x, t):
        calls.append(int(t[0]))
        return torch.zeros_like(x)

    a = s.sample(eps, (2, 3, 4, 4), gen(1), steps=5)
    b = s.sample(eps, (2, 3, 4, 4), gen(1), steps=5)
    assert torch.equal(a, b) and a.shape == (2, 3, 4, 4)
    assert calls[:5] == [99, 74, 50, 25, 0]
    assert a.min() >= -1 and a.max() <= 1 and math.isfinite(float(a.sum()))


@pytest.mark.parametrize("steps", [1, 0, 2.5])
def test_schedule_bad_num_steps_fails(steps):
    with pytest.raises(ValueError, match="`num_steps`"):
        NoiseSchedule(steps)
