"""The two training loops ``gradroute bench --step`` compares: the router's and the hand-written one.

Each loop trains its own copy of a workload (same seed: same weights, same fixed batch) with the setup of
``docs/training_step.md``: per network an AdamW (``fused=True`` where the device has it), a ``warmup_power``
scheduler and clipping to ``max_grad_norm``, and one ``GradScaler`` for both networks when asked (fp16).

* ``gradroute`` -- ``router.backward(up=loss_up, down=loss_down)`` then ``router.step()`` (unscale, clip,
  optimizers, one scaler update, schedulers, and ``.grad = None``: the step's own ``zero_grad``).
* ``hand_cut`` -- torch's AMP recipe for several optimizers after the hand cut at the boundary (the faster
  hand-written routed backward, ``cut`` among the bench's strategies): ``scaler.scale`` each loss,
  ``grad(loss_up, boundary, retain_graph=True)``, ``loss_down.backward(inputs=down)``, the boundary gradient
  into ``up``; ``scaler.unscale_`` per optimizer, ``clip_grad_norm_`` per group, ``scaler.step`` per
  optimizer, one ``scaler.update()``, each scheduler, ``zero_grad(set_to_none=True)`` per optimizer.

Both keep the iteration's boundary and losses referenced until the next forward has run, as a loop that
rebinds ``loss = ...`` does: the next forward's peak includes whatever they still hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import gradroute
from gradroute.schedules import warmup_power

from ..common import autocast
from ..workloads import Workload

#: the loops, the reference first
LOOPS = ("hand_cut", "gradroute")

#: per network (upstream, downstream): AdamW's learning rate and weight decay (the demo's), and for both
SETUP: dict[str, Any] = {
    "lr": (2e-4, 2e-3),
    "weight_decay": (1e-3, 1e-2),
    "betas": (0.9, 0.99),
    "eps": 1e-7,
    "max_grad_norm": 1.0,
    "warmup_steps": 30,
    "exponent": 5.0,
    "total_steps": 10_000,
}


def adamw(params: list[torch.Tensor], lr: float, weight_decay: float) -> tuple[torch.optim.AdamW, str]:
    """An AdamW with ``SETUP``'s settings, fused on CUDA and the CPU (every supported torch has the kernels
    there), else (``meta``) the ``foreach`` one; and which it is (``"fused"`` or ``"foreach"``)."""
    kw = {"lr": lr, "weight_decay": weight_decay, "betas": SETUP["betas"], "eps": SETUP["eps"]}
    if params[0].device.type in ("cuda", "cpu"):
        return torch.optim.AdamW(params, fused=True, **kw), "fused"
    return torch.optim.AdamW(params, foreach=True, **kw), "foreach"


@dataclass(eq=False)
class Loop:
    """One training loop on its own workload: ``iterate()`` runs forward, routed backward, step, zero_grad."""

    name: str
    wl: Workload
    dtype: str
    scaler: torch.amp.GradScaler | None
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    params: list[list[torch.Tensor]]  # upstream, downstream
    router: gradroute.Router | None = None
    optimizer_kind: str = ""
    held: tuple[torch.Tensor, ...] = field(default=(), repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.wl.up_module.parameters()).device

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The boundary and both losses, kept in ``held`` (the previous ones let go only now)."""
        with autocast(self.device, self.dtype):
            h, losses = self.wl.forward()
        self.held = (h, losses[self.wl.up_name], losses[self.wl.down_name])
        return self.held  # type: ignore[return-value]

    def iterate(self) -> None:
        """One whole training iteration."""
        _ITERATIONS[self.name](self)

    def settle(self, limit: int = 100) -> int:
        """Iterations until the router's measured plan choice is done (``Router(autotune=...)``): how many ran
        (0 for the hand-written loop, which has nothing to settle)."""
        if self.router is None:
            return 0
        for k in range(limit):
            self.iterate()
            if not self.router.autotuning:
                return k + 1
        return limit

    def chosen(self) -> str | None:
        """The router's measured plan choice for this loop's graph (the chosen row of the plan's ``autotune``
        note), or None (the hand-written loop, or a graph with one candidate). Runs a forward."""
        if self.router is None:
            return None
        _, loss_up, loss_down = self.forward()
        notes = self.router.plan(**{self.wl.up_name: loss_up, self.wl.down_name: loss_down}).notes
        note = next((n for n in notes if n.startswith("autotune")), None)
        if note is None:
            return None
        row = next((r.strip() for r in note.splitlines() if "<- chosen" in r), note.splitlines()[0])
        return row.replace(" <- chosen", "")


def make_loop(name: str, wl: Workload, dtype: str, *, scaler: bool, static_graph: bool = False) -> Loop:
    """The loop ``name`` (one of ``LOOPS``) on ``wl``, with ``SETUP``'s optimizers, schedulers and clipping."""
    if name not in LOOPS:
        raise ValueError(f"`name` must be one of {', '.join(LOOPS)}, got {name!r}")
    params = [wl.params(wl.up_name), wl.params(wl.down_name)]
    made = [adamw(p, lr, wd) for p, lr, wd in zip(params, SETUP["lr"], SETUP["weight_decay"])]
    opts: list[torch.optim.Optimizer] = [opt for opt, _ in made]
    scheds = [warmup_power(o, SETUP["warmup_steps"], SETUP["exponent"], SETUP["total_steps"]) for o in opts]
    dev = next(wl.up_module.parameters()).device
    grad_scaler = torch.amp.GradScaler(dev.type) if scaler else None
    router = None
    if name == "gradroute":
        groups = {
            n: gradroute.Group(p, optimizer=o, scheduler=s, max_grad_norm=SETUP["max_grad_norm"])
            for n, p, o, s in zip((wl.up_name, wl.down_name), params, opts, scheds)
        }
        router = gradroute.Router(groups, scaler=grad_scaler, static_graph=static_graph)
    kind = made[0][1] if made[0][1] == made[1][1] else f"{made[0][1]} / {made[1][1]}"
    return Loop(name, wl, dtype, grad_scaler, opts, scheds, params, router, kind)


def _routed(loop: Loop) -> None:
    assert loop.router is not None
    _, loss_up, loss_down = loop.forward()
    loop.router.backward(**{loop.wl.up_name: loss_up, loop.wl.down_name: loss_down})
    loop.router.step()  # sets every .grad to None once it has stepped


def _hand_cut(loop: Loop) -> None:
    h, loss_up, loss_down = loop.forward()
    s = loop.scaler
    if s is not None:
        loss_up, loss_down = s.scale(loss_up), s.scale(loss_down)
    up, down = loop.params
    (g_h,) = torch.autograd.grad(loss_up, h, retain_graph=True)
    loss_down.backward(inputs=down)
    h.backward(g_h, inputs=up)
    del g_h, loss_up, loss_down
    if s is not None:
        for opt in loop.optimizers:
            s.unscale_(opt)
    for p in loop.params:
        torch.nn.utils.clip_grad_norm_(p, SETUP["max_grad_norm"])
    for opt in loop.optimizers:
        if s is not None:
            s.step(opt)
        else:
            opt.step()
    if s is not None:
        s.update()
    for sched in loop.schedulers:
        sched.step()
    for opt in loop.optimizers:
        opt.zero_grad(set_to_none=True)


_ITERATIONS: dict[str, Callable[[Loop], None]] = {"hand_cut": _hand_cut, "gradroute": _routed}
