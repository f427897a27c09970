"""Per-consumer views: a segment's inputs and outputs hand every op that consumes them a view of its own.

NOTE [A view per consumer]
Every edge into and out of a segment gets an autograd node of its own: the tensors a segment takes and returns
become ``SegmentTensor``s, and each op that consumes one consumes a fresh ``view_as`` of it.

1. Why: the planner interleaves its passes through a shared segment chunk by chunk (NOTE [Interleaving shared
   segments] in _planner/chunks.py), and a cut is a ``GradientEdge``, which captures the sum of everything
   flowing into one node input. A tensor consumed on both sides of a cut line would merge both sides'
   gradients into one input, and the line could not be cut. ``cut_points`` gives chosen modules' outputs
   outside any segment the same views (diffusers' skip connections leave from un-checkpointed modules).
2. Each view is a view of the plain tensor (``SegmentTensor.plain``), not of the ``SegmentTensor``: views of
   the alias would sum the segment's consumers into the alias node first and hand the producer one partial
   sum (``o + (a1 + a2)`` for ``(o + a2) + a1``); floating-point addition is not associative, and outside a
   routed backward the gradients must be bitwise those of the same code without the views (and so of torch's
   checkpoint, and of no checkpointing).
3. A view node is made just before its consumer, so it has the next lower sequence number and the engine runs
   it right after that consumer: the producer receives every gradient in the plain graph's order, added one by
   one into the same buffer. A view's backward is the identity, so the sums are the plain graph's.
4. The alias stays out of the graph a backward walks: attribute reads and writes (``.grad_fn``, ``.grad``,
   ``.requires_grad``, ...) and the methods that act on the tensor itself (hooks, ``retain_grad``) go to the
   plain tensor, as if the caller held it. Only code that bypasses ``__torch_function__`` (a custom
   ``autograd.Function``'s ``apply``) consumes the alias, whose gradient is then summed there first: exact,
   not in the plain graph's order.
5. A leaf is not wrapped: autocast casts a leaf that requires grad once per autocast region and keeps the cast,
   so every consumer shares one cast node and the gradients are summed in low precision before the cast back;
   a view is no leaf and would be cast once per consumer. The planner needs no cut above a leaf: its
   accumulation node is where every pass ends.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._compat import disable_torch_function_subclass, is_optimized_module, tree_map


class SegmentTensor(torch.Tensor):
    """A tensor a checkpointed segment took or returned: every op that consumes it consumes a view of its own.

    The ops return plain tensors; attribute reads and writes (``.shape``, ``.grad_fn``, ``.grad``, ...) and
    the methods in ``_ON_THE_TENSOR`` act on :attr:`plain`, the tensor it was made from (NOTE [A view per
    consumer]).

    Attributes:
        plain: the plain tensor (the views are its views, so gradients sum where they would without them).
    """

    plain: torch.Tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # once per op on the tensor: kept short (its cost is most of gradroute.checkpoint's in a small forward)
        with disable_torch_function_subclass():
            if func in _ON_THE_TENSOR or getattr(func, "__name__", "") in _ACCESSORS:
                args = (_plain_of(args[0]), *args[1:])
                return func(*args, **kwargs) if kwargs else func(*args)
            if not torch.is_grad_enabled():
                return func(*args, **kwargs) if kwargs else func(*args)
            if kwargs:
                return func(*_own_views(args), **_own_views(kwargs))
            return func(*_own_views(args))


_ACCESSORS = frozenset({"__get__", "__set__", "__delete__"})


def _plain_of(x: Any) -> Any:
    return x.plain if type(x) is SegmentTensor else x


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
    if isinstance(x, SegmentTensor):
        x = x.plain
        return x.view_as(x)
    return x


def _own_views(x: Any) -> Any:
    """``x`` with every :class:`SegmentTensor` in it replaced by a view of its own.

    An op's arguments are a tuple of tensors, numbers and lists of tensors almost always: those are mapped
    here directly (``tree_map`` costs more per op than the views themselves when the host is the bottleneck);
    any other container goes through ``tree_map``.
    """
    kind = type(x)
    if kind is tuple or kind is list:
        return kind([_own_views(v) for v in x])
    if kind is SegmentTensor:
        x = x.plain
        return x.view_as(x)
    if kind is dict:
        return {k: _own_views(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return _own_view(x)
    if isinstance(x, (tuple, list, dict)):  # a named tuple, an ordered dict...
        return tree_map(_own_view, x)
    return x


def consumer_views(x: Any) -> Any:
    """A segment's input or output as a :class:`SegmentTensor` (every consuming op gets a view of its own).

    A leaf stays itself (NOTE [A view per consumer], rule 5).
    """
    if (
        isinstance(x, torch.Tensor)
        and x.requires_grad
        and type(x) is torch.Tensor
        and x.grad_fn is not None
        and not torch.compiler.is_compiling()
    ):
        segment_tensor = x.as_subclass(SegmentTensor)
        segment_tensor.plain = x
        return segment_tensor
    return x


def plain(x: Any) -> Any:
    """``x`` as a plain tensor if it is a :class:`SegmentTensor` (compiled code cannot take the subclass)."""
    return x.plain if isinstance(x, SegmentTensor) else x


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
