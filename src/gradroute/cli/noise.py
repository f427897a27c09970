"""The demo's noise schedule: cosine DDPM ``alpha_bar``, noising, the implied clean image, DDIM sampling."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


class NoiseSchedule:
    """A DDPM-style noise schedule (cosine ``alpha_bar``) with ``num_steps`` timesteps.

    Args:
        num_steps: number of diffusion timesteps.

    Example:
        >>> s = NoiseSchedule(100)
        >>> x0, noise = torch.zeros(2, 3, 4, 4), torch.ones(2, 3, 4, 4)
        >>> s.add_noise(x0, noise, torch.tensor([0, 99])).shape
        torch.Size([2, 3, 4, 4])
    """

    def __init__(self, num_steps: int = 100) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
            raise ValueError(f"`num_steps` must be an int >= 2, got {num_steps!r}")
        self.num_steps = num_steps
        s = 0.008
        t = torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
        f = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
        betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        self.alphas_cumprod = torch.cumprod(1 - betas, 0).float()

    def _abar(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.alphas_cumprod.to(like.device)[t.to(like.device)].view(-1, 1, 1, 1).to(like.dtype)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``sqrt(abar_t) * x0 + sqrt(1 - abar_t) * noise``."""
        a = self._abar(t, x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def predict_x0(self, x_t: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean image implied by a noise prediction ``eps`` at timestep ``t``, clamped to [-1, 1]."""
        a = self._abar(t, x_t)
        return ((x_t - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)

    @torch.no_grad()
    def sample(
        self,
        eps_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shape: Sequence[int],
        generator: torch.Generator,
        steps: int = 20,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Deterministic DDIM sampling from noise: ``eps_fn(x_t, t)`` predicts the noise."""
        x = torch.randn(*shape, generator=generator).to(device)
        ts = torch.linspace(self.num_steps - 1, 0, steps).round().long().tolist()
        for k, t in enumerate(ts):
            tt = torch.full((shape[0],), t, dtype=torch.long, device=x.device)
            eps = eps_fn(x, tt).float()
            x0 = self.predict_x0(x, eps, tt)
            if k + 1 == len(ts):
                return x0
            a_prev = float(self.alphas_cumprod[ts[k + 1]])
            x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
        return x


SCHEDULE = NoiseSchedule(100)
