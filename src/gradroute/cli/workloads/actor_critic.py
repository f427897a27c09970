"""``actor-critic``: TD3-style. ``critic`` (twin Q) gets the TD error against a target made without grad
(target actor with clipped noise, min of target critics); ``actor`` gets ``-Q1(s, actor(s))``, through the
critic."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .workload import Workload


def _mlp(sizes: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if k + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Actor(nn.Module):
    def __init__(self, obs: int, act: int, hidden: int) -> None:
        super().__init__()
        self.net = _mlp([obs, hidden, hidden, act])

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(s))


class _TwinCritic(nn.Module):
    def __init__(self, obs: int, act: int, hidden: int) -> None:
        super().__init__()
        self.q1 = _mlp([obs + act, hidden, hidden, 1])
        self.q2 = _mlp([obs + act, hidden, hidden, 1])

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sa = torch.cat([s, a], 1)
        return self.q1(sa).squeeze(1), self.q2(sa).squeeze(1)

    def q1_only(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.q1(torch.cat([s, a], 1)).squeeze(1)  # type: ignore[no-any-return]


def build_actor_critic(bs: int, dev: torch.device, seed: int, hidden: int) -> Workload:
    if hidden < 1:
        raise ValueError(f"`width` must be positive for `actor-critic`, got {hidden!r}")
    obs, act, gamma = 24, 6, 0.99
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        actor, critic = _Actor(obs, act, hidden), _TwinCritic(obs, act, hidden)
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    for m in (actor, critic, actor_t, critic_t):
        m.to(dev)
    for p in (*actor_t.parameters(), *critic_t.parameters()):
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {
        "s": torch.randn(bs, obs, generator=g),
        "a": torch.rand(bs, act, generator=g) * 2 - 1,
        "r": torch.randn(bs, generator=g),
        "s2": torch.randn(bs, obs, generator=g),
        "done": (torch.rand(bs, generator=g) < 0.05).float(),
        "noise": (0.2 * torch.randn(bs, act, generator=g)).clamp(-0.5, 0.5),
    }
    batch = {k: v.to(dev) for k, v in batch.items()}

    def up(b: dict[str, Any]) -> torch.Tensor:
        return actor(b["s"])  # type: ignore[no-any-return]

    def down(b: dict[str, Any], a_pi: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        out = {}
        if "critic" in need:
            with torch.no_grad():
                a2 = (actor_t(b["s2"]) + b["noise"]).clamp(-1, 1)
                y = b["r"] + gamma * (1 - b["done"]) * torch.minimum(*critic_t(b["s2"], a2)).float()
            q1, q2 = critic(b["s"], b["a"])
            out["critic"] = F.mse_loss(q1.float(), y) + F.mse_loss(q2.float(), y)
        if "actor" in need:
            out["actor"] = -critic.q1_only(b["s"], a_pi).float().mean()
        return out

    return Workload("actor-critic", "actor", "critic", actor, critic, batch, up, down, {"hidden": hidden})
