"""``gan``: generator -> discriminator, one discriminator forward on the fakes shared by both losses
(non-saturating): ``D`` gets ``softplus(-D(real)) + softplus(D(fake))``, ``G`` gets ``softplus(-D(fake))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import make_batch
from .workload import Workload


class _Generator(nn.Module):
    def __init__(self, z_dim: int, w: int) -> None:
        super().__init__()
        self.w = w
        self.fc = nn.Linear(z_dim, 4 * w * 4 * 4)
        chans = [4 * w, 2 * w, w, w]
        blocks: list[nn.Module] = []
        for cin, cout in itertools.pairwise(chans):
            blocks += [
                nn.Upsample(scale_factor=2.0, mode="nearest"),
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.GroupNorm(8, cout),
                nn.SiLU(),
            ]
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Conv2d(w, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.fc(z).view(z.shape[0], 4 * self.w, 4, 4)
        return torch.tanh(self.out(self.blocks(h)))


class _Discriminator(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, w, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(w, 2 * w, 4, stride=2, padding=1),
            nn.GroupNorm(8, 2 * w),
            nn.LeakyReLU(0.2),
            nn.Conv2d(2 * w, 4 * w, 4, stride=2, padding=1),
            nn.GroupNorm(8, 4 * w),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(4 * w * 4 * 4, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)  # type: ignore[no-any-return]


def build_gan(bs: int, dev: torch.device, seed: int, width: int) -> Workload:
    if width < 8 or width % 8:
        raise ValueError(f"`width` must be a positive multiple of 8 for `gan`, got {width!r}")
    z_dim = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gen, disc = _Generator(z_dim, width), _Discriminator(width)
    gen.to(dev)
    disc.to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {"z": torch.randn(bs, z_dim, generator=g).to(dev), "real": make_batch(bs, g, device=dev)["images"]}

    def up(b: dict[str, Any]) -> torch.Tensor:
        return gen(b["z"])  # type: ignore[no-any-return]

    def down(b: dict[str, Any], fake: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        d_fake = disc(fake).float()  # the one discriminator forward on the fakes, shared by both losses
        out = {}
        if "G" in need:
            out["G"] = F.softplus(-d_fake).mean()
        if "D" in need:
            out["D"] = F.softplus(-disc(b["real"]).float()).mean() + F.softplus(d_fake).mean()
        return out

    return Workload("gan", "G", "D", gen, disc, batch, up, down, {"width": width, "z_dim": z_dim})
