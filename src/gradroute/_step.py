"""The training step around the router: loss scaling, accumulation, unscale/hook/clip/step, one scaler update.

The order follows PyTorch's AMP notes for several models, losses and optimizers
(https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers):

1. ``backward``: every loss is divided by ``accumulate`` and scaled by the one ``GradScaler``; the router runs
   all passes in one call, so no optimizer steps before every gradient of the iteration is in.
2. ``step``, on the ``accumulate``-th call only: ``scaler.unscale_(opt)`` once per group (after all its
   gradients are in), then each group's ``grad_hook`` (all groups unscaled, none stepped), then the grad norm
   and per-group clipping of the unscaled gradients, then ``scaler.step(opt)`` per group (an inf/NaN in one
   group's gradients skips only that group's optimizer), then ONE ``scaler.update()``, then the schedulers of
   the groups whose optimizer stepped, then ``.grad = None`` for every group.

Everything that can be checked is checked before anything is touched (``_step_checks``). The real step runs in
two parts (``_rollback``, NOTE [Atomic step]): what can fail on the user's account (unscale,
hooks, norms) first, undone exactly and without copies of parameters or optimizer state if it raises; then the
irreversible part (clip, optimizers, update, schedulers, zero), with Ctrl-C held until it ends.
``atomic_step="copy"`` makes the whole step a transaction with copies (same NOTE, rule 5).

No host sync beyond the hand-written loop's: the scale, norms, losses and found-inf records stay tensors
(``GroupStats`` reads them when accessed), and an optimizer that skips on the device (fused Adam, AdamW, SGD:
``_step_supports_amp_scaling``) gets its found-inf as ``GradScaler.step`` hands it, with or without a scaler.
An optimizer that cannot skip on the device needs the host to know: one read per such group (with a scaler,
``scaler.step`` reads it too).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import skips_on_device
from ._distributed import GradSync
from ._group import Group
from ._rollback import Rollback, Unscaled, hold_interrupt
from ._scaler import Scaler
from ._step_checks import (
    STATE_FORMAT,
    check_accumulate,
    check_atomic_step,
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


class GroupStats:
    """What one :meth:`Router.step` did to one group.

    The values a step computes on the device (loss, norm, whether a fused optimizer skipped) are kept as
    tensors and read on first access, so a step whose statistics are not looked at waits for nothing.

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
        skipped: on a real step, the group's optimizer did not update: its gradients hold inf/NaN (found by the
            ``GradScaler``, or, without one and with ``skip_nonfinite=True``, a non-finite ``grad_norm``), or the group
            had no gradient at all. Always ``False`` on an accumulation micro-step. The scheduler of a skipped group is
            not stepped, except for an optimizer that skips on the device (fused Adam, AdamW, SGD: the host does not
            know, and its scheduler steps, as in torch's AMP recipe).
        skip_reason: why it was skipped: ``"nonfinite"`` (inf/NaN gradients; without a scaler only with
            ``Router(skip_nonfinite=True)``) or ``"no_grad"`` (no loss reached the group since
            the last step); ``None`` when not skipped.

    Examples:
        >>> import torch, gradroute
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
        >>> groups = {"a": gradroute.Group(a, optimizer=sgd(a)), "b": gradroute.Group(b, optimizer=sgd(b))}
        >>> router = gradroute.Router(groups, skip_nonfinite=True)
        >>> out = b(a(torch.ones(1, 2)))
        >>> router.backward(a=out.sum() * float("nan"), b=out.pow(2).sum())
        >>> stats = router.step()
        >>> stats["a"].skipped, stats["a"].skip_reason, stats["b"].skipped, stats["b"].lr
        (True, 'nonfinite', False, 0.1)
    """

    __slots__ = ("_grad_norm", "_loss", "_lrs", "_no_grad", "_skipped")

    def __init__(
        self,
        loss: Any,
        grad_norm: float | torch.Tensor | None,
        lr: Any = None,
        lrs: tuple[Any, ...] = (),
        skipped: bool | torch.Tensor = False,
        skip_reason: str | None = None,
    ) -> None:
        self._loss = loss
        self._grad_norm = grad_norm
        self._lrs = tuple(lrs) if lrs else (lr,)
        self._skipped = skipped
        self._no_grad = skip_reason == "no_grad"

    @property
    def loss(self) -> float | None:
        if self._loss is not None and not isinstance(self._loss, float):
            self._loss = float(self._loss)
        return self._loss

    @property
    def grad_norm(self) -> float | None:
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = float(self._grad_norm)
        return self._grad_norm

    @property
    def lrs(self) -> tuple[float, ...]:
        if any(not isinstance(v, float) for v in self._lrs):
            self._lrs = tuple(float(v) for v in self._lrs)
        return self._lrs  # type: ignore[return-value]

    @property
    def lr(self) -> float:
        return self.lrs[0]

    @property
    def skipped(self) -> bool:
        if isinstance(self._skipped, torch.Tensor):
            self._skipped = bool(self._skipped)
        return self._skipped

    @property
    def skip_reason(self) -> str | None:
        if self._no_grad:
            return "no_grad"
        return "nonfinite" if self.skipped else None

    def _values(self) -> tuple[Any, ...]:
        return (self.loss, self.grad_norm, self.lr, self.lrs, self.skipped, self.skip_reason)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupStats):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ("loss", "grad_norm", "lr", "lrs", "skipped", "skip_reason")
        return "GroupStats(" + ", ".join(f"{k}={v!r}" for k, v in zip(fields, self._values(), strict=True)) + ")"


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

    Examples:
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

    def __init__(
        self,
        groups: Mapping[str, GroupStats],
        *,
        accumulating: bool,
        micro_step: int,
        accumulate: int,
        step: int,
        scale: float | torch.Tensor | None,
    ) -> None:
        super().__init__(groups)
        self.accumulating = accumulating
        self.micro_step = micro_step
        self.accumulate = accumulate
        self.step = step
        self._scale = scale

    @property
    def scale(self) -> float | None:
        """The scale the step's gradients were scaled by (read from the device on first access)."""
        if isinstance(self._scale, torch.Tensor):
            self._scale = float(self._scale)
        return self._scale

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
        skip_nonfinite: bool = False,
        atomic_step: bool | str = True,
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
        self.atomic_step = check_atomic_step(atomic_step)
        check_step_parts(groups)
        self._phase = _Phase.READY
        self._micro = 0  # micro-batches of the current window already closed by step()
        self._steps = 0  # real steps done
        # Per group, the detached sum of the window's loss values (float32): one scalar each, so a router whose
        # step() is never called (optimizers stepped by hand) does not grow.
        self._losses: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}  # of the backward in progress
        self._sync = GradSync(groups)  # DDP/FSDP2 wrappers: no gradient sync until a window's last
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
        copying = self.atomic_step == "copy"
        losses = self._losses  # of the window this step closes
        undo = Rollback(enabled=copying)
        scaler_state = self._scaler.snapshot(sync=copying)
        try:
            undo.grads(active.values())
            prepared = self._prepare(active)
        except BaseException:
            undo.restore()
            self._scaler.restore(scaler_state)
            raise
        with hold_interrupt():
            try:
                self._apply(active, prepared, undo)
            except BaseException:
                undo.restore()
                self._scaler.restore(scaler_state)
                raise
            undo.clear()
            self._commit()
        return StepStats(
            self._window_stats(active, prepared, losses),
            accumulating=False,
            micro_step=micro,
            accumulate=self._divisor(),
            step=self._steps,
            scale=prepared.scale,
        )

    def _prepare(self, active: dict[str, Group]) -> _Prepared:
        """The first part of a real step (NOTE [Atomic step], rules 1-2): unscale, hooks, norms, the learning
        rates; undone exactly (default) if anything raises. No host sync."""
        scale = self._scaler.scale_tensor()
        exact = self.atomic_step is True
        undo = Unscaled(scale, copy_all=exact and self._scaling and not self._scaler.unscale_is_exact())
        try:
            found_inf: dict[str, bool | torch.Tensor] = {}
            for name, g in active.items():
                if self._scaling:
                    if exact:
                        undo.before_unscale(g)
                    self.scaler.unscale_(g.optimizer)
                    found_inf[name] = self._scaler.found_inf_tensor(g.optimizer, list(g.params))
                else:
                    found_inf[name] = False
            for g in active.values():
                if g.grad_hook is not None:
                    if exact:
                        undo.before_hook(g)
                    g.grad_hook([p for p in g.params if p.grad is not None])
            with_grad = {name: [p for p in g.params if p.grad is not None] for name, g in active.items()}
            norms = {name: _total_norm([p.grad for p in ps]) for name, ps in with_grad.items()}
            if not self._scaling and self.skip_nonfinite:
                found_inf = {name: _nonfinite(norms[name]) for name in active}
            lrs = {name: _lrs(g) for name, g in self.groups.items()}  # the learning rates this step uses
        except BaseException:
            if exact:
                undo.restore()
            raise
        undo.clear()
        return _Prepared(scale=scale, found_inf=found_inf, norms=norms, lrs=lrs, with_grad=with_grad)

    def _apply(self, active: dict[str, Group], prepared: _Prepared, undo: Rollback) -> None:
        """The second part: clip, one optimizer step per group, ONE scaler update, the schedulers of the groups
        that stepped. Nothing here touches the counters or zeroes a gradient."""
        for name, g in active.items():
            if g.max_grad_norm is not None:  # a group found non-finite is skipped: clipping it changes nothing
                _clip_with_norm(prepared.with_grad[name], g.max_grad_norm, prepared.norms[name])
        stepped = self._step_optimizers(active, prepared.found_inf, undo)
        scheduled = [g for name, g in active.items() if g.scheduler is not None and stepped[name]]
        undo.schedulers(scheduled)
        for g in scheduled:
            g.scheduler.step()

    def _step_optimizers(
        self, active: dict[str, Group], found_inf: dict[str, bool | torch.Tensor], undo: Rollback
    ) -> dict[str, bool]:
        """One optimizer step per group, then ONE scaler update. A group with inf/NaN gradients is skipped: on
        the device by an optimizer that supports it (no host sync), else from the host. Returns, per group,
        whether its schedule advances: False for a group skipped on the host."""
        stepped: dict[str, bool] = {}
        for name, g in active.items():
            opt = g.optimizer
            assert opt is not None  # checked by check_configured
            found = found_inf[name]
            if self._scaling:
                if not skips_on_device(opt):
                    found = found_inf[name] = bool(found)  # what scaler.step itself reads: one sync per optimizer
                if found is not True:  # it may step (a tensor: decided on the device)
                    undo.optimizer(g)
                self.scaler.step(opt)
            elif isinstance(found, torch.Tensor) and skips_on_device(opt):
                undo.optimizer(g)
                _step_on_device(opt, found)
            else:
                found = found_inf[name] = bool(found)  # an optimizer that cannot skip on the device: read it
                if not found:
                    undo.optimizer(g)
                    opt.step()
            stepped[name] = found is not True
        if self._scaling and active:
            self.scaler.update()
        return stepped

    def _window_stats(
        self, active: dict[str, Group], prepared: _Prepared, losses: dict[str, torch.Tensor]
    ) -> dict[str, GroupStats]:
        """Per group: the window's mean loss, its gradient norm, the learning rates used, whether it skipped.
        Device values stay tensors (read when accessed)."""
        divisor = self._divisor()
        return {
            name: GroupStats(
                loss=_Mean.of(losses.get(name), divisor),
                grad_norm=prepared.norms.get(name),
                lrs=prepared.lrs[name],
                skipped=True if name not in active else prepared.found_inf[name],
                skip_reason="no_grad" if name not in active else None,
            )
            for name in self.groups
        }

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


