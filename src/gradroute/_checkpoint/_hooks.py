"""The saved-tensor hooks of a segment's original forward: save placeholders, and unpack in one of three modes.

NOTE [Recomputation keys]
A placeholder holds one recomputed tensor per key, so that two backwards running through one segment at once (two
threads, or a routed backward and a plain one) each get a recomputation of their own.

1. The key is the routed backward in progress (``_session.current()``: one ``Router.backward``/``Router.grads``
   call) when there is one, else the ``torch.utils.checkpoint.GraphExecGroup`` in effect, else the engine's
   graph task, exactly as torch keys its own checkpoint.
2. Shared (``_unpack_shared``), inside a routed backward: every engine call through the segment is served by
   one recomputation, kept until the node that saved each tensor is freed (its last call runs without
   ``retain_graph``); whatever is left is dropped when the routed backward returns. Tensors that cheap ops can
   remake are dropped after each use (NOTE [Remade tensors] in _remakes.py).
3. Per call (``_unpack_per_call``), inside a routed backward, for the nodes in ``Session.recompute_per_call``
   (NOTE [Shared or per-call recomputation] in _planner/per_call.py): one recomputation per engine call, each
   tensor dropped once used and what is left at the end of the call, like torch.
4. Plain (``_unpack_plain``), outside a routed backward: like torch's non-reentrant checkpoint, one
   recomputation per engine call (graph task) that needs the segment, each tensor dropped as soon as it has
   been handed to the backward.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _session
from .._compat import (
    CheckpointError,
    current_autograd_node,
    current_graph_exec_group,
    current_graph_task_id,
    next_sequence_nr,
    queue_engine_callback,
)
from ._advice import advise_cut_points
from ._frame import Frame
from ._placeholder import REMADE_ON_USE, Placeholder


class ForwardHooks(torch.autograd.graph.saved_tensors_hooks):
    """During the original forward: save placeholders, not tensors; unpack them by recomputing."""

    def __init__(self, frame: Frame) -> None:
        def pack(x: torch.Tensor) -> Placeholder:
            p = Placeholder(x.numel() * x.element_size(), frame.registry)
            frame.saved_bytes += p.nbytes
            # the node saving x was the last one made in this thread (for torch without SavedTensor.data)
            frame.saved_by.setdefault(next_sequence_nr() - 1, []).append(p.nbytes)
            frame.placeholders.append(weakref.ref(p))
            if frame.meta:
                frame.metas.append((x.shape, x.dtype, x.device))
            return p

        def unpack(p: Placeholder) -> torch.Tensor:
            session = _session.current()
            if session is None:
                return _unpack_plain(frame, p)
            if session.recompute_per_call and current_autograd_node() in session.recompute_per_call:
                return _unpack_per_call(frame, p, session)
            return _unpack_shared(frame, p, session)

        super().__init__(pack, unpack)


def _unpack_shared(frame: Frame, p: Placeholder, session: Any) -> torch.Tensor:
    """One recomputation for all engine calls of the routed backward ``session``."""
    if session not in frame.done:
        remakes = frame.saved_bytes >= session.remake_min_bytes and not frame.runs_compiled()
        frame.recompute(session, shared=remakes)
        session.on_exit.append(_forgetter(frame, session))
    x = _take(p, session)
    if p.remake is not None:  # made again for the next engine call that needs it
        p.values[session] = REMADE_ON_USE
    return x


def _unpack_per_call(frame: Frame, p: Placeholder, session: Any) -> torch.Tensor:
    """One recomputation per engine call of the routed backward ``session``, each tensor dropped once used."""
    key = (session, current_graph_task_id())
    if key not in frame.done:
        advise_cut_points(frame.fn, session)
        frame.recompute(key)
        forget = _forgetter(frame, key)
        session.on_exit.append(forget)
        queue_engine_callback(forget)
    x = _take(p, key)
    p.values[key] = None
    return x


def _unpack_plain(frame: Frame, p: Placeholder) -> torch.Tensor:
    """Outside a routed backward, like torch: one recomputation per engine call, each tensor used once."""
    key = current_graph_exec_group()
    if key is None:
        key = current_graph_task_id()
        if key == -1:  # unpacked outside any backward (e.g. ``grad_fn._saved_self``)
            key = uuid.uuid4().int
    if key not in frame.done:
        frame.recompute(key)
    x = _take(p, key)
    p.values[key] = None
    return x


def _take(p: Placeholder, key: Any) -> torch.Tensor:
    """The recomputed tensor of ``p`` for ``key`` (remade if it was dropped)."""
    if key not in p.values:
        raise CheckpointError("gradroute.checkpoint: a saved tensor was not recomputed (internal error, please report)")
    x = p.get(key)
    if x is None:
        raise CheckpointError(
            "gradroute.checkpoint: a saved tensor was unpacked twice in one backward; if you read "
            "`ctx.saved_tensors` in a custom Function's backward, read it once"
        )
    return x


def _forgetter(frame: Frame, key: Any) -> Callable[[], None]:
    """``frame.forget(key)``, without keeping the frame alive (NOTE [Recomputation] in _frame.py, rule 3)."""
    ref = weakref.ref(frame)

    def forget() -> None:
        f = ref()
        if f is not None:
            f.forget(key)

    return forget
