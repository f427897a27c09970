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

Everything that can be checked is checked before anything is touched, so a ``step()`` that raises a
``RuntimeError``/``ValueError`` of its own leaves parameters, gradients, optimizer, scheduler and scaler
state and the accumulation counter as they were. (Exceptions raised by user code, a ``grad_hook`` or an
optimizer's ``step``, propagate from wherever they happen.)
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import found_inf, scaler_stage
from ._distributed import GradSync, group_params
from ._group import Group, describe_param, optimizer_mismatch, scheduler_mismatch
from ._types import Route

_FORMAT = "gradroute.Router.state_dict/1"


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
        skipped: on a real step, the group's optimizer did not update: ``GradScaler`` found inf/NaN in its
            gradients, or the group had no gradient at all. Its scheduler was not stepped either. Always
            ``False`` on an accumulation micro-step.
        skip_reason: why it was skipped: ``"nonfinite"`` (GradScaler found inf/NaN) or ``"no_grad"`` (no
            loss reached the group since the last step); ``None`` when not skipped.
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

    def __init__(self, groups: Mapping[str, Group], *, scaler: Any = None, accumulate: int = 1) -> None:
        self.groups = groups
        self.accumulate = _check_accumulate(accumulate)
        self.scaler = _check_scaler(scaler)
        _check_step_parts(groups)
        self._phase = _Phase.READY
        self._micro = 0  # micro-batches of the current window already closed by step()
        self._steps = 0  # real steps done
        # Per group, the detached sum of the window's loss values: one scalar each, so a router whose step() is
        # never called (optimizers stepped by hand) does not grow.
        self._losses: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}  # of the backward in progress
        self._sync = GradSync(group_params(groups))  # DDP/FSDP2 wrappers: no gradient sync until a window's last
        self._sync.next_micro_batch(0, self.accumulate)

    # ------------------------------------------------------------------ backward

    @property
    def _scaling(self) -> bool:
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def before_backward(self, routes: list[Route]) -> list[Route]:
        """Record the losses' values; return routes whose losses are divided by ``accumulate`` and scaled."""
        self._sync.check(routes)
        self._pending = {r.name: _loss_value(r.losses) for r in routes}
        if not self._scaling and self.accumulate == 1:
            return routes
        return [Route(name=r.name, losses=tuple(self._scale(t) for t in r.losses), params=r.params) for r in routes]

    def _scale(self, t: torch.Tensor) -> torch.Tensor:
        # As in PyTorch's AMP notes: ``loss = loss / iters_to_accumulate``, then ``scaler.scale(loss)``.
        if self.accumulate > 1:
            t = t / self.accumulate
        if self._scaling:
            t = self.scaler.scale(t)
        return t

    def after_backward(self, routes: list[Route]) -> None:
        """The backward of ``routes`` is done: keep its loss values for the stats; ``step()`` may follow."""
        for name, value in self._pending.items():
            prev = self._losses.get(name)
            self._losses[name] = value if prev is None else prev.to(value.device) + value
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
        self._check_configured()
        micro = self._micro + 1
        if micro < self.accumulate:
            self._micro = micro
            self._phase = _Phase.READY
            self._sync.next_micro_batch(micro, self.accumulate)
            return StepStats(
                {n: _group_stats(g, None, None, skipped=False) for n, g in self.groups.items()},
                accumulating=True,
                micro_step=micro,
                accumulate=self.accumulate,
                step=self._steps,
                scale=None,
            )
        active = {n: g for n, g in self.groups.items() if any(p.grad is not None for p in g.params)}
        self._check_gradients(active)
        return self._real_step(active, micro)

    def _real_step(self, active: dict[str, Group], micro: int) -> StepStats:
        scaling = self._scaling
        scale = float(self.scaler.get_scale()) if scaling else None
        # 1. Unscale every optimizer once, all gradients being in. Record what GradScaler found.
        found_inf: dict[str, bool] = {}
        for name, g in active.items():
            if scaling:
                self.scaler.unscale_(g.optimizer)
            found_inf[name] = self._found_inf(g) if scaling else False
        # 2. Hooks see every group unscaled and none stepped.
        for g in active.values():
            if g.grad_hook is not None:
                g.grad_hook([p for p in g.params if p.grad is not None])
        # 3. Norm of the unscaled gradients; clip per group.
        norms: dict[str, torch.Tensor] = {}
        for name, g in active.items():
            params = [p for p in g.params if p.grad is not None]
            if g.max_grad_norm is not None:
                norms[name] = torch.nn.utils.clip_grad_norm_(params, g.max_grad_norm)
            else:
                norms[name] = _total_norm([p.grad for p in params if p.grad is not None])
        lrs = {name: _lrs(g) for name, g in self.groups.items()}  # the learning rates this step uses
        # 4. One optimizer step per group (GradScaler skips a group with inf/NaN), then ONE scaler update.
        for g in active.values():
            assert g.optimizer is not None  # checked by _check_configured
            if scaling:
                self.scaler.step(g.optimizer)
            else:
                g.optimizer.step()
        if scaling and active:
            self.scaler.update()
        # 5. Schedulers count optimizer updates actually applied.
        for name, g in active.items():
            if g.scheduler is not None and not found_inf[name]:
                g.scheduler.step()
        # 6. Zero every group, skipped ones included (their gradients may hold inf).
        for g in self.groups.values():
            for p in g.params:
                p.grad = None
        losses = self._take_losses()
        self._micro = 0
        self._steps += 1
        self._sync.next_micro_batch(0, self.accumulate)
        self._phase = _Phase.READY
        stats = {
            name: GroupStats(
                loss=losses.get(name),
                grad_norm=float(norms[name]) if name in norms else None,
                lr=lrs[name][0],
                lrs=lrs[name],
                skipped=name not in active or found_inf[name],
                skip_reason="no_grad" if name not in active else "nonfinite" if found_inf[name] else None,
            )
            for name in self.groups
        }
        return StepStats(
            stats,
            accumulating=False,
            micro_step=micro,
            accumulate=self.accumulate,
            step=self._steps,
            scale=scale,
        )

    def _found_inf(self, g: Group) -> bool:
        """Whether ``scaler.step`` will skip ``g``'s optimizer: the record ``unscale_`` left in the scaler.

        ``GradScaler._found_inf_per_device(optimizer)`` is private (torch has no public query for it); it is
        what ``scaler.step`` itself sums to decide. Without it, the unscaled gradients are checked.
        """
        skipped = found_inf(self.scaler, g.optimizer)
        if skipped is not None:
            return skipped
        return not all(bool(torch.isfinite(p.grad).all()) for p in g.params if p.grad is not None)

    def _take_losses(self) -> dict[str, float]:
        out = {name: float(total) / self.accumulate for name, total in self._losses.items()}
        self._losses = {}
        return out

    # ------------------------------------------------------------------ checks (nothing touched yet)

    def _check_configured(self) -> None:
        missing = [n for n, g in self.groups.items() if g.optimizer is None]
        if missing:
            raise RuntimeError(
                f"`step()` needs an optimizer for every group; group `{missing[0]}` has none "
                f"(give it: Router({missing[0]}=gradroute.Group(module, optimizer=...)), or step the "
                "optimizers yourself and do not call router.step())"
            )
        for name in self.groups:
            why = optimizer_mismatch(name, self.groups) or scheduler_mismatch(name, self.groups)
            if why:
                raise RuntimeError(f"{why}; it changed after the Router was built")

    def _check_gradients(self, active: Mapping[str, Group]) -> None:
        if not self._scaling:
            return
        for name, g in active.items():
            stage = scaler_stage(self.scaler, g.optimizer)
            if stage is not None and stage[0] is not stage[1]:
                raise RuntimeError(
                    f"the scaler was already used on group `{name}`'s optimizer since its last update() "
                    f"(stage {stage[0].name}): router.step() unscales and steps every optimizer "
                    "itself; do not call scaler.unscale_/scaler.step on them"
                )
            for p in g.params:
                if p.grad is not None and p.grad.dtype == torch.float16:
                    raise ValueError(
                        f"{describe_param(p, self.groups)} of group `{name}` has float16 gradients, which "
                        "GradScaler cannot unscale: keep the parameters in float32 and compute in float16 "
                        "with torch.autocast"
                    )

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
        """Optimizers, schedulers, scaler, counters; and the window's gradients when saved inside one."""
        in_window = self._micro > 0 or self._phase is _Phase.BACKWARD
        return {
            "format": _FORMAT,
            "accumulate": self.accumulate,
            "micro_step": self._micro,
            "steps": self._steps,
            "backward_pending": self._phase is _Phase.BACKWARD,
            "losses": {n: float(v) for n, v in self._losses.items()},
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
        """Restore :meth:`state_dict`; everything is checked before anything is loaded."""
        sd = self._check_state_dict(state_dict)
        for name, g in self.groups.items():
            if g.optimizer is not None:
                g.optimizer.load_state_dict(sd["optimizers"][name])
            if g.scheduler is not None:
                g.scheduler.load_state_dict(sd["schedulers"][name])
        if self.scaler is not None and sd["scaler"]:
            self.scaler.load_state_dict(sd["scaler"])
        grads = sd["grads"] or {}
        for name, g in self.groups.items():
            saved = grads.get(name)
            for k, p in enumerate(g.params):
                p.grad = None if saved is None or saved[k] is None else saved[k].detach().to(p).clone()
        self._micro = int(sd["micro_step"])
        self._sync.next_micro_batch(self._micro, self.accumulate)
        self._steps = int(sd["steps"])
        self._losses = {n: torch.tensor(float(v), dtype=torch.float64) for n, v in sd["losses"].items()}
        self._pending = {}
        self._phase = _Phase.BACKWARD if sd["backward_pending"] else _Phase.READY

    def _check_state_dict(self, sd: Any) -> Mapping[str, Any]:
        if not isinstance(sd, Mapping):
            raise TypeError(f"`state_dict` must be a mapping from Router.state_dict(), got {type(sd).__name__}")
        if sd.get("format") != _FORMAT:
            raise ValueError(
                f"`state_dict` is not from Router.state_dict() (format {sd.get('format')!r}, expected {_FORMAT!r})"
            )
        for kind, attr in (("optimizers", "optimizer"), ("schedulers", "scheduler")):
            have = {n for n, g in self.groups.items() if getattr(g, attr) is not None}
            saved = set(sd[kind])
            if have != saved:
                raise ValueError(
                    f"`state_dict` has {kind} for groups {sorted(saved)}, this Router for groups {sorted(have)}"
                )
        for name in sorted(sd["optimizers"]):
            opt = self.groups[name].optimizer
            assert opt is not None
            saved_groups = sd["optimizers"][name].get("param_groups", [])
            sizes = [len(pg["params"]) for pg in saved_groups]
            mine = [len(pg["params"]) for pg in opt.param_groups]
            if sizes != mine:
                raise ValueError(
                    f"the saved optimizer of group `{name}` has parameter groups of sizes {sizes}, this one {mine}"
                )
        saved_scaler = sd["scaler"]
        if self._scaling and not saved_scaler:
            raise ValueError("`state_dict` was saved without an enabled scaler; this Router's scaler is enabled")
        if self.scaler is None and saved_scaler:
            raise ValueError("`state_dict` holds a scaler's state; this Router has no `scaler`")
        micro = sd["micro_step"]
        if not (isinstance(micro, int) and 0 <= micro < self.accumulate):
            raise ValueError(
                f"`state_dict` was saved at micro-batch {micro!r} of an accumulation window of "
                f"{sd['accumulate']}; this Router has accumulate={self.accumulate}"
            )
        if sd["accumulate"] != self.accumulate and (micro or sd["backward_pending"]):
            raise ValueError(
                f"`state_dict` was saved inside an accumulation window of {sd['accumulate']} micro-batches; "
                f"this Router has accumulate={self.accumulate}"
            )
        unknown = set(sd["losses"]) - set(self.groups)
        if unknown:
            raise ValueError(f"`state_dict` has losses for unknown groups {sorted(unknown)}")
        for name, saved in (sd["grads"] or {}).items():
            g = self.groups.get(name)
            if g is None or len(saved) != len(g.params):
                raise ValueError(f"`state_dict` has gradients for group `{name}` that do not match this Router")
            for k, (t, p) in enumerate(zip(saved, g.params, strict=True)):
                if t is not None and tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"`state_dict` gradient {k} of group `{name}` has shape {tuple(t.shape)}, "
                        f"the parameter {tuple(p.shape)}"
                    )
        return sd


