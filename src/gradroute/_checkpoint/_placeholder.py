"""What a checkpointed segment's autograd nodes save in place of tensors, and how a dropped tensor is remade."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._compat import CheckpointError, no_autocast, version

# NOTE [Placeholder values]
# A segment's nodes save a Placeholder instead of each tensor (the pack hook of the original forward); the
# recomputation files the recomputed tensor into ``values[key]``, one entry per recomputation key (NOTE
# [Recomputation keys] in _hooks.py). An entry is one of three, so that each unpack knows what to do:
#   1. a tensor: recomputed and not yet used, or kept for the next engine call of a routed backward;
#   2. None: a plain (torch-like) backward used it; unpacking it again is an error, as in torch;
#   3. REMADE_ON_USE: a routed engine call used it and dropped it, because cheap ops can make it again from other
#      placeholders' tensors (``remake``, NOTE [Remade tensors] in _remakes.py).
# Everything goes when the autograd node that saved the placeholder is freed.


class _RemadeOnUse:
    """The type of :data:`REMADE_ON_USE` (a named sentinel: shows as such in a debugger)."""

    def __repr__(self) -> str:
        return "REMADE_ON_USE"


#: a placeholder's value once an engine call has used the tensor and dropped it: ``remake`` makes it again
REMADE_ON_USE: Any = _RemadeOnUse()


class Placeholder:
    """What the graph saves in place of a tensor of a checkpointed segment.

    Attributes:
        values: recomputation key -> the recomputed tensor, None or :data:`REMADE_ON_USE`.
        nbytes: bytes of the tensor it stands for (for the planner, :func:`held_bytes`).
        remake: how cheap ops make the tensor again from other placeholders' tensors, or None.
        registry: the segment registry of the thread whose forward saved it (see ``_registry.py``).
    """

    __slots__ = ("__weakref__", "nbytes", "registry", "remake", "values")

    def __init__(self, nbytes: int, registry: Any) -> None:
        self.values: dict[Any, torch.Tensor | None] = {}
        self.nbytes = nbytes
        self.remake: Remake | None = None
        self.registry = registry

    def get(self, key: Any) -> torch.Tensor | None:
        """The tensor for ``key``; made again by its remake if an earlier engine call dropped it."""
        x = self.values.get(key)
        if x is REMADE_ON_USE:
            if self.remake is None:  # unreachable: only placeholders with a remake drop their tensor
                raise CheckpointError("gradroute.checkpoint: a dropped saved tensor has no remake (internal error)")
            with no_autocast():  # the ops were recorded below autocast, on tensors it had already cast
                return self.remake.run(key)
        return x


class Remake:
    """One cheap op to run again, on the tensors of placeholders (or of other ``Remake``) for one key."""

    __slots__ = ("args", "func", "kwargs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def run(self, key: Any) -> torch.Tensor:
        args, kwargs = map_args(_value_for(key), self.args, self.kwargs)
        return self.func(*args, **kwargs)


def _value_for(key: Any) -> Callable[[Any], Any]:
    def value(a: Any) -> Any:
        if isinstance(a, Placeholder):
            return a.get(key)
        return a.run(key) if isinstance(a, Remake) else a

    return value


def map_args(fn: Callable[[Any], Any], args: Any, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``fn`` on each argument (pointwise and view ops take their tensors as arguments, not in lists)."""
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


def value_version(p: Placeholder, key: Any) -> int | None:
    """The version counter of ``p``'s tensor for ``key`` (None: not a tensor now)."""
    x = p.values.get(key)
    return version(x) if isinstance(x, torch.Tensor) else None
