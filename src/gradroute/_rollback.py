"""Undo for ``router.step()`` and ``router.load_state_dict()``: copies of what they may change, put back on failure.

NOTE [A step is a transaction]
A real step changes, group by group, the gradients (unscale, ``grad_hook``, clipping), the parameters and the
optimizer state (``optimizer.step``), the schedule (``scheduler.step``) and, once, the GradScaler
(``unscale_`` records, ``update``). Any of these can raise: user code in a hook or a custom optimizer, an
out-of-memory error, a Ctrl-C between two groups. Without an undo, a failed step leaves some groups stepped
and others not (a retry steps the first ones twice) and the scaler with an optimizer in stage UNSCALED, which
refuses every later iteration.

So each change is preceded by a copy of exactly what it touches: the gradients of the groups that step
before the first unscale, the parameters and optimizer state of a group before its optimizer steps, the
schedulers before they step; the scaler's state once at the start. On any exception (``BaseException``:
``KeyboardInterrupt`` too) the copies are written back, in place where the tensor is still there (so DDP's
gradient buckets and anything else holding a reference stay valid), and the exception propagates unchanged.
The copies are dropped when the step returns: while it runs, they cost one more copy of the stepped groups'
gradients, parameters and optimizer state (``Router(atomic_step=False)`` saves that memory and gives up the
undo of parameters, gradients and optimizer state; the scaler and the counters are still put back).

What an undo cannot reach: optimizer attributes outside ``state`` and ``param_groups``, and side effects of
user code (a hook that logged, a file written).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from ._group import Group


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _hyper(param_group: dict[str, Any]) -> dict[str, Any]:
    """A copy of an optimizer's parameter group, the ``params`` list itself excepted (never changed)."""
    return {k: v if k == "params" else _clone(v) for k, v in param_group.items()}


def _put_back(current: Any, saved: Any) -> Any:
    """``saved``, written into ``current`` when that is a tensor of the same kind (kept alive elsewhere)."""
    if (
        isinstance(current, torch.Tensor)
        and isinstance(saved, torch.Tensor)
        and current.shape == saved.shape
        and current.dtype == saved.dtype
        and current.device == saved.device
    ):
        with torch.no_grad():
            current.copy_(saved)
        return current
    return saved


class Rollback:
    """Copies taken before each change of a step; :meth:`restore` writes them back, newest first."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._undo: list[Any] = []

    def grads(self, groups: Iterable[Group]) -> None:
        """Before the gradients of ``groups`` change."""
        if not self.enabled:
            return
        saved = [(p, None if p.grad is None else p.grad.detach().clone()) for g in groups for p in g.params]
        self._undo.append(("grads", saved))

    def optimizer(self, g: Group, *, params: bool = True) -> None:
        """Before ``g``'s optimizer steps (or loads a state): its parameters (unless ``params=False``) and the
        optimizer's state and hyperparameters."""
        opt = g.optimizer
        if not self.enabled or opt is None:
            return
        saved = [(p, p.detach().clone()) for p in g.params] if params else []
        state = {p: {k: _clone(v) for k, v in s.items()} for p, s in opt.state.items()}
        hyper = [_hyper(pg) for pg in opt.param_groups]
        self._undo.append(("optimizer", (opt, saved, state, hyper)))

    def schedulers(self, groups: Iterable[Group]) -> None:
        """Before the schedulers of ``groups`` step (they also write the optimizers' learning rates)."""
        scheds = [g for g in groups if g.scheduler is not None and g.optimizer is not None]
        saved = [
            (g.scheduler, copy.deepcopy(g.scheduler.state_dict()), [_hyper(pg) for pg in g.optimizer.param_groups])
            for g in scheds
            if g.optimizer is not None
        ]
        self._undo.append(("schedulers", saved))

    def restore(self) -> None:
        """Write every copy back, newest first; the undo list is emptied."""
        while self._undo:
            kind, saved = self._undo.pop()
            if kind == "grads":
                for p, grad in saved:
                    p.grad = None if grad is None else _put_back(p.grad, grad)
            elif kind == "optimizer":
                _restore_optimizer(*saved)
            else:
                for sched, state, hyper in saved:
                    sched.load_state_dict(state)
                    _restore_hyper(sched.optimizer.param_groups, hyper)

    def clear(self) -> None:
        self._undo = []


def _restore_optimizer(opt: Any, params: list, state: dict, hyper: list[dict[str, Any]]) -> None:
    with torch.no_grad():
        for p, value in params:
            p.copy_(value)
    current = opt.state
    for p in list(current):
        if p not in state:
            del current[p]
    for p, saved in state.items():
        now = current.get(p, {})
        current[p] = {k: _put_back(now.get(k), v) for k, v in saved.items()}
    _restore_hyper(opt.param_groups, hyper)


def _restore_hyper(param_groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    for pg, old in zip(param_groups, saved, strict=True):
        for k in [k for k in pg if k not in old]:
            del pg[k]
        pg.update(old)