# ---------------------------------------------------------------------- helpers


def _check_accumulate(accumulate: Any) -> int:
    if isinstance(accumulate, bool):
        raise TypeError(f"`accumulate` must be an int >= 1, got bool ({accumulate!r})")
    try:
        n = operator.index(accumulate)
    except TypeError:
        raise TypeError(f"`accumulate` must be an int >= 1, got {type(accumulate).__name__} ({accumulate!r})") from None
    if n < 1:
        raise ValueError(f"`accumulate` must be >= 1, got {accumulate!r}")
    return n


_SCALER_METHODS = (
    "scale",
    "unscale_",
    "step",
    "update",
    "get_scale",
    "is_enabled",
    "state_dict",
    "load_state_dict",
)


def _check_scaler(scaler: Any) -> Any:
    if scaler is None:
        return None
    lacking = [m for m in _SCALER_METHODS if not callable(getattr(scaler, m, None))]
    if lacking:
        raise TypeError(
            f"`scaler` must be a torch.amp.GradScaler or None, got {type(scaler).__name__} "
            f"(it has no {', '.join(lacking)})"
        )
    return scaler


def _check_step_parts(groups: Mapping[str, Group]) -> None:
    """Optimizers own exactly their group's parameters, schedulers are bound to them; ValueError otherwise."""
    owner: dict[int, str] = {}
    for name, g in groups.items():
        if g.optimizer is not None:
            for m in ("step", "zero_grad", "state_dict", "load_state_dict"):
                if not callable(getattr(g.optimizer, m, None)) or not hasattr(g.optimizer, "param_groups"):
                    raise TypeError(
                        f"`optimizer` of group `{name}` must be a torch.optim.Optimizer, "
                        f"got {type(g.optimizer).__name__}"
                    )
            why = optimizer_mismatch(name, groups)
            if why:
                raise ValueError(why)
            for p in g.params:
                other = owner.setdefault(id(p), name)
                if other != name:
                    raise ValueError(
                        f"{describe_param(p, groups)} is in groups `{other}` and `{name}`, which both have "
                        "an optimizer: it would be unscaled, clipped and stepped twice"
                    )
        if g.scheduler is not None:
            if isinstance(g.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise TypeError(
                    f"`scheduler` of group `{name}` is a ReduceLROnPlateau, which steps on a metric: leave "
                    "`scheduler` unset and call its step(metric) yourself"
                )
            for m in ("step", "state_dict", "load_state_dict"):
                if not callable(getattr(g.scheduler, m, None)):
                    raise TypeError(
                        f"`scheduler` of group `{name}` must be a torch LRScheduler, got {type(g.scheduler).__name__}"
                    )
            why = scheduler_mismatch(name, groups)
            if why:
                raise ValueError(why)


def _loss_value(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The detached sum of a route's loss tensors, in at least float32 (no host sync)."""
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


def _lrs(g: Group) -> tuple[float, ...]:
    if g.optimizer is None:
        return (math.nan,)
    return tuple(float(pg["lr"]) for pg in g.optimizer.param_groups)


def _group_stats(g: Group, loss: float | None, norm: float | None, *, skipped: bool) -> GroupStats:
    lrs = _lrs(g)
    return GroupStats(loss=loss, grad_norm=norm, lr=lrs[0], lrs=lrs, skipped=skipped)
