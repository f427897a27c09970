"""The training step around the router: loss scaling, accumulation, unscale/hook/clip/step, one scaler update.

The order follows PyTorch's AMP notes for several models, losses and optimizers
(https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers):

1. ``backward``: every loss is divided by ``accumulate`` and scaled by the one ``GradScaler``; the router runs
   all passes in one call, so no optimizer steps before every gradient of the iteration is in.
2. ``step``, on the ``accumulate``-th call only: ``scaler.unscale_(opt)`` once per group (after all its
   gradients are in), then each group's ``grad_hook`` (all groups unscaled, none stepped), then the grad norm
   and per-group clipping of the unscaled gradients, then ``scaler.step(opt)`` per group (an inf/NaN in one
   group's gradients skips only that group's optimizer), then ONE ``scaler.update()``, then the schedulers of
   the groups whose optimizer really stepped, then ``.grad = None`` for every group.

Everything that can be checked is checked before anything is touched (``_step_checks``), and the real step is
a transaction (``_rollback``, see NOTE [A step is a transaction]): when anything raises inside it, a
``grad_hook``, an optimizer, a scheduler, a Ctrl-C, the parameters, gradients, optimizer, scheduler and scaler
state and the counters are put back as they were and the exception propagates unchanged.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._distributed import GradSync, group_params
from ._group import Group
from ._rollback import Rollback
from ._scaler import Scaler
from ._step_checks import (
    STATE_FORMAT,
    check_accumulate,
    check_configured,
    check_flag,
    check_gradients,
    check_scaler,
    check_state_dict,
    check_step_parts,
)
from ._types import Route


class _Phase(enum.Enum):
    """Where the stepper is between two ``step()`` calls (GradScaler-style state)."""

    #: No ``backward`` since the last ``step()`` (or since ``zero_grad()``/``load_state_dict()``).
    READY = "ready"
    #: At least one ``backward`` since then: ``step()`` may be called.
    BACKWARD = "backward"


@dataclass(frozen=True)
class GroupStats:
    """What one :meth:`Router.step` did to one group.

    Attributes:
        loss: the group's loss, unscaled, averaged over the micro-batches of the step (the sum of the
            group's routed loss values since the last real step, divided by ``accumulate``: the objective
            whose gradient was applied). ``None`` on an accumulation micro-step (it is not synced to the host
            until the real step) and for a group that received no loss.
        grad_norm: the total 2-norm of the group's unscaled gradients, after its ``grad_hook``, before
            clipping; ``inf``/``nan`` when AMP found non-finite gradients. ``None`` on an accumulation
            micro-step and for a group without gradients.
        lr: the learning rate of the optimizer's first parameter group that this step used (read before the
            scheduler steps); on a micro-step, the one the coming real step will use.
        lrs: the same for every parameter group of the optimizer.
        skipped: on a real step, the group's optimizer did not update: its gradients hold inf/NaN (found by
            the ``GradScaler``, or, without one, a non-finite ``grad_norm``), or the group had no gradient at
            all. Its scheduler was not stepped either. Always ``False`` on an accumulation micro-step.
        skip_reason: why it was skipped: ``"nonfinite"`` (inf/NaN gradients; without a scaler only with
            ``Router(skip_nonfinite=True)``, the default) or ``"no_grad"`` (no loss reached the group since
            the last step); ``None`` when not skipped.

    Example:
        >>> import torch, gradroute
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
        >>> router = gradroute.Router(a=gradroute.Group(a, optimizer=sgd(a)), b=gradroute.Group(b, optimizer=sgd(b)))
        >>> out = b(a(torch.ones(1, 2)))
        >>> router.backward(a=out.sum() * float("nan"), b=out.pow(2).sum())
        >>> stats = router.step()
        >>> stats["a"].skipped, stats["a"].skip_reason, stats["b"].skipped, stats["b"].lr
        (True, 'nonfinite', False, 0.1)
    """

    loss: float | None
    grad_norm: float | None
    lr: float
    lrs: tuple[float, ...]
    skipped: bool
    skip_reason: str | None = None


class StepStats(dict[str, GroupStats]):
    """What :meth:`Router.step` returned: ``group name -> GroupStats``, plus the step's own fields.

    Attributes:
        accumulating: ``True`` when the call only closed a micro-batch of an accumulation window (nothing was
            unscaled, clipped or stepped); ``False`` on a real step.
        micro_step: which micro-batch of the window the call closed, from 1 to ``accumulate``.
        accumulate: micro-batches per real step.
        step: real steps done so far, this one included.
        scale: the ``GradScaler`` scale the step's gradients were scaled by (before its ``update()``);
            ``None`` without an enabled scaler and on accumulation micro-steps.

    Example:
        >>> import torch, gradroute
        >>> net = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> router = gradroute.Router(net=gradroute.Group(net, optimizer=opt))
        >>> router.backward(net=net(torch.ones(1, 2)).sum())
        >>> stats = router.step()
        >>> stats.accumulating, stats.step, stats["net"].skipped, stats["net"].lr
        (False, 1, False, 0.1)
    """

    accumulating: bool
    micro_step: int
    accumulate: int
    step: int
    scale: float | None

    def __init__(
        self,
        groups: Mapping[str, GroupStats],
        *,
        accumulating: bool,
        micro_step: int,
        accumulate: int,
        step: int,
        scale: float | None,
    ) -> None:
        super().__init__(groups)
        self.accumulating = accumulating
        self.micro_step = micro_step
        self.accumulate = accumulate
        self.step = step
        self.scale = scale

    def __repr__(self) -> str:
        head = (
            f"accumulating={self.accumulating}, micro_step={self.micro_step}/{self.accumulate}, "
            f"step={self.step}, scale={self.scale}"
        )
        return f"StepStats({head}, {dict.__repr__(self)})"


class Stepper:
    """The step half of :class:`gradroute.Router`; see the module docstring for the order of operations."""

    def __init__(
        self,
        groups: Mapping[str, Group],
        *,
        scaler: Any = None,
        accumulate: int = 1,
        skip_nonfinite: bool = True,
        atomic_step: bool = True,
        window: Any = None,
    ) -> None:
        self.groups = groups
        self.accumulate = check_accumulate(accumulate)
        # An Accelerate window (``_accelerate.AcceleratorLink``): the loss divisor and the real steps are the
        # accelerator's (``divisor()``, ``sync()``); ``accumulate`` is then 1, so DDP's switches are left to it.
        self._window = window
        self.scaler = check_scaler(scaler)
        self._scaler = Scaler(self.scaler)
        self.skip_nonfinite = check_flag(skip_nonfinite, "skip_nonfinite")
        self.atomic_step = check_flag(atomic_step, "atomic_step")
        check_step_parts(groups)
        self._phase = _Phase.READY
        self._micro = 0  # micro-batches of the current window already closed by step()
        self._steps = 0  # real steps done
        # Per group, the detached sum of the window's loss values (float32): one scalar each, so a router whose
        # step() is never called (optimizers stepped by hand) does not grow.
        self._losses: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}  # of the backward in progress
        self._sync = GradSync(group_params(groups))  # DDP/FSDP2 wrappers: no gradient sync until a window's last
        self._sync.next_micro_batch(0, self.accumulate)

    # ------------------------------------------------------------------ backward

    @property
    def _scaling(self) -> bool:
        return self._scaler.enabled

    def distributed(self) -> bool:
        """Whether a DDP module holds any of the groups' parameters (as found by the last ``before_backward``)."""
        return bool(self._sync.ddp())

    def before_backward(self, routes: list[Route]) -> list[Route]:
        """Record the losses' values; return routes whose losses are divided by ``accumulate`` and scaled."""
        self._sync.check(routes)
        self._pending = {r.name: _loss_value(r.losses) for r in routes}
        if not self._scaling and self._divisor() == 1:
            return routes
        return [Route(name=r.name, losses=tuple(self._scale(t) for t in r.losses), params=r.params) for r in routes]

    def _divisor(self) -> int:
        """What each loss is divided by: ``accumulate``, or the accelerator's accumulation steps."""
        return self.accumulate if self._window is None else int(self._window.divisor())

    def _closes_window(self, micro: int) -> bool:
        """Whether closing micro-batch ``micro`` (from 1) is a real step."""
        return micro >= self.accumulate if self._window is None else bool(self._window.sync())

    def _scale(self, t: torch.Tensor) -> torch.Tensor:
        # As in PyTorch's AMP notes: ``loss = loss / iters_to_accumulate``, then ``scaler.scale(loss)``.
        divisor = self._divisor()
        if divisor > 1:
            t = t / divisor
        if self._scaling:
            t = self.scaler.scale(t)
        return t

    def after_backward(self, routes: list[Route]) -> None:
        """The backward of ``routes`` is done: keep its loss values for the stats; ``step()`` may follow."""
        for name, value in self._pending.items():
            prev = self._losses.get(name)
            if prev is not None:
                value = (prev if prev.device == value.device else prev.to(value.device)) + value
            self._losses[name] = value
        self._pending = {}
        self._phase = _Phase.BACKWARD

    # ------------------------------------------------------------------ step

    def step(self) -> StepStats:
        """Close a micro-batch; on the ``accumulate``-th: unscale, hook, clip, step, schedule, zero."""
        if self._phase is not _Phase.BACKWARD:
            raise RuntimeError(
                "`step()` was called with no `backward()` since the last `step()` (state: "
                f"{self._phase.value}); call router.backward(...) for every micro-batch before router.step()"
            )
        check_configured(self.groups)
        micro = self._micro + 1
        if not self._closes_window(micro):
            self._sync.next_micro_batch(micro, self.accumulate)
            self._micro = micro
            self._phase = _Phase.READY
            return StepStats(
                {n: _group_stats(g, None, None, skipped=False) for n, g in self.groups.items()},
                accumulating=True,
                micro_step=micro,
                accumulate=self._divisor(),
                step=self._steps,
                scale=None,
            )
        active = {n: g for n, g in self.groups.items() if any(p.grad is not None for p in g.params)}
        check_gradients(active, self.groups, self._scaler)
        if self._scaling and active:
            self._scaler.ready_on(next(p.grad.device for g in active.values() for p in g.params if p.grad is not None))
        undo = Rollback(enabled=self.atomic_step)
        scaler_state = self._scaler.snapshot()
        try:
            stats, scale = self._real_step(active, undo)
        except BaseException:
            undo.restore()
            self._scaler.restore(scaler_state)
            raise
        undo.clear()
        self._commit()
        return StepStats(
            stats, accumulating=False, micro_step=micro, accumulate=self._divisor(), step=self._steps, scale=scale
        )

    def _real_step(self, active: dict[str, Group], undo: Rollback) -> tuple[dict[str, GroupStats], float | None]:
        """Unscale, hooks, norms and clipping, optimizers, one scaler update, schedulers; each change preceded
        by its copy in ``undo``. Nothing here touches the counters or zeroes a gradient."""
        scale = float(self.scaler.get_scale()) if self._scaling else None
        undo.grads(active.values())
        found_inf = self._unscale(active)
        _run_grad_hooks(active)
        # Norm of the unscaled gradients; a non-finite one skips the group; clip the others.
        norms = {name: self._norm_and_clip(g, found_inf, name) for name, g in active.items()}
        lrs = {name: _lrs(g) for name, g in self.groups.items()}  # the learning rates this step uses
        self._step_optimizers(active, found_inf, undo)
        _step_schedulers(active, found_inf, undo)
        return self._window_stats(active, found_inf, norms, lrs), scale

    def _unscale(self, active: dict[str, Group]) -> dict[str, bool]:
        """Unscale every optimizer once, all gradients being in; per group, whether GradScaler found an inf or
        NaN (all False without a scaler)."""
        found_inf: dict[str, bool] = {}
        for name, g in active.items():
            if self._scaling:
                self.scaler.unscale_(g.optimizer)
                found_inf[name] = self._scaler.found_inf(g.optimizer, list(g.params))
            else:
                found_inf[name] = False
        return found_inf

    def _step_optimizers(self, active: dict[str, Group], found_inf: dict[str, bool], undo: Rollback) -> None:
        """One optimizer step per group (GradScaler skips a group with inf/NaN; without a scaler, a skipped
        group is not stepped), then ONE scaler update."""
        scaling = self._scaling
        for name, g in active.items():
            assert g.optimizer is not None  # checked by check_configured
            if found_inf[name] and not scaling:
                continue
            if not found_inf[name]:
                undo.optimizer(g)
            if scaling:
                self.scaler.step(g.optimizer)
            else:
                g.optimizer.step()
        if scaling and active:
            self.scaler.update()

    def _window_stats(
        self,
        active: dict[str, Group],
        found_inf: dict[str, bool],
        norms: dict[str, float],
        lrs: dict[str, tuple[float, ...]],
    ) -> dict[str, GroupStats]:
        """Per group: the window's mean loss, its gradient norm, the learning rates used, whether it skipped."""
        losses = {name: float(total) / self._divisor() for name, total in self._losses.items()}
        return {
            name: GroupStats(
                loss=losses.get(name),
                grad_norm=norms.get(name),
                lr=lrs[name][0],
                lrs=lrs[name],
                skipped=name not in active or found_inf[name],
                skip_reason="no_grad" if name not in active else "nonfinite" if found_inf[name] else None,
            )
            for name in self.groups
        }

    def _norm_and_clip(self, g: Group, found_inf: dict[str, bool], name: str) -> float:
        """The total norm of ``g``'s unscaled gradients; clip them to ``max_grad_norm`` unless the group is
        skipped. Without a scaler, a non-finite norm marks the group skipped (``skip_nonfinite``)."""
        params = [p for p in g.params if p.grad is not None]
        norm = _total_norm([p.grad for p in params if p.grad is not None])
        value = float(norm)
        if not self._scaling and self.skip_nonfinite and not math.isfinite(value):
            found_inf[name] = True
        if g.max_grad_norm is not None and not found_inf[name]:
            _clip_with_norm(params, g.max_grad_norm, norm)
        return value

    def _commit(self) -> None:
        """The step succeeded: zero every group (skipped ones too: their gradients may hold inf), count it."""
        for g in self.groups.values():
            for p in g.params:
                p.grad = None
        self._losses = {}
        self._micro = 0
        self._steps += 1
        self._phase = _Phase.READY
        self._sync.next_micro_batch(0, self.accumulate)

    # ------------------------------------------------------------------ zero_grad and resume

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every group's gradients and drop the accumulation window (its micro-batches are discarded)."""
        for g in self.groups.values():
            for p in g.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()
        self._micro = 0
        self._losses = {}
        self._phase = _Phase.READY
        self._sync.next_micro_batch(0, self.accumulate)

    def state_dict(self) -> dict[str, Any]:
        """Optimizers, schedulers, scaler, counters; and the window's gradients and losses when saved inside one."""
        in_window = self._micro > 0 or self._phase is _Phase.BACKWARD
        return {
            "format": STATE_FORMAT,
            "accumulate": self.accumulate,
            "micro_step": self._micro,
            "steps": self._steps,
            "backward_pending": self._phase is _Phase.BACKWARD,
            # float32 tensors, as summed: a float64 round trip would change the resumed run's reported loss
            "losses": {n: v.detach().to("cpu", copy=True) for n, v in self._losses.items()},
            "grads": (
                {
                    n: [None if p.grad is None else p.grad.detach().clone() for p in g.params]
                    for n, g in self.groups.items()
                }
                if in_window
                else None
            ),
            "optimizers": {n: g.optimizer.state_dict() for n, g in self.groups.items() if g.optimizer is not None},
            "schedulers": {n: g.scheduler.state_dict() for n, g in self.groups.items() if g.scheduler is not None},
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; everything is checked before anything is loaded, and a load that fails
        half-way (an optimizer refusing its state) is undone."""
        sd = check_state_dict(
            state_dict, self.groups, self._scaler, self.accumulate, window=max(self.accumulate, self._divisor())
        )
        undo = Rollback()
        undo.grads(self.groups.values())
        scaler_state = self._scaler.snapshot()
        try:
            for name, g in self.groups.items():
                undo.optimizer(g, params=False)
                if g.optimizer is not None:
                    g.optimizer.load_state_dict(sd["optimizers"][name])
            undo.schedulers(self.groups.values())
            for name, g in self.groups.items():
                if g.scheduler is not None:
                    g.scheduler.load_state_dict(sd["schedulers"][name])
            if self.scaler is not None and sd["scaler"]:
                self.scaler.load_state_dict(sd["scaler"])
            grads = sd["grads"] or {}
            for name, g in self.groups.items():
                saved = grads.get(name)
                for k, p in enumerate(g.params):
                    p.grad = None if saved is None or saved[k] is None else saved[k].detach().to(p).clone()
        except BaseException:
            undo.restore()
            self._scaler.restore(scaler_state)
            raise
        self._micro = sd["micro_step"]
        self._sync.next_micro_batch(self._micro, self.accumulate)
        self._steps = sd["steps"]
        self._losses = {n: torch.as_tensor(v, dtype=torch.float32).reshape(()).clone() for n, v in sd["losses"].items()}
        self._pending = {}
        self._phase = _Phase.BACKWARD if sd["backward_pending"] else _Phase.READY


# ---------------------------------------------------------------------- helpers


def _loss_value(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The detached sum of a route's loss tensors, in at least float32 (no host sync)."""
    if len(losses) == 1:  # one op (the usual case): a copy, or the cast that makes one
        t = losses[0].detach()
        if t.dim():
            t = t.reshape(())
        return t.to(torch.float32) if t.element_size() < 4 else t.clone()  # promoted to float32 at least
    total = torch.zeros((), dtype=torch.float32, device=losses[0].device)
    for t in losses:
        total = total + t.detach().reshape(()).to(total.device)
    return total


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm ``clip_grad_norm_`` returns, without clipping."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads)  # type: ignore[no-any-return]
    if not grads:  # pragma: no cover - torch < 2.6
        return torch.tensor(0.0)
    device = grads[0].device  # pragma: no cover - torch < 2.6
    return torch.linalg.vector_norm(  # pragma: no cover - torch < 2.6
        torch.stack([torch.linalg.vector_norm(g.detach()).to(device) for g in grads])
    )


def _clip_with_norm(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """What ``clip_grad_norm_`` does once it has the total norm (the same kernels, so the same bits)."""
    clip = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip is not None:
        clip(params, max_norm, total_norm)
    else:  # pragma: no cover - torch < 2.6
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def _run_grad_hooks(active: Mapping[str, Group]) -> None:
    """Each group's ``grad_hook``, on its parameters that have a gradient: every group unscaled, none stepped."""
    for g in active.values():
        if g.grad_hook is not None:
            g.grad_hook([p for p in g.params if p.grad is not None])


def _step_schedulers(active: Mapping[str, Group], found_inf: Mapping[str, bool], undo: Rollback) -> None:
    """Step the schedulers of the groups whose optimizer really stepped: they count updates applied."""
    scheduled = [g for name, g in active.items() if g.scheduler is not None and not found_inf[name]]
    undo.schedulers(scheduled)
    for g in scheduled:
        g.scheduler.step()


def _lrs(g: Group) -> tuple[float, ...]:
    if g.optimizer is None:
        return (math.nan,)
    return tuple(float(pg["lr"]) for pg in g.optimizer.param_groups)


def _group_stats(g: Group, loss: float | None, norm: float | None, *, skipped: bool) -> GroupStats:
    lrs = _lrs(g)
    return GroupStats(loss=loss, grad_norm=norm, lr=lrs[0], lrs=lrs, skipped=skipped)
