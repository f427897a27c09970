"""Activation checkpointing whose recomputation is shared by all engine calls of one routed backward.

:func:`checkpoint` is a drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``.
Outside a routed backward it behaves like it: a segment is recomputed once per engine call (graph task) that
needs it, and every recomputed tensor is dropped as soon as it has been handed to the backward. Inside
:meth:`gradroute.Router.backward` / :meth:`gradroute.Router.grads`, which run several engine calls through the
same nodes, a segment is recomputed once per router call: the first engine call that needs it recomputes it
and every later call is served the same tensors. A recomputed tensor is dropped when the autograd node that
saved it is freed (its last engine call runs without ``retain_graph``), and whatever is left when the router
call returns is dropped then.

Memory: kept between the first and the last engine call through a segment, the recomputed tensors would
pile up if one pass went through a whole shared region before the next pass started. So the planner
interleaves the passes chunk by chunk (``_plan``: the text-encoder pass through the top chunk of segment k
with retain, then the UNet pass through it, freeing it, then the next chunk, ..., then segment k-1): a
segment's recomputation is freed as the passes go down it, and a retaining call holds about one chunk's
worth of activations that a plain backward would already have freed. A chunk is at least ``_plan._CHUNK``
nodes and ends at a clean line: one that no tensor crosses with consumers on both sides (between two
layers of a block, not inside a residual block). That needs cuts, and a ``GradientEdge`` cut captures the
sum of everything flowing into a node input: so every edge into and out of a segment gets an autograd node of
its own, a view per consuming op of each input and of each output (:class:`_SegmentTensor`), and the
segment's nodes are recognised by their sequence numbers (:func:`segments`). Inside a chunk, the first call
keeps what the next needs, except what is cheap to make again: a saved tensor that pointwise ops and views
made from other saved tensors (a SiLU before a convolution, the GELU and gated product of a feed-forward)
is dropped as soon as a call has used it and made again from those for the next (:class:`_Recipes`). What
stays above a plain backward's peak is then what matrix products, convolutions, norms and attention made in
one chunk, and the second cotangent: at every cut, both passes' gradients are alive (SD-1.5 at 512 px with
cut points, traced: 1.01-1.02×; sd-tiny: 1.09×).

A tensor that plain, un-checkpointed code hands to ops on both sides of a segment still has one node for
both; the planner then has to put the segments in between into one call. diffusers' ``UNet2DConditionModel``
is such a case: its skip connections leave from un-checkpointed ops (downsamplers, the transformer models'
residual adds), so with its own switch one retaining call would recompute most of the UNet and keep it all
for the other pass (SD-1.5 at 512 px, batch 8: 2.6× the summed backward's peak, traced on the ``meta``
device). The planner sees it coming (``_plan._unshared``: the recomputed bytes that shared segments would hold
at once, against the largest segment's) and then plans as for torch's checkpoint: no cuts inside segments,
each segment recomputed once per engine call and every recomputed tensor dropped once used (1.01× there,
torch's own checkpoint routed: 1.06×), at torch's cost in time (a second recomputation). The plan says so in
a note. :func:`cut_points` on the UNet blocks' submodules gives the consumers of their outputs views of their
own: the passes then interleave layer by layer and share one recomputation (1.01-1.02×).
:func:`checkpoint_modules` on whole blocks (``*unet.down_blocks, unet.mid_block, *unet.up_blocks``) makes
the block outputs segment outputs: the calls interleave too and each block is recomputed once (a block is
more to hold than a layer).

A frame (one call of :func:`checkpoint`) holds its segment's inputs for the recomputation; nothing else
holds the frame but the segment's nodes, so the inputs go as soon as the segment's nodes are freed by their
last call.

How it works (like torch's non-reentrant version, ``torch/utils/checkpoint.py``): the forward runs under
``torch.autograd.graph.saved_tensors_hooks`` whose pack hook saves a small :class:`_Holder` instead of the
tensor. The first unpack of a holder for a given key recomputes the segment's forward (RNG state of the CPU
and of the inputs' device, and autocast state, replayed) and stores each recomputed saved tensor in its
holder under that key. The key is the routed backward in progress (``_session.current()``), else the
``torch.utils.checkpoint.GraphExecGroup`` in effect, else the engine's graph task, exactly as torch does.

Using it with the two stacks of a Stable Diffusion fine-tune (checked against diffusers 0.42 and
transformers 5.24)::

    unet.enable_gradient_checkpointing(gradient_checkpointing_func=gradroute.checkpoint)  # diffusers
    text_encoder._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=gradroute.checkpoint)

diffusers' ``ModelMixin.enable_gradient_checkpointing`` takes the function directly and calls it as
``fn(module, *args)``. transformers' ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``
only forward keyword arguments to ``torch.utils.checkpoint.checkpoint``; the function itself is set by
``PreTrainedModel._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=...)``, which those
call (``GradientCheckpointingLayer`` then calls ``fn(functools.partial(forward, layer, **kwargs), *args)``).
Call ``text_encoder.gradient_checkpointing_enable()`` first if you also want its side effects (input
embeddings made to require grad), then ``_set_gradient_checkpointing`` to swap the function.

Plain ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` also works with the router, exact, but
recomputes each segment once per engine call that enters it. ``use_reentrant=True`` does not: its backward
refuses to run under ``torch.autograd.grad`` or ``backward(inputs=...)``, which every routed engine call uses,
and the parameters inside its segments are not in the autograd graph the router plans on.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointError,
    _get_autocast_kwargs,
    _get_device_module,
    _infer_device_type,
    get_device_states,
    noop_context_fn,
    set_device_states,
)

from . import _session
from ._graph import saved_attrs

# torch's non-reentrant checkpoint saves these in its segments' nodes (private; absent in some versions)
_TorchHolder: type | None = getattr(torch.utils.checkpoint, "_Holder", None)
__all__ = ["checkpoint", "checkpoint_kind", "checkpoint_modules", "cut_points"]

_DETERMINISM = ("default", "none")


class _Holder:
    """What the graph saves in place of a tensor of a checkpointed segment.

    ``values[key]`` is the recomputed tensor for one routed backward / graph task; ``None`` once a plain
    backward has consumed it. Everything goes when the autograd node that saved the holder is freed.
    """

    __slots__ = ("__weakref__", "nbytes", "recipe", "values")

    def __init__(self, nbytes: int) -> None:
        self.values: dict[Any, torch.Tensor | None] = {}
        self.nbytes = nbytes  # of the tensor it stands for (for the planner)
        # how a shared recomputation can make the tensor again from other holders' (see _Recipes)
        self.recipe: _Made | None = None

    def get(self, key: Any) -> torch.Tensor | None:
        """The tensor for ``key``; made again from its recipe if it was dropped after an earlier call used it."""
        x = self.values.get(key)
        if x is _DROPPED:
            if self.recipe is None:  # unreachable: only holders with a recipe drop their tensor
                raise CheckpointError("gradroute.checkpoint: a dropped saved tensor has no recipe (internal error)")
            with _no_autocast():  # the ops were recorded below autocast, on tensors it had already cast
                return self.recipe.make(key)
        return x


#: a holder's value once an engine call has used it and it can be made again (its recipe) for the next one
_DROPPED: Any = object()


class _Recipes(TorchDispatchMode):
    """During a shared recomputation: which saved tensors cheap ops make from other saved tensors.

    Several engine calls go through a shared segment, and the first one must keep every recomputed tensor
    for the next. A tensor that pointwise ops, dtype casts and views made from other saved tensors (SiLU of a
    norm's output cast by autocast for a convolution, GELU and the gated product in a feed-forward, flattened
    for the next linear)
    is cheap to make again: its holder keeps the ops instead (a :class:`_Made`), and the tensor is dropped as
    soon as each call has used it, as a plain backward would drop it. What the first call then keeps beyond a
    plain backward is what matrix products, convolutions, norms and attention made. Random ops and in-place
    ops are not recipes, nor is a tensor modified in place after it was made. Tensors are matched by their
    data (storage, offset, shape, strides, dtype), not by object: autograd hands views on as new objects.
    The price is a Python dispatch mode during shared recomputations (SD-1.5 on this project's CPU, shapes
    only: 0.09 s more host time in a 1.2 s routed backward) and the cheap ops run once more per call; so only
    segments that save ``PlanOptions.recipes_min_bytes`` or more get recipes (sd-tiny's do not: they cost it 6% of a
    step and saved nothing).
    """

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[tuple[Any, ...], tuple[Any, Any, Any, _Arg]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            type(out) is torch.Tensor
            and _cheap(func)
            and not any(map(_tensor_list, args))
            and (func is not _TO_COPY or args[0].device == out.device)  # a cast, not a transfer
        ):
            data = _data(out)
            known = self.made.get(data)
            if known is None or known[3].ref.expired():  # else a view of the same data (detach): keep the first
                # weak: the forward's temporaries still go (0-d ones, Python numbers the op wrapped, are kept)
                args, kwargs = _flat_map(_arg, args, kwargs)
                self.made[data] = (func, args, kwargs, _Arg(out))
        return out

    def recipe(self, x: torch.Tensor, packed: dict[tuple[Any, ...], _Holder]) -> Any:
        """How to make ``x`` again from the holders in ``packed`` (a :class:`_Made`), and the (holder, version)
        pairs to check at the end of the recomputation (``None``: ``x``'s own holder); or None."""
        entry = self.made.get(_data(x))
        if entry is None or entry[3].ref.expired():  # none, or a freed tensor's whose storage was reused
            return None
        versions: list[tuple[_Holder | None, int]] = [(None, entry[3].version)]
        made = self._build(entry, packed, versions, 0)
        return None if made is None else (made, versions)

    def _build(self, entry: Any, packed: Any, versions: Any, depth: int) -> _Made | None:
        func, args, kwargs, _ = entry
        ok = True

        def resolve(a: Any) -> Any:
            nonlocal ok
            if not isinstance(a, _Arg) or not ok:
                return a
            if a.ref.expired():
                ok = False
                return None
            h = packed.get(a.data)
            if h is not None:
                versions.append((h, a.version))
                return h
            inner = self.made.get(a.data)  # made by cheap ops from saved tensors, itself not saved
            if depth < _DEPTH and inner is not None and inner[3].version == a.version:
                got = self._build(inner, packed, versions, depth + 1)
                if got is not None:
                    return got
            ok = False
            return None

        args, kwargs = _flat_map(resolve, args, kwargs)
        return _Made(func, args, kwargs) if ok else None


_DEPTH = 4  # cheap ops in a row a recipe may chain
#: Segments that save less are recomputed without recipes: the dispatch mode costs host time on every op
#: (about 15 µs on this project's CPU), which a small segment's memory does not repay.
_no_autocast: Callable[[], Any] = getattr(torch._C, "_DisableAutocast", contextlib.nullcontext)


_TO_COPY = torch.ops.aten._to_copy.default


@functools.cache
def _cheap(func: Any) -> bool:
    """A functional pointwise op (not random), a dtype cast (autocast's) or a view op: cheap to run again."""
    schema = func._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags or func is torch.ops.aten.detach.default:
        return False  # (detach: the pack hooks' own)
    if func is _TO_COPY or torch.Tag.pointwise in func.tags:
        return True
    return len(schema.returns) == 1 and schema.returns[0].alias_info is not None


class _Made:
    """An op to run again on the tensors of holders (or of other ``_Made``) for one routed backward."""

    __slots__ = ("args", "func", "kwargs")

    def __init__(self, func: Any, args: Any, kwargs: Any) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def make(self, key: Any) -> torch.Tensor:
        args, kwargs = _flat_map(
            lambda a: a.get(key) if isinstance(a, _Holder) else a.make(key) if isinstance(a, _Made) else a,
            self.args,
            self.kwargs,
        )
        return self.func(*args, **kwargs)


def _tensor_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a)


