"""The frame (one call of ``checkpoint``) and its recomputation.

NOTE [Recomputation]
A frame recomputes its segment like torch's non-reentrant checkpoint (``torch/utils/checkpoint.py``), and keeps its
inputs no longer than the segment's nodes live.

1. The first unpack of a placeholder for a given key (NOTE [Recomputation keys] in _hooks.py) replays the
   segment's forward, with the RNG state of the CPU and of the inputs' device and the autocast state of the
   original forward (the ``replay`` closure ``checkpoint`` made), under saved-tensor hooks whose pack hook
   files the k-th saved tensor into the k-th placeholder under that key: the replay saves what the forward
   saved, in the same order. With ``early_stop`` the replay stops once the last placeholder is filled.
2. A shared recomputation (``shared=True``) also records the cheap ops (NOTE [Remade tensors] in _remakes.py)
   and, at its end, keeps a remake only where no tensor it involves was modified in place after it was
   recorded: a remake must give the tensor the forward saved.
3. A frame holds its segment's inputs (through ``_SaveInputs``, so that an enclosing checkpoint's hooks save
   them in turn) and only weak references to the placeholders its forward saved. Nothing but the segment's
   nodes (the unpack hook's closure) holds the frame, so the inputs go as soon as those nodes are freed by
   their last engine call, not when the routed backward returns.
4. Nothing here holds a tensor of the recomputed graph: that graph's nodes hold the recomputation's pack hook,
   and such a tensor would close a cycle through C++ that the cycle collector cannot see.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._compat import CheckpointError
from ._placeholder import Placeholder, value_version
from ._remakes import DataKey, Pending, RemakeRecorder, data_key
from ._views import compiled


class _RecomputationComplete(Exception):
    """Raised inside the recomputation once every saved tensor has been recomputed (``early_stop``)."""


class SaveInputs(torch.autograd.Function):
    """Saves the segment's tensor inputs through the enclosing saved-tensor hooks (a parent checkpoint's)."""

    @staticmethod
    def forward(ctx: Any, _dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.n = len(tensors)
        return _dummy.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:  # never runs: the output is unused
        return (None,) * (1 + ctx.n)


class Frame:
    """One call of ``checkpoint``: how to recompute it and the placeholders it handed to the graph.

    Attributes:
        replay: runs the segment's forward again on its inputs (RNG and autocast state restored).
        early_stop: stop the replay once every placeholder has its tensor.
        meta: compare shape, dtype and device of the recomputed tensors with the original ones.
        args, tensor_pos, saver: the segment's positional arguments, tensors replaced by None at
            ``tensor_pos``, and the output of ``SaveInputs``, whose node holds those tensors (the output, not
            the node's Python object: in older torch releases, 2.5 and 2.6 among them, a custom Function's
            ``grad_fn`` object does not keep its node alive, and the node frees what it saved when its output
            goes).
        placeholders, metas: what the forward saved (weakly), and its shapes/dtypes/devices.
        counter: recomputation key -> saved tensors filed so far; ``done``: keys recomputed.
        forward_done: the original forward has returned; ``ignore_mismatch``: a backward ran inside it.
        saved_bytes: what the segment's nodes saved in the forward; ``saved_by``: the same per saving node,
            by its sequence number (``held_bytes`` on torch without ``SavedTensor.data``, see ``_queries``).
        fn, compiled: the segment's function; whether it runs torch.compile'd code (None: not looked up yet,
            see :meth:`runs_compiled`).
        registry: the segment registry of the thread that ran the forward.
    """

    def __init__(self, replay: Callable[..., Any], early_stop: bool, meta: bool, registry: Any) -> None:
        self.replay = replay
        self.early_stop = early_stop
        self.meta = meta
        self.registry = registry
        self.args: list[Any] = []
        self.tensor_pos: list[int] = []
        self.saver: torch.Tensor | None = None
        self.placeholders: list[weakref.ref[Placeholder]] = []
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.counter: dict[Any, int] = {}
        self.done: set[Any] = set()
        self.forward_done = False
        self.ignore_mismatch = False
        self.saved_bytes = 0
        self.saved_by: dict[int, list[int]] = {}
        self.fn: Any = None
        self.compiled: bool | None = False

    def runs_compiled(self) -> bool:
        """Whether the segment runs torch.compile'd code (then no remakes: their dispatch mode would recompile
        it). Looked up on first use: walking a module's submodules costs more than a small segment's forward,
        and only a recomputation large enough for remakes asks."""
        if self.compiled is None:
            self.compiled = compiled(self.fn, inside=True)
        return self.compiled

    def inputs(self) -> list[Any]:
        """The segment's positional arguments, tensors included."""
        args = list(self.args)
        if self.saver is not None:
            saved = self.saver.grad_fn.saved_tensors  # type: ignore[union-attr]
            for pos, t in zip(self.tensor_pos, saved, strict=True):
                args[pos] = t
        return args

    def recompute(self, key: Any, shared: bool = False) -> None:
        """Recompute the segment's saved tensors for ``key``; ``shared``: for several engine calls (remakes)."""
        self.counter[key] = 0
        hooks = _RecomputeHooks(self, key, RemakeRecorder() if shared else None)
        recording = hooks.recorder if hooks.recorder is not None else contextlib.nullcontext()
        with hooks, torch.enable_grad(), contextlib.suppress(_RecomputationComplete), recording:
            self.replay(*self.inputs())
        self.done.add(key)
        self._check(key)
        for p, remake, seen in hooks.pending:  # a remake holds only if nothing it involves was modified in place
            if all(value_version(q or p, key) == v for q, v in seen):
                p.remake = remake

    def forget(self, key: Any) -> None:
        """Drop everything recomputed for ``key`` (a routed backward that has returned, an engine call done)."""
        for ref in self.placeholders:
            p = ref()
            if p is not None:
                p.values.pop(key, None)
        self.done.discard(key)
        self.counter.pop(key, None)

    def _check(self, key: Any) -> None:
        if self.ignore_mismatch:
            return
        if self.counter[key] != len(self.placeholders):
            raise CheckpointError(
                "gradroute.checkpoint: a different number of tensors was saved during the original forward "
                f"({len(self.placeholders)}) and the recomputation ({self.counter[key]}); the checkpointed "
                "function must run the same operations when it is recomputed"
            )
        if not self.meta:
            return
        for i, ref in enumerate(self.placeholders):
            p = ref()
            x = None if p is None else p.values.get(key)
            if x is not None and (x.shape, x.dtype, x.device) != self.metas[i]:
                raise CheckpointError(
                    f"gradroute.checkpoint: recomputed saved tensor {i} has shape/dtype/device "
                    f"{(tuple(x.shape), x.dtype, x.device)} but the original forward saved {self.metas[i]}"
                )


