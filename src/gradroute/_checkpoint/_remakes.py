"""Remade tensors: which saved tensors of a shared recomputation cheap ops made from other saved tensors.

NOTE [Remade tensors]
Several engine calls go through a shared segment, and the first must keep every recomputed tensor for the next.
A tensor that cheap ops made from other saved tensors need not be kept:

1. What is remade: tensors that pointwise ops, dtype casts and views made from other saved tensors (SiLU of a
   norm's output cast by autocast for a convolution, GELU and the gated product in a feed-forward, flattened
   for the next linear). Their placeholder keeps the ops (a ``Remake``) and the tensor is dropped as soon as
   each call has used it, as a plain backward drops it; what the first call keeps beyond a plain backward is
   then what matrix products, convolutions, norms and attention made.
2. Never remade: the outputs of random ops and in-place ops, and a tensor modified in place after it was made
   (checked by version counters at the end of the recomputation): making them again would not give the tensor
   the forward saved.
3. Tensors are matched by their data (storage, offset, shape, strides, dtype), not by object: autograd hands
   views on as new objects.
4. Recording costs a Python dispatch mode during shared recomputations, and the cheap ops run once more per
   call; so only segments that save ``PlanOptions.remake_min_bytes`` or more record remakes: below that, the
   host time costs more than the memory saved is worth.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._compat import StorageWeakRef, TorchDispatchMode, op_schema, storage_id, version
from ._placeholder import Placeholder, Remake, map_args

#: cheap ops in a row a remake may chain
_MAX_CHAIN = 4
_TO_COPY = torch.ops.aten._to_copy.default

#: what identifies a tensor's data while its storage lives (views are new objects at every level)
DataKey = tuple[Any, ...]
#: for each placeholder whose tensor can be remade: the remake, and the (placeholder, version) pairs to check
#: once the recomputation is over (None: the tensor's own placeholder)
Pending = tuple[Placeholder, Remake, list[tuple[Placeholder | None, int]]]


def data_key(t: torch.Tensor) -> DataKey:
    """What identifies a tensor's data while its storage lives."""
    return (storage_id(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _WeakTensor:
    """A tensor a cheap op took or made, weakly: its data key, its storage, its version at the time."""

    __slots__ = ("data", "ref", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.data = data_key(t)
        self.ref = StorageWeakRef(t.untyped_storage())
        self.version = version(t)


def _weak(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and (a.dim() > 0 or a.requires_grad):
        return _WeakTensor(a)
    return a  # not a tensor, or a 0-d one outside autograd: a Python number the op wrapped (kept)


@functools.cache
def _cheap(func: Any) -> bool:
    """A functional pointwise op (not random), a dtype cast (autocast's) or a view op: cheap to run again."""
    schema = op_schema(func)
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags or func is torch.ops.aten.detach.default:
        return False  # (detach: the pack hooks' own)
    if func is _TO_COPY or torch.Tag.pointwise in func.tags:
        return True
    return len(schema.returns) == 1 and schema.returns[0].alias_info is not None


def _tensor_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a)


class RemakeRecorder(TorchDispatchMode):
    """During a shared recomputation: records which tensors cheap ops made, to remake saved ones later."""

    def __init__(self) -> None:
        super().__init__()
        # data key -> (op, args, kwargs, the tensor it made), tensors held weakly
        self.made: dict[DataKey, tuple[Any, Any, Any, _WeakTensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            type(out) is torch.Tensor
            and _cheap(func)
            and not any(map(_tensor_list, args))
            and (func is not _TO_COPY or args[0].device == out.device)  # a cast, not a transfer
        ):
            data = data_key(out)
            known = self.made.get(data)
            if known is None or known[3].ref.expired():  # else a view of the same data (detach): keep the first
                # weak: the forward's temporaries still go
                args, kwargs = map_args(_weak, args, kwargs)
                self.made[data] = (func, args, kwargs, _WeakTensor(out))
        return out

    def remake_of(self, x: torch.Tensor, saved: dict[DataKey, Placeholder]) -> tuple[Remake, list[Any]] | None:
        """How to make ``x`` again from the placeholders in ``saved`` (by data key), and the (placeholder,
        version) pairs to check at the end of the recomputation (``None``: ``x``'s own placeholder); or None."""
        entry = self.made.get(data_key(x))
        if entry is None or entry[3].ref.expired():  # none, or a freed tensor's whose storage was reused
            return None
        versions: list[tuple[Placeholder | None, int]] = [(None, entry[3].version)]
        remake = self._build(entry, saved, versions, 0)
        return None if remake is None else (remake, versions)

    def _build(self, entry: Any, saved: dict[DataKey, Placeholder], versions: list[Any], depth: int) -> Remake | None:
        func, args, kwargs, _ = entry
        ok = True

        def resolve(a: Any) -> Any:
            nonlocal ok
            if not isinstance(a, _WeakTensor) or not ok:
                return a
            found = None if a.ref.expired() else self._source(a, saved, versions, depth)
            ok = found is not None
            return found

        args, kwargs = map_args(resolve, args, kwargs)
        return Remake(func, args, kwargs) if ok else None

    def _source(
        self, a: _WeakTensor, saved: dict[DataKey, Placeholder], versions: list[Any], depth: int
    ) -> Placeholder | Remake | None:
        """Where a remake finds the argument ``a``: a saved tensor's placeholder, or cheap ops on those."""
        p = saved.get(a.data)
        if p is not None:
            versions.append((p, a.version))
            return p
        inner = self.made.get(a.data)  # made by cheap ops from saved tensors, itself not saved
        if depth < _MAX_CHAIN and inner is not None and inner[3].version == a.version:
            return self._build(inner, saved, versions, depth + 1)
        return None
