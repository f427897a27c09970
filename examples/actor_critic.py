"""TD3-style actor-critic: the critic loss trains the critic, the actor loss (through the critic) the actor.

The actor loss ``-Q1(s, actor(s)).mean()`` flows through the critic. A plain ``actor_loss.backward()``
computes and writes the critic's weight gradients too (TD3 implementations zero them before the next critic
update: computed for nothing). Routed, ``router.backward(actor=actor_loss)`` runs the engine with the
actor's parameters as the only inputs: the critic's weight gradients are never computed (the backward does
fewer matrix products, see ``tests/integration/test_examples.py``), nothing is written into the critic's
``.grad``, and no ``zero_grad`` ordering has to be got right.

Two modes:

* ``--mode td3`` (default) is the exact TD3 update (Fujimoto et al., 2018): the critic steps first, then,
  every ``--policy-delay`` iterations, the actor loss is taken through the *updated* critic (a second critic
  forward, as in TD3), routed to the actor, and the target networks are updated.
* ``--mode simultaneous``: ONE critic forward scores the replay actions and the actor's actions
  (``cat([(s, a), (s, actor(s))])``), the critic loss and the actor loss are routed in one call, and both
  optimizers step. The actor's gradient is then taken at the critic's current parameters, not its updated
  ones: the simultaneous update, one critic forward cheaper, not the same algorithm as TD3.

The replay batch is synthetic (linear dynamics, quadratic cost); the point is the update, not the task.

Run::

    python examples/actor_critic.py --steps 300
    python examples/actor_critic.py --mode simultaneous
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import gradroute


class Actor(nn.Module):
    def __init__(self, state_dim: int, action_dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(state_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, action_dim)
        )

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(s))


class Critic(nn.Module):
    """Twin Q networks, as in TD3."""

    def __init__(self, state_dim: int, action_dim: int, hidden: int = 64) -> None:
        super().__init__()

        def q() -> nn.Module:
            return nn.Sequential(
                nn.Linear(state_dim + action_dim, hidden),
                nn.ReLU(),
                nn.Linear(hidden, hidden),
                nn.ReLU(),
                nn.Linear(hidden, 1),
            )

        self.q1, self.q2 = q(), q()

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sa = torch.cat([s, a], dim=1)
        return self.q1(sa), self.q2(sa)


@dataclass
class Batch:
    s: torch.Tensor
    a: torch.Tensor
    r: torch.Tensor
    s2: torch.Tensor
    not_done: torch.Tensor


def synthetic_batch(
    n: int, state_dim: int, action_dim: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> Batch:
    """A replay batch of a fixed random linear system with a quadratic cost."""
    sysgen = torch.Generator().manual_seed(1234)  # the same system for every batch
    a_mat = 0.9 * torch.linalg.qr(torch.randn(state_dim, state_dim, generator=sysgen))[0]
    b_mat = torch.randn(state_dim, action_dim, generator=sysgen) / action_dim**0.5
    s = torch.randn(n, state_dim, generator=gen)
    a = torch.rand(n, action_dim, generator=gen) * 2 - 1
    s2 = s @ a_mat.T + a @ b_mat.T + 0.01 * torch.randn(n, state_dim, generator=gen)
    r = -(s2.square().sum(1, keepdim=True) + 0.1 * a.square().sum(1, keepdim=True))
    not_done = (torch.rand(n, 1, generator=gen) > 0.01).float()
    return Batch(*(t.to(dtype) for t in (s, a, r, s2, not_done)))


@dataclass
class TD3:
    actor: Actor
    critic: Critic
    actor_target: Actor
    critic_target: Critic
    router: gradroute.Router
    gamma: float = 0.99
    tau: float = 0.005
    policy_noise: float = 0.2
    noise_clip: float = 0.5
    policy_delay: int = 2
    iteration: int = 0

    @classmethod
    def create(
        cls, actor: Actor, critic: Critic, *, lr_actor: float = 3e-4, lr_critic: float = 3e-4, **kw: float
    ) -> TD3:
        router = gradroute.Router(
            actor=gradroute.Group(actor, optimizer=torch.optim.Adam(actor.parameters(), lr=lr_actor)),
            critic=gradroute.Group(critic, optimizer=torch.optim.Adam(critic.parameters(), lr=lr_critic)),
        )
        return cls(actor, critic, copy.deepcopy(actor), copy.deepcopy(critic), router, **kw)  # type: ignore[arg-type]

    @torch.no_grad()
    def target(self, b: Batch, gen: torch.Generator | None = None) -> torch.Tensor:
        """``r + gamma * min(Q1', Q2')(s2, actor'(s2) + clipped noise)``."""
        noise = (torch.randn(b.a.shape, generator=gen, dtype=b.a.dtype) * self.policy_noise).to(b.a.device)
        a2 = (self.actor_target(b.s2) + noise.clamp(-self.noise_clip, self.noise_clip)).clamp(-1, 1)
        q1, q2 = self.critic_target(b.s2, a2)
        return b.r + b.not_done * self.gamma * torch.min(q1, q2)

    def update(self, b: Batch, *, simultaneous: bool = False, gen: torch.Generator | None = None) -> dict[str, float]:
        """One TD3 iteration; returns the losses of the networks that stepped."""
        self.iteration += 1
        actor_turn = self.iteration % self.policy_delay == 0
        y = self.target(b, gen)
        out = {}
        if simultaneous and actor_turn:
            # ONE critic forward on the replay actions and the actor's actions; both losses routed at once
            n = len(b.s)
            q1, q2 = self.critic(torch.cat([b.s, b.s]), torch.cat([b.a, self.actor(b.s)]))
            critic_loss = F.mse_loss(q1[:n], y) + F.mse_loss(q2[:n], y)
            actor_loss = -q1[n:].mean()
            self.router.backward(critic=critic_loss, actor=actor_loss)
            stats = self.router.step()
            out = {"critic": stats["critic"].loss, "actor": stats["actor"].loss}
        else:
            q1, q2 = self.critic(b.s, b.a)
            self.router.backward(critic=F.mse_loss(q1, y) + F.mse_loss(q2, y))
            out["critic"] = self.router.step()["critic"].loss
            if actor_turn:
                # through the UPDATED critic, as TD3 does; routed: no critic weight gradient is computed
                actor_loss = -self.critic(b.s, self.actor(b.s))[0].mean()
                self.router.backward(actor=actor_loss)
                out["actor"] = self.router.step()["actor"].loss
        if actor_turn:
            self.soft_update()
        return out

    @torch.no_grad()
    def soft_update(self) -> None:
        for net, tgt in ((self.actor, self.actor_target), (self.critic, self.critic_target)):
            for p, pt in zip(net.parameters(), tgt.parameters(), strict=True):
                pt.lerp_(p, self.tau)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("td3", "simultaneous"), default="td3")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--state-dim", type=int, default=8)
    p.add_argument("--action-dim", type=int, default=2)
    p.add_argument("--policy-delay", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    for flag in ("steps", "batch_size", "state_dim", "action_dim", "policy_delay", "log_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    actor = Actor(args.state_dim, args.action_dim).to(device)
    critic = Critic(args.state_dim, args.action_dim).to(device)
    agent = TD3.create(actor, critic, policy_delay=args.policy_delay)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        b = synthetic_batch(args.batch_size, args.state_dim, args.action_dim, gen)
        b = Batch(*(t.to(device) for t in vars(b).values()))
        losses = agent.update(b, simultaneous=args.mode == "simultaneous", gen=gen)
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step:5d}  " + "  ".join(f"{k} loss {v:.4f}" for k, v in losses.items()), flush=True)
    print(f"{args.mode}: {args.steps} iterations in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