class _RecomputeHooks(torch.autograd.graph.saved_tensors_hooks):
    """During the recomputation: file each saved tensor into the placeholder of the same rank."""

    def __init__(self, frame: Frame, key: Any, recorder: RemakeRecorder | None) -> None:
        self.recorder = recorder
        self.pending: list[Pending] = []  # placeholders only, no tensor (NOTE [Recomputation], rule 4)
        # a closure, not a bound method: the hooks object holds its pack hook, and a cycle through it would
        # keep the frame (and the segment's inputs) alive until the cycle collector runs
        super().__init__(_filer(frame, key, recorder, self.pending), _identity)


def _filer(
    frame: Frame, key: Any, recorder: RemakeRecorder | None, pending: list[Pending]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The recomputation's pack hook: the k-th saved tensor goes into the k-th placeholder, under ``key``."""
    saved: dict[DataKey, Placeholder] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        x = x.detach() if x.requires_grad else x
        i = frame.counter[key]
        frame.counter[key] = i + 1
        if i >= len(frame.placeholders):
            if not frame.forward_done:  # a backward inside the checkpointed function, during its forward
                frame.ignore_mismatch = True
                return x
            raise CheckpointError(
                "gradroute.checkpoint: the recomputation saved more tensors than the original forward"
            )
        p = frame.placeholders[i]()
        if p is not None:  # None: the node that saved it is already freed
            p.values[key] = x
            p.remake = None
            if recorder is not None:
                found = recorder.remake_of(x, saved)
                if found is not None:
                    pending.append((p, *found))
                saved[data_key(x)] = p
        if frame.early_stop and i + 1 == len(frame.placeholders):
            raise _RecomputationComplete
        return x

    return pack


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