def _flat_map(fn: Callable[[Any], Any], args: Any, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``fn`` on each argument (pointwise and view ops take their tensors as arguments, not in lists)."""
    return tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()}


def _data(t: torch.Tensor) -> tuple[Any, ...]:
    """What identifies a tensor's data while its storage lives (views are new objects at every level)."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _Arg:
    """A tensor a pointwise op took or made, weakly: its data, its storage, its version at the time."""

    __slots__ = ("data", "ref", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.data = _data(t)
        self.ref = StorageWeakRef(t.untyped_storage())
        self.version = t._version


def _arg(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and (a.dim() > 0 or a.requires_grad):
        return _Arg(a)
    return a  # not a tensor, or a 0-d one outside autograd: a Python number the op wrapped


def _version(h: _Holder, key: Any) -> int | None:
    x = h.values.get(key)
    return x._version if isinstance(x, torch.Tensor) else None


class _Stop(Exception):
    """Raised inside the recomputation once every saved tensor has been recomputed (early stop)."""


class _SaveInputs(torch.autograd.Function):
    """Saves the segment's tensor inputs through the enclosing saved-tensor hooks (a parent checkpoint's)."""

    @staticmethod
    def forward(ctx: Any, _dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.n = len(tensors)
        return _dummy.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:  # never runs: the output is unused
        return (None,) * (1 + ctx.n)


class _Frame:
    """One call of :func:`checkpoint`: how to recompute it and the holders it handed to the graph."""

    def __init__(self, replay: Callable[..., Any], early_stop: bool, meta: bool) -> None:
        self.replay = replay
        self.early_stop = early_stop
        self.meta = meta
        self.args: list[Any] = []
        self.tensor_pos: list[int] = []
        self.saver: Any = None  # the grad_fn of _SaveInputs, holding the tensor inputs
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.counter: dict[Any, int] = {}
        self.done: set[Any] = set()
        self.forward_done = False
        self.ignore_mismatch = False
        self.saved_bytes = 0  # what the segment's nodes saved in the forward
        self.compiled = False  # runs torch.compile'd code: no recipes (their dispatch mode would recompile it)

    def inputs(self) -> list[Any]:
        args = list(self.args)
        if self.saver is not None:
            for pos, t in zip(self.tensor_pos, self.saver.saved_tensors, strict=True):
                args[pos] = t
        return args

    def recompute(self, key: Any, shared: bool = False) -> None:
        """Recompute the segment's saved tensors for ``key``; ``shared``: for several engine calls (recipes)."""
        self.counter[key] = 0
        hooks = _RecomputeHooks(self, key, _Recipes() if shared else None)
        with hooks, torch.enable_grad(), contextlib.suppress(_Stop):
            if hooks.recipes is None:
                self.replay(*self.inputs())
            else:
                with hooks.recipes:
                    self.replay(*self.inputs())
        self.done.add(key)
        self._check(key)
        for h, made, seen in hooks.pending:  # a recipe holds only if nothing it involves was modified in place
            if all(_version(g or h, key) == v for g, v in seen):
                h.recipe = made

    def forget(self, key: Any) -> None:
        """Drop everything recomputed for ``key`` (a routed backward that has returned)."""
        for ref in self.holders:
            h = ref()
            if h is not None:
                h.values.pop(key, None)
        self.done.discard(key)
        self.counter.pop(key, None)

    def _check(self, key: Any) -> None:
        if self.ignore_mismatch:
            return
        if self.counter[key] != len(self.holders):
            raise CheckpointError(
                "gradroute.checkpoint: a different number of tensors was saved during the original forward "
                f"({len(self.holders)}) and the recomputation ({self.counter[key]}); the checkpointed "
                "function must run the same operations when it is recomputed"
            )
        if not self.meta:
            return
        for i, ref in enumerate(self.holders):
            h = ref()
            if h is None:
                continue
            x = h.values.get(key)
            if x is not None and (x.shape, x.dtype, x.device) != self.metas[i]:
                raise CheckpointError(
                    f"gradroute.checkpoint: recomputed saved tensor {i} has shape/dtype/device "
                    f"{(tuple(x.shape), x.dtype, x.device)} but the original forward saved {self.metas[i]}"
                )


class _RecomputeHooks(torch.autograd.graph.saved_tensors_hooks):
    """During the recomputation: file each saved tensor into the holder of the same rank."""

    def __init__(self, frame: _Frame, key: Any, recipes: _Recipes | None) -> None:
        self.recipes = recipes
        # No tensor of the recomputed graph is held here (only holders, whose values are detached): that graph's
        # nodes hold this pack hook, and such a tensor would close a cycle through C++ the collector cannot see.
        self.pending = pending = list[tuple[_Holder, _Made, list[tuple[_Holder | None, int]]]]()
        packed: dict[tuple[Any, ...], _Holder] = {}

        def pack(x: torch.Tensor) -> torch.Tensor:
            x = x.detach() if x.requires_grad else x
            i = frame.counter[key]
            frame.counter[key] = i + 1
            if i >= len(frame.holders):
                if not frame.forward_done:  # a backward inside the checkpointed function, during its forward
                    frame.ignore_mismatch = True
                    return x
                raise CheckpointError(
                    "gradroute.checkpoint: the recomputation saved more tensors than the original forward"
                )
            h = frame.holders[i]()
            if h is not None:  # None: the node that saved it is already freed
                h.values[key] = x
                h.recipe = None
                if recipes is not None:
                    got = recipes.recipe(x, packed)
                    if got is not None:
                        pending.append((h, *got))
                    packed[_data(x)] = h
            if frame.early_stop and i + 1 == len(frame.holders):
                raise _Stop
            return x

        super().__init__(pack, _identity)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _key() -> tuple[Any, bool]:
    """The recomputation key for the unpack in progress, and whether it is a routed backward."""
    session = _session.current()
    if session is not None:
        return session, True
    get_group = getattr(torch._C, "_get_graph_exec_group", None)
    group = get_group() if get_group is not None else None
    if group is not None:
        return group, False
    gid = torch._C._current_graph_task_id()
    if gid == -1:  # unpacked outside any backward (e.g. ``grad_fn._saved_self``)
        return uuid.uuid4().int, False
    return gid, False


def _forgetter(frame: _Frame, key: Any) -> Callable[[], None]:
    """``frame.forget(key)``, without keeping the frame alive: a frame holds its segment's inputs, which
    must go as soon as the segment's nodes are freed, not when the router call returns."""
    ref = weakref.ref(frame)

    def forget() -> None:
        f = ref()
        if f is not None:
            f.forget(key)

    return forget


class _ForwardHooks(torch.autograd.graph.saved_tensors_hooks):
    """During the original forward: save holders, not tensors."""

    def __init__(self, frame: _Frame) -> None:
        def pack(x: torch.Tensor) -> _Holder:
            h = _Holder(x.numel() * x.element_size())
            frame.saved_bytes += h.nbytes
            frame.holders.append(weakref.ref(h))
            if frame.meta:
                frame.metas.append((x.shape, x.dtype, x.device))
            return h

        def unpack(h: _Holder) -> torch.Tensor:
            key, routed = _key()
            if routed and key.recompute_per_call and torch._C._current_autograd_node() in key.recompute_per_call:
                # the planner could not interleave the passes through this segment: one recomputation per
                # engine call, each tensor dropped once used and what is left at the end of the call, like torch
                session = key
                key, routed = (session, torch._C._current_graph_task_id()), False
                if key not in frame.done:
                    frame.recompute(key)
                    forget = _forgetter(frame, key)
                    session.on_exit.append(forget)
                    torch.autograd.Variable._execution_engine.queue_callback(forget)
            elif key not in frame.done:
                recipes = routed and not frame.compiled and frame.saved_bytes >= key.recipes_min_bytes
                frame.recompute(key, shared=recipes)
                if routed:
                    key.on_exit.append(_forgetter(frame, key))
            if key not in h.values:
                raise CheckpointError(
                    "gradroute.checkpoint: a saved tensor was not recomputed (internal error, please report)"
                )
            x = h.get(key)
            if x is None:
                raise CheckpointError(
                    "gradroute.checkpoint: a saved tensor was unpacked twice in one backward; if you read "
                    "`ctx.saved_tensors` in a custom Function's backward, read it once"
                )
            if not routed:  # like torch: a plain backward uses each recomputed tensor once
                h.values[key] = None
            elif h.recipe is not None:  # made again for the next engine call that needs it
                h.values[key] = _DROPPED
            return x

        super().__init__(pack, unpack)


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them once per routed backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``, with the
    same keyword arguments. Outside :meth:`gradroute.Router.backward` / :meth:`~gradroute.Router.grads` it
    behaves the same (one recomputation per backward call). Inside one, all engine calls of the router call
    share one recomputation of the segment; each recomputed tensor is freed with the autograd node that
    saved it, at the latest when the router call returns; the router interleaves its calls chunk by chunk so
    that a recomputation is freed as the passes go down the segment (see the module notes on memory). The
    tensors it takes and returns hand every op that consumes them a view of their own (for the planner's
    cuts).

    With ``torch.compile``: traced inside a compiled model, it is ``torch.utils.checkpoint.checkpoint``
    (which the compiler knows; each engine call then recomputes, as with torch's). A compiled module or
    function as ``fn`` (or one inside it) works: it gets plain tensors, and is recomputed once per routed
    backward but without recipes. Routed calls retain graphs, so compiled backwards need
    ``torch._functorch.config.donated_buffer = False`` (see examples/README.md).

    Args:
        fn: the segment to checkpoint.
        *args: its positional arguments; tensors among them are kept for the recomputation.
        use_reentrant: ``None`` or ``False`` (accepted for compatibility with callers that pass it).
        preserve_rng_state: replay the CPU and device RNG state in the recomputation (dropout).
        context_fn: returns two context managers, entered around the forward and around the recomputation.
        determinism_check: ``"default"`` compares shape, dtype and device of every recomputed saved tensor
            with the original; ``"none"`` skips that.
        debug: not supported (``True`` raises); use ``torch.utils.checkpoint.checkpoint(debug=True)``.
        early_stop: stop the recomputation once every saved tensor has been recomputed.
        **kwargs: keyword arguments of ``fn`` (kept alive until the graph is freed, not saved).

    Returns:
        What ``fn`` returns.

    Raises:
        ValueError: ``use_reentrant=True``, ``debug=True`` or an unknown ``determinism_check``.

    Example:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> router = gradroute.Router(tenc=tenc, unet=unet)
        >>> x, target, mask = torch.randn(8, 4), torch.randn(8, 4), torch.rand(8, 4) > 0.5
        >>> pred = gradroute.checkpoint(unet, tenc(x))
        >>> loss = torch.nn.functional.mse_loss(pred, target, reduction="none")
        >>> router.backward(tenc=loss.mean(), unet=(loss * mask).mean())  # unet recomputed once, not twice
        >>> unet[0].weight.grad.shape
        torch.Size([4, 4])
    """
    if use_reentrant:
        raise ValueError(
            "gradroute.checkpoint is the non-reentrant kind: `use_reentrant` must be False or None, got "
            f"{use_reentrant!r}"
        )
    if debug:
        raise ValueError(
            "`debug=True` is not supported by gradroute.checkpoint; debug with "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False, debug=True)"
        )
    if determinism_check not in _DETERMINISM:
        raise ValueError(f"`determinism_check` must be one of {list(_DETERMINISM)}, got {determinism_check!r}")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():  # traced by torch.compile: torch's checkpoint, which it knows how to trace
        options: dict[str, Any] = {} if context_fn is noop_context_fn else {"context_fn": context_fn}
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **options, **kwargs
        )

    device_type = _infer_device_type(*args)
    device_module = _get_device_module(device_type)
    device_autocast, cpu_autocast = _get_autocast_kwargs(device_type=device_type)
    cpu_state: torch.Tensor | None = None
    devices: list[int] = []
    device_states: list[torch.Tensor] = []
    had_device = bool(getattr(device_module, "_initialized", False))
    if preserve_rng_state:
        cpu_state = torch.get_rng_state()
        if had_device:
            devices, device_states = get_device_states(*args)
    forward_context, recompute_context = context_fn()

    def replay(*inputs: Any) -> None:
        with torch.random.fork_rng(devices=devices, enabled=preserve_rng_state, device_type=device_type):
            if cpu_state is not None:
                torch.set_rng_state(cpu_state)
                if had_device:
                    set_device_states(devices, device_states, device_type=device_type)
            device_ac = (
                torch.amp.autocast(device_type=device_type, **device_autocast)
                if torch.amp.is_autocast_available(device_type)
                else contextlib.nullcontext()
            )
            with device_ac, torch.amp.autocast("cpu", **cpu_autocast), recompute_context:
                fn(*inputs, **kwargs)

    # Routed passes are interleaved chunk by chunk (see _plan): the segment's autograd nodes are the
    # ones created between two sequence numbers, and every edge into or out of the segment gets a node of its
    # own (a view per consuming op of each input and of each output, see _SegmentTensor), so that the
    # gradient crossing one edge can be cut apart from the others flowing into the same tensor.
    start = _get_sequence_nr()
    # a compiled function cannot take the views' subclass (and is one autograd node: one edge per input anyway)
    compiled = _compiled(fn)
    args, kwargs = tree_map(_plain if compiled else _consumer_views, (args, kwargs))
    frame = _Frame(replay, early_stop, determinism_check == "default")
    frame.compiled = compiled or _compiled(fn, inside=True)
    frame.args = list(args)
    tensors = []
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            frame.tensor_pos.append(pos)
            frame.args[pos] = None
            tensors.append(a)
    if tensors:
        # the dummy makes the saver an autograd node even when no input requires grad
        dummy = torch.empty(0, requires_grad=True)
        frame.saver = _SaveInputs.apply(dummy, *tensors).grad_fn
    with _ForwardHooks(frame), forward_context:
        out = fn(*args, **kwargs)
    frame.forward_done = True
    _record_segment(start, _get_sequence_nr(), frame)
    out = tree_map(_consumer_views, out)
    if preserve_rng_state and not had_device and getattr(device_module, "_initialized", False):
        raise RuntimeError(
            "gradroute.checkpoint: the device was initialized inside the checkpointed function, so its RNG "
            "state could not be saved; initialize it (e.g. torch.cuda.init()) before the forward"
        )
    return out


def checkpoint_modules(*modules: torch.nn.Module) -> None:
    """Run each module's whole forward under :func:`checkpoint`, one segment per module.

    Coarser than a library's own switch (which checkpoints the layers inside a block), but every tensor
    that leaves a segment then hands each consumer a view of its own: the router can cut and interleave its
    calls between the segments even where a block's outputs feed skip connections (diffusers' UNet blocks),
    so each shared recomputation is freed before the next is made. Module hooks run outside the segment.

    Args:
        *modules: the modules to checkpoint (e.g. ``*unet.down_blocks, unet.mid_block, *unet.up_blocks``).

    Raises:
        TypeError: an argument is not an ``nn.Module``.

    Example:
        >>> import torch, gradroute
        >>> body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        >>> gradroute.checkpoint_modules(body[0], body[2])
        >>> body(torch.randn(2, 4, requires_grad=True)).sum().backward()
    """
    for k, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"`modules` item {k} must be an nn.Module, got {type(m).__name__}")
    for m in modules:
        m.forward = functools.partial(checkpoint, m.forward)  # type: ignore[method-assign]


def cut_points(*modules: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Let the router cut its passes at these modules' outputs: every op that consumes one gets its own view.

    The router interleaves its passes through shared :func:`checkpoint` segments only where it can cut
    between them, and a tensor that plain code hands to ops on both sides of a segment leaves no cut there
    (a ``GradientEdge`` captures the sum of everything flowing into a node). diffusers' UNet with its own
    per-layer switch is such a case: its skip connections leave from un-checkpointed modules (downsamplers,
    transformer models). The planner then recomputes those segments once per pass, like torch, to keep the
    peak at the floor. Marking the UNet blocks' submodules as cut points gives each consumer of their outputs
    an autograd node of its own, so the passes interleave layer by layer and share one recomputation. Nothing
    changes outside a routed backward but one view per consuming op. Module forward hooks.

    Args:
        *modules: the modules whose outputs may be cut (e.g. every resnet, transformer model, down- and
            upsampler of ``unet.down_blocks``, ``unet.mid_block`` and ``unet.up_blocks``).

    Returns:
        The forward hooks' handles (``handle.remove()`` undoes it).

    Raises:
        TypeError: an argument is not an ``nn.Module``.

    Example:
        >>> import torch, gradroute
        >>> body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        >>> handles = gradroute.cut_points(body[0])
        >>> y = body[0](torch.randn(2, 4, requires_grad=True))
        >>> (y * 2 + y).sum().backward()  # two consumers of y, each through a view of its own
    """
    for k, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"`modules` item {k} must be an nn.Module, got {type(m).__name__}")
    return [m.register_forward_hook(_view_outputs) for m in modules]


def _view_outputs(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return tree_map(_consumer_views, output)


#: (first, end) autograd sequence numbers of every checkpointed segment whose graph may be alive, in order.
_SEGMENTS: list[tuple[int, int, weakref.ref[_Frame]]] = []
_PRUNE_AT = [64]  # prune the record when it grows past this (twice the live count after the last prune)


def _prune() -> list[tuple[int, int, weakref.ref[_Frame]]]:
    _SEGMENTS[:] = [(a, b, f) for a, b, f in _SEGMENTS if f() is not None]
    _PRUNE_AT[0] = max(64, 2 * len(_SEGMENTS))
    return _SEGMENTS


def _record_segment(first: int, end: int, frame: _Frame) -> None:
    """Remember a segment's sequence-number range while its graph lives (amortised pruning: forwards that
    are never routed, or whose plan comes from the cache, must not grow the record)."""
    _SEGMENTS.append((first, end, weakref.ref(frame)))
    if len(_SEGMENTS) > _PRUNE_AT[0]:
        _prune()


def segments() -> list[tuple[int, int]]:
    """The sequence-number ranges ``[first, end)`` of the live segments (their graphs not yet freed).

    For the planner: a node whose ``_sequence_nr()`` falls in a range belongs to that segment. Nested
    segments are reported as their outermost one.
    """
    live = _prune()
    out: list[tuple[int, int]] = []
    for a, b, _ in live:  # appended in forward order: a nested segment ends before its parent does
        while out and out[-1][0] >= a:
            out.pop()
        out.append((a, b))
    return sorted(out)


class _SegmentTensor(torch.Tensor):
    """A tensor a checkpointed segment took or returned: every op that consumes it consumes a view of its own.

    Each consumer then sends its gradient through its own autograd node, which the planner can cut apart
    from the others (a ``GradientEdge`` captures the sum flowing into a node input). The ops return plain
    tensors; attribute reads (``.shape``, ``.grad_fn``, ...) see the tensor itself.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func not in _ON_THE_TENSOR and getattr(func, "__name__", "") != "__get__" and torch.is_grad_enabled():
                args, kwargs = tree_map(_own_view, (args, kwargs))
            return func(*args, **kwargs)


# methods that act on the tensor itself, not ops that consume it (a hook on a fresh view would never fire)
_ON_THE_TENSOR = frozenset(
    {
        torch.Tensor.register_hook,
        torch.Tensor.retain_grad,
        torch.Tensor.register_post_accumulate_grad_hook,
        torch.Tensor.requires_grad_,
    }
)


def _own_view(x: Any) -> Any:
    return x.view_as(x) if isinstance(x, _SegmentTensor) else x


def _compiled(fn: Any, inside: bool = False) -> bool:
    """Whether ``fn`` is code compiled by ``torch.compile`` (a compiled module or function, or a module whose
    ``compile()`` was called), looking through ``functools.partial`` and bound methods; ``inside``: or a
    module with such a submodule."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__self__", fn)
    if inside and isinstance(fn, torch.nn.Module):
        return any(_compiled(m) for m in fn.modules())
    return (
        hasattr(fn, "_torchdynamo_orig_callable")
        or isinstance(fn, torch._dynamo.eval_frame.OptimizedModule)
        or getattr(fn, "_compiled_call_impl", None) is not None
    )


def _plain(x: Any) -> Any:
    return x.as_subclass(torch.Tensor) if isinstance(x, _SegmentTensor) else x


def _consumer_views(x: Any) -> Any:
    """A segment's input or output, as a :class:`_SegmentTensor` (every consuming op gets a view of its own)."""
    if (
        isinstance(x, torch.Tensor)
        and x.requires_grad
        and type(x) is torch.Tensor
        and not torch.compiler.is_compiling()
    ):
        return x.as_subclass(_SegmentTensor)
    return x


def _packed(node: Any) -> list[Any]:
    """What a node's saved-tensor hooks packed for each of its saved tensors (``[]`` once the node is freed)."""
    out: list[Any] = []
    for name in saved_attrs(node):
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed by an earlier backward
            return []
        out.extend(s.data if s is not None else None for s in (raw if isinstance(raw, (list, tuple)) else (raw,)))
    return out


def held_bytes(node: Any) -> int:
    """Bytes of the tensors a node's saved ``gradroute.checkpoint`` holders stand for (0 for other nodes).

    For the planner: what a recomputation of the node's segment keeps alive for it until the node is freed.
    """
    return sum(d.nbytes for d in _packed(node) if isinstance(d, _Holder))


def checkpoint_kind(node: Any) -> str | None:
    """Which checkpoint, if any, manages the saved tensors of an autograd node.

    For the planner: a graph whose nodes report ``"torch"`` would recompute those segments once per
    engine call that enters them, where ``gradroute.checkpoint`` shares one recomputation.

    Args:
        node: an autograd node (``tensor.grad_fn`` or a ``next_functions`` entry). The caller must hold a
            reference to it while this runs.

    Returns:
        ``"gradroute"`` (saved by :func:`checkpoint`), ``"torch"`` (saved by
        ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``), ``"reentrant"`` (the node of
        ``use_reentrant=True``), or ``None``.
    """
    names = saved_attrs(node)
    if not names:
        return None
    if "_raw_saved_tensors" in names and node.name() == "CheckpointFunctionBackward":
        return "reentrant"
    for data in _packed(node):
        if isinstance(data, _Holder):
            return "gradroute"
        if _TorchHolder is not None and isinstance(data, _TorchHolder):
            return "torch"
    return None
