"""Undo for ``router.step()`` and ``router.load_state_dict()``: what a failed step puts back, and how.

NOTE [Atomic step]
"A failed ``step()`` leaves everything as before", kept two ways: by ordering (``Router(atomic_step=True)``, the
default: no copy of parameters or optimizer state) and by copies (``atomic_step="copy"``).

1. By ordering, a real step runs in two parts. The first (``prepare``) does everything that can fail on the
   user's or the values' account: the checks, ``scaler.unscale_`` per group and its found-inf records, every
   ``grad_hook``, the gradient norms, the learning rates read for the stats. It changes nothing but the
   gradients (unscale, hooks) and the scaler's per-optimizer records, so that it can be undone.
2. A failure in the first part is undone exactly. The scaler's records are put back (a dictionary, no tensor
   copied). An unscaled gradient is multiplied back by the scale it was divided by: when the scale is a power
   of two (its initial or loaded value and its growth and backoff factors all are, as torch's defaults) both
   products are exact, except for unscaled values below 2**-126 in magnitude (subnormal), whose last bits the
   unscale already lost. When the scale can be another number, the stepped groups' gradients are copied before
   the unscale instead. A group with a ``grad_hook`` has its gradients copied before its hook runs (a hook may
   change them in place and then raise); those copies are dropped when the first part ends, before any
   optimizer allocates.
3. The second part (``apply``) runs no user code of the router's own: the clipping (a multiplication by
   ``max_norm / norm``, not exactly invertible, hence not in the first part), each group's ``optimizer.step``
   (through ``scaler.step``), ONE ``scaler.update``, the schedulers, and the gradients set to None. A
   ``KeyboardInterrupt`` (SIGINT on the main thread, where the handler is Python's or the user's own) arriving
   during it is held and raised when the step has finished, so that Ctrl-C never leaves half the groups stepped
   (in every ``atomic_step`` mode).
4. By ordering, an exception raised inside the second part itself (inside an optimizer's or a scheduler's own
   ``step()``: an out-of-memory error while an optimizer allocates its state, a custom optimizer or a
   ``LambdaLR`` function that raises) is not undone: groups stepped before it keep their update; the scaler and
   the router's counters are put back, so a later ``step()`` is accepted (call ``zero_grad()`` and go on, or
   load a checkpoint). ``atomic_step=False`` undoes neither part's changes to gradients.
5. With copies, a real step is a transaction: each change is preceded by a copy of exactly what it touches (the
   stepped groups' gradients before the first unscale, a group's parameters and optimizer state before its
   optimizer steps, the schedulers before they step, the scaler's state once at the start). On any exception
   (``BaseException``, ``KeyboardInterrupt`` too) the copies are written back in place where the tensor is still
   there, so that DDP's gradient buckets and anything else holding a reference stay valid, and the exception
   propagates unchanged. The copies cost one more copy of the stepped groups' gradients, parameters and
   optimizer state while the step runs. ``load_state_dict`` always undoes this way.
6. No undo reaches optimizer attributes outside ``state`` and ``param_groups``, nor side effects of user code (a
   hook that logged, a file written).
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
from collections.abc import Iterable, Iterator
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
        if not self.enabled:
            return
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


class Unscaled:
    """The exact undo of the first part of a default step (NOTE [Atomic step], rule 2).

    Args:
        scale: the scale the gradients were scaled by (a tensor, or a float), None without a scaler.
        copy_all: copy every stepped gradient before the unscale (the scale may not be a power of two).
    """

    def __init__(self, scale: torch.Tensor | float | None, *, copy_all: bool) -> None:
        self._scale = scale
        self._copy_all = copy_all
        self._unscaled: list[torch.Tensor] = []  # parameters whose gradient was divided by the scale
        self._saved: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}  # param -> (its grad, a copy)

    def _keep(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if p.grad is not None and p not in self._saved:
                self._saved[p] = (p.grad, p.grad.detach().clone())

    def before_unscale(self, g: Group) -> None:
        """``g``'s gradients are about to be unscaled."""
        if self._copy_all:
            self._keep(g.params)
        else:
            self._unscaled.extend(p for p in g.params if p.grad is not None and p not in self._saved)

    def before_hook(self, g: Group) -> None:
        """``g``'s ``grad_hook`` is about to run: it may change the gradients in place before it raises."""
        self._keep(g.params)

    def restore(self) -> None:
        """Put every gradient back as it was before the step."""
        for p, (grad, saved) in self._saved.items():
            with torch.no_grad():
                grad.copy_(saved)
            p.grad = grad
        # the unscaled ones (a hooked group's copy was taken after its unscale): times the scale, exactly
        scale = self._scale
        if scale is not None:
            with torch.no_grad():
                for p in self._unscaled:
                    if p.grad is not None:
                        p.grad.mul_(scale.to(p.grad.device) if isinstance(scale, torch.Tensor) else scale)
        self.clear()

    def clear(self) -> None:
        """The first part succeeded: drop the copies."""
        self._saved = {}
        self._unscaled = []


# CPython's C functions behind ``signal.signal``/``getsignal``, without their conversion of handlers to enums (most
# of the cost of holding Ctrl-C for a host-bound step); ``signal`` itself elsewhere
_signals: Any = getattr(signal, "_signal", signal)


@contextlib.contextmanager
def hold_interrupt() -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block and deliver it when the block ends (NOTE [Atomic step],
    rule 3). Only on the main thread, and only where the SIGINT handler is a Python callable
    (Python's ``default_int_handler`` or the user's own); elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _signals.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held: list[Any] = []

    def hold(signum: int, frame: Any) -> None:
        held.append((signum, frame))

    _signals.signal(signal.SIGINT, hold)
    try:
        yield
    except BaseException:
        _signals.signal(signal.SIGINT, previous)
        raise  # already failing: that exception propagates (the held Ctrl-C is dropped with the step's result)
    _signals.signal(signal.SIGINT, previous)
    if held:
        previous(*held[0])
