"""Per-consumer views: a segment's inputs and outputs hand every op that consumes them a view of its own.

NOTE [Why a view per consumer]
The router interleaves its passes through a shared segment chunk by chunk (``PlanOptions.chunk``), which
needs cuts between the chunks, and a cut is a ``GradientEdge``: it captures the sum of everything flowing
into a node input. A tensor consumed by ops on both sides of a cut line would merge both sides' gradients
into one node input, and the line could not be cut. So every edge into and out of a segment gets an autograd
node of its own: the tensors a segment takes and returns become ``SegmentTensor``s, and each op that
consumes one consumes a fresh ``view_as`` of it. ``cut_points`` does the same for chosen modules' outputs
outside any segment (diffusers' skip connections leave from un-checkpointed modules).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._compat import disable_torch_function_subclass, is_optimized_module, tree_map


class SegmentTensor(torch.Tensor):
    """A tensor a checkpointed segment took or returned: every op that consumes it consumes a view of its own.

    The ops return plain tensors; attribute reads (``.shape``, ``.grad_fn``, ...) see the tensor itself.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # once per op on the tensor: kept short (its cost is most of gradroute.checkpoint's in a small forward)
        with disable_torch_function_subclass():
            if func in _ON_THE_TENSOR or getattr(func, "__name__", "") == "__get__" or not torch.is_grad_enabled():
                return func(*args, **kwargs) if kwargs else func(*args)
            if kwargs:
                return func(*_own_views(args), **_own_views(kwargs))
            return func(*_own_views(args))


# methods that act on the tensor itself, not ops that consume it (a hook on a fresh view would never fire), and
# metadata reads (a view would be made for nothing)
_ON_THE_TENSOR = frozenset(
    {
        torch.Tensor.register_hook,
        torch.Tensor.retain_grad,
        torch.Tensor.register_post_accumulate_grad_hook,
        torch.Tensor.requires_grad_,
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.numel,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.element_size,
    }
)


def _own_view(x: Any) -> Any:
    return x.view_as(x) if isinstance(x, SegmentTensor) else x


def _own_views(x: Any) -> Any:
    """``x`` with every :class:`SegmentTensor` in it replaced by a view of its own.

    An op's arguments are a tuple of tensors, numbers and lists of tensors almost always: those are mapped
    here directly (``tree_map`` took about 15 us per op, most of the views' cost in the host-bound regime);
    any other container goes through ``tree_map``.
    """
    kind = type(x)
    if kind is tuple or kind is list:
        return kind([_own_views(v) for v in x])
    if kind is SegmentTensor:
        return x.view_as(x)
    if kind is dict:
        return {k: _own_views(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return _own_view(x)
    if isinstance(x, (tuple, list, dict)):  # a named tuple, an ordered dict...
        return tree_map(_own_view, x)
    return x


def consumer_views(x: Any) -> Any:
    """A segment's input or output as a :class:`SegmentTensor` (every consuming op gets a view of its own)."""
    if (
        isinstance(x, torch.Tensor)
        and x.requires_grad
        and type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
    ):
        return x.as_subclass(SegmentTensor)
    return x


def plain(x: Any) -> Any:
    """``x`` as a plain tensor if it is a :class:`SegmentTensor` (compiled code cannot take the subclass)."""
    return x.as_subclass(torch.Tensor) if isinstance(x, SegmentTensor) else x


def view_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: the module's outputs hand each consumer a view of its own (:func:`cut_points`)."""
    return tree_map(consumer_views, output)


def compiled(fn: Any, inside: bool = False) -> bool:
    """Whether ``fn`` is code compiled by ``torch.compile`` (a compiled module or function, or a module whose
    ``compile()`` was called), looking through ``functools.partial`` and bound methods; ``inside``: or a
    module with such a submodule."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__self__", fn)
    if inside and isinstance(fn, torch.nn.Module):
        return any(compiled(m) for m in fn.modules())
    return is_optimized_module(fn)
