"""A warning where a routed backward recomputes diffusers' checkpointed layers once per engine call.

NOTE [Advice on missing cut points]
diffusers' own switch checkpoints the layers inside its UNet blocks, but its skip connections leave from
un-checkpointed modules, so the planner cannot interleave its passes through those segments and recomputes
them once per engine call (NOTE [Segments the passes cannot interleave] in _api.py). That is exact but slow,
and ``print(router.plan(...))`` was the only place that said so. Rules:

1. The warning is given from the per-call unpack, which runs only where the planner chose per-call
   recomputation, and only for a segment whose function is a diffusers module (or its method) that no cut
   point covers: neither that module nor one it is part of was given to ``cut_points`` (or
   ``checkpoint_modules``; ``gradroute.enable_checkpointing(unet)`` calls ``cut_points``). With cut points, a
   plan may still recompute per call (a candidate plan of the autotuner that does not interleave): no warning.
   A cut point's hook removed later still counts as one: the warning errs on the side of silence.
2. Not under FSDP2, where the passes are never interleaved (docs/distributed.md): cut points would not help.
3. At most once per routed backward, and one message text, so that Python's default warning filter shows
   it once per process; nothing else changes (the gradients are those of the plan, exact).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

from .._compat import fsdp_states

MESSAGE = (
    "gradroute.checkpoint: this routed backward recomputes diffusers' checkpointed layers once per engine call, "
    "as torch's checkpoint would: nothing lets the router cut its passes between them (diffusers' skip "
    "connections leave from un-checkpointed modules). Call gradroute.enable_checkpointing(unet) instead of "
    "unet.enable_gradient_checkpointing(...): it also marks the UNet's layers as cut points, so that each "
    "layer is recomputed once per routed backward (docs/checkpointing.md; print(router.plan(...)) shows the plan)"
)

_advised: weakref.WeakSet[Any] = weakref.WeakSet()  # the routed backwards (sessions) warned in
_covered: weakref.WeakSet[Any] = weakref.WeakSet()  # cut points and checkpointed modules, and their submodules


def cover(modules: Any) -> None:
    """Remember ``modules`` (given to ``cut_points`` or ``checkpoint_modules``) and their submodules."""
    _covered.update(sub for m in modules for sub in m.modules())


def advise_cut_points(fn: Any, session: Any) -> None:
    """Warn (NOTE [Advice on missing cut points]) if ``fn``, a segment recomputed per call in ``session``, is
    a diffusers module's."""
    if session in _advised or not _uncovered_diffusers_module(fn) or _fsdp2_live():
        return
    _advised.add(session)
    warnings.warn(MESSAGE, UserWarning, stacklevel=2)


def _uncovered_diffusers_module(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", fn)
    return type(owner).__module__.startswith("diffusers.") and owner not in _covered


def _fsdp2_live() -> bool:
    states = fsdp_states()
    return states is not None and next(iter(states), None) is not None
