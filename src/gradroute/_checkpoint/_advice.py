"""A warning where a routed backward recomputes checkpointed segments once per engine call for want of cut points.

NOTE [Advice on missing cut points]
Where plain code hands a tensor to ops on both sides of a segment (diffusers' skip connections leave from
un-checkpointed modules), the planner recomputes those segments once per engine call (NOTE [Shared or per-call
recomputation] in _planner/per_call.py): exact but slow, and the fix (cut points) is one call that the user
would otherwise learn of only from ``print(router.plan(...))``. Rules:

1. The warning is given from the per-call unpack, which runs only where the planner chose per-call
   recomputation.
2. A segment of a diffusers module (or its method) warns unless a cut point covers it: that module or one it
   is part of was given to ``cut_points`` or ``checkpoint_modules`` (``gradroute.enable_checkpointing(unet)``
   calls ``cut_points``); the warning names ``enable_checkpointing(unet)``. Any other segment warns only while
   no cut point at all is alive in the process (the modules to mark are those whose outputs cross the segments,
   which the unpack cannot name); the warning names ``cut_points`` and ``checkpoint_modules``. With cut points,
   a plan may still recompute per call (a candidate of the measured choice that does not interleave), and a
   cut point's hook removed later still counts: the warning errs on the side of silence.
3. Not under FSDP2, where the passes are never interleaved (docs/distributed.md): cut points would not help.
4. At most once per routed backward, and one message text per segment class, so that Python's default warning
   filter shows it once per process; nothing else changes (the gradients are those of the plan, exact).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

from torch import nn

from .._compat import fsdp_states

DIFFUSERS = (
    "gradroute.checkpoint: this routed backward recomputes diffusers' checkpointed layers once per engine call, "
    "as torch's checkpoint would: nothing lets the router cut its passes between them (diffusers' skip "
    "connections leave from un-checkpointed modules). Call gradroute.enable_checkpointing(unet) instead of "
    "unet.enable_gradient_checkpointing(...): it also marks the UNet's layers as cut points, so that each "
    "layer is recomputed once per routed backward (docs/checkpointing.md; print(router.plan(...)) shows the plan)"
)

OTHER = (
    "gradroute.checkpoint: this routed backward recomputes checkpointed segments ({name}) once per engine call, "
    "as torch's checkpoint would: nothing lets the router cut its passes between them (plain code hands a tensor "
    "to ops on both sides of a segment, as skip connections do). Call gradroute.cut_points(*modules) on the "
    "modules whose outputs those tensors are, or checkpoint whole blocks with gradroute.checkpoint_modules("
    "*blocks), so that each segment is recomputed once per routed backward (docs/checkpointing.md; "
    "print(router.plan(...)) shows the plan)"
)

_advised: weakref.WeakSet[Any] = weakref.WeakSet()  # the routed backwards (sessions) warned in
_covered: weakref.WeakSet[Any] = weakref.WeakSet()  # cut points and checkpointed modules, and their submodules


def cover(modules: Any) -> None:
    """Remember ``modules`` (given to ``cut_points`` or ``checkpoint_modules``) and their submodules."""
    _covered.update(sub for m in modules for sub in m.modules())


def advise_cut_points(fn: Any, session: Any) -> None:
    """Warn (NOTE [Advice on missing cut points]) if ``fn``, a segment recomputed per call in ``session``, is
    not covered by a cut point (rule 2)."""
    if session in _advised:
        return
    message = _message(fn)
    if message is None or _fsdp2_live():
        return
    _advised.add(session)
    warnings.warn(message, UserWarning, stacklevel=2)


def _message(fn: Any) -> str | None:
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", fn)
    if type(owner).__module__.startswith("diffusers."):
        return None if owner in _covered else DIFFUSERS
    if len(_covered):
        return None
    name = type(owner).__name__ if isinstance(owner, nn.Module) else getattr(owner, "__qualname__", repr(owner))
    return OTHER.format(name=f"`{name}`")


def _fsdp2_live() -> bool:
    states = fsdp_states()
    return states is not None and next(iter(states), None) is not None
