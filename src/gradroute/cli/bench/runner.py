"""``Runner``: a workload with its router and precision, running one step (forward + backward) of a strategy."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

import gradroute

from ..choices import CKPT_STRATEGIES
from ..common import autocast, rel_error, resolve_dtype
from ..workloads import Workload, build
from .strategies import STRATEGY_FNS


class Runner:
    """A workload with its router and precision: runs one step (forward + backward) of a strategy."""

    def __init__(self, wl: Workload, dtype: str, static_graph: bool = False) -> None:
        self.wl = wl
        self.dtype = dtype
        self.device = next(wl.up_module.parameters()).device
        self.up_params = wl.params(wl.up_name)
        self.down_params = wl.params(wl.down_name)
        self.all_params = list(dict.fromkeys(self.up_params + self.down_params))
        self.static_graph = static_graph
        self.router = gradroute.Router(dict(wl.groups), static_graph=static_graph)
        self._routers = {"gradroute": self.router}

    def router_for(self, strategy: str) -> gradroute.Router:
        """The router of a ``gradroute*`` strategy, one each, as each training loop has its own: a strategy's
        measured plan choice is measured on its own steps (on ``sd-tiny`` the checkpointed strategies make the
        same graph, which one shared router measured once), and a static router holds one graph per call
        shape."""
        if strategy not in self._routers:
            self._routers[strategy] = gradroute.Router(dict(self.wl.groups), static_graph=self.static_graph)
        return self._routers[strategy]

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with autocast(self.device, self.dtype):
            yield

    def up(self) -> torch.Tensor:
        with self.autocast():
            return self.wl.up(self.wl.batch)

    def down(self, h: torch.Tensor, *need: str) -> dict[str, torch.Tensor]:
        with self.autocast():
            return self.wl.down(self.wl.batch, h, need or (self.wl.up_name, self.wl.down_name))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """boundary, loss_up, loss_down"""
        h = self.up()
        losses = self.down(h)
        return h, losses[self.wl.up_name], losses[self.wl.down_name]

    def zero(self) -> None:
        """Empty every gradient, and the routers' records of the losses since their last step (a training loop's
        ``router.step()`` empties both; the bench never steps, and a record kept would add each backward's
        losses to the last ones: an op per loss that a training loop does not pay)."""
        for router in self._routers.values():
            router.zero_grad()
        for p in self.all_params:
            p.grad = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare(self, strategy: str) -> None:
        """Untimed set-up before a step: the checkpoint function the strategy uses."""
        if self.wl.set_checkpoint is not None:
            self.wl.set_checkpoint(CKPT_STRATEGIES.get(strategy, "torch"))

    def step(self, strategy: str) -> None:
        STRATEGY_FNS[strategy](self)

    def settle(self, strategy: str, limit: int = 100) -> str | None:
        """Untimed steps of a ``gradroute*`` strategy until the router's measured plan choice is done with its
        graph (``Router(autotune=...)``; a few steps, where there is anything to measure), then what it chose
        (the plan's ``autotune`` note) or None. Other strategies: nothing."""
        if not strategy.startswith("gradroute"):
            return None
        self.prepare(strategy)
        router = self.router_for(strategy)
        for _ in range(limit):
            self.zero()
            self.step(strategy)
            if not router.autotuning:
                break
        self.zero()
        _, loss_up, loss_down = self.forward()
        notes = router.plan(**{self.wl.up_name: loss_up, self.wl.down_name: loss_down}).notes
        return next((n for n in notes if n.startswith("autotune")), None)

    def reference(self) -> dict[str, list[torch.Tensor]]:
        """Per group: the gradient of its own loss alone, from a fresh forward (fp32 gradients)."""
        self.prepare("sum")
        ref = {}
        for name, params in ((self.wl.up_name, self.up_params), (self.wl.down_name, self.down_params)):
            loss = self.down(self.up(), name)[name]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            ref[name] = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
        return ref

    def errors(self, ref: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """Relative L2 error of each group's ``.grad`` against ``ref`` (missing grads count as zero)."""
        return {
            name: rel_error([p.grad for p in params], ref[name])
            for name, params in ((self.wl.up_name, self.up_params), (self.wl.down_name, self.down_params))
        }

    @classmethod
    def from_args(cls, args: argparse.Namespace, dev: torch.device) -> Runner:
        """The workload ``gradroute bench`` arguments name, built on ``dev``, at the precision they ask for."""
        return cls(workload_from_args(args, dev), bench_dtype(args.dtype, dev), static_graph=args.static_graph)


def workload_from_args(args: argparse.Namespace, dev: torch.device) -> Workload:
    """The workload ``gradroute bench`` arguments name, freshly built on ``dev``."""
    return build(
        args.workload,
        batch_size=args.batch_size,
        device=dev,
        checkpointing=args.checkpointing,
        seed=args.seed,
        width=args.width,
        latent_size=args.latent_size,
    )


def bench_dtype(spec: str, dev: torch.device) -> str:
    """``--dtype`` of ``gradroute bench``: ``auto`` is bf16 on CUDA, fp32 on the CPU."""
    return resolve_dtype(spec, dev, cuda_default="bf16")