def _lrs(g: Group) -> tuple[Any, ...]:
    """The learning rates of ``g``'s optimizer now: floats, or copies of tensor ones (read when the stats are)."""
    if g.optimizer is None:
        return (math.nan,)
    return tuple(
        pg["lr"].detach().clone() if isinstance(pg["lr"], torch.Tensor) else pg["lr"] for pg in g.optimizer.param_groups
    )


def _group_stats(g: Group, loss: float | None, norm: float | None, *, skipped: bool) -> GroupStats:
    return GroupStats(loss=loss, grad_norm=norm, lrs=_lrs(g), skipped=skipped)


def _nonfinite(norm: torch.Tensor) -> torch.Tensor:
    """1 where ``norm`` is inf or NaN, else 0, in ``norm``'s dtype (float32 norms give what a fused optimizer's
    ``found_inf`` takes as it is): ``inf * 0`` and ``NaN * 0`` are NaN, which is the only value unequal to 0
    here. Two kernels (``isfinite``, ``logical_not`` and a cast to float32 are three)."""
    return norm.mul(0).ne_(0)


def _step_on_device(opt: Any, found_inf: torch.Tensor) -> None:
    """``opt.step()`` skipped on the device where ``found_inf`` is nonzero: the attributes ``GradScaler.step``
    hands an optimizer that supports it (``grad_scale`` None: the gradients are already unscaled)."""
    opt.grad_scale = None
    opt.found_inf = found_inf.to(torch.float32).reshape(())
    try:
        opt.step()
    finally:
        del opt.grad_scale
        del opt.found_inf


@dataclass(frozen=True)
class _Prepared:
    """What the first part of a real step found: the scale, per group whether its gradients are non-finite
    (a bool, or a tensor when known on the device only), the norms, the learning rates used, and the parameters
    with a gradient (what is clipped)."""

    scale: torch.Tensor | float | None
    found_inf: dict[str, bool | torch.Tensor]
    norms: dict[str, torch.Tensor]
    lrs: dict[str, tuple[Any, ...]]
    with_grad: dict[str, list[torch.Tensor]]


class _Mean:
    """A window's summed loss divided by the micro-batch count, computed on the host when read (as a float64
    division of the float32 sum, as before)."""

    __slots__ = ("divisor", "total")

    def __init__(self, total: torch.Tensor, divisor: int) -> None:
        self.total, self.divisor = total, divisor

    @staticmethod
    def of(total: torch.Tensor | None, divisor: int) -> _Mean | None:
        return None if total is None else _Mean(total, divisor)

    def __float__(self) -> float:
        return float(self.total) / self.divisor
