"""What the planner and the router ask about checkpointed autograd nodes: segments, held bytes, checkpoint kind."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import _compat
from .._compat import TorchPlaceholder, saved_attrs
from ._placeholder import Placeholder
from ._registry import SegmentRegistry, merged_ranges, none_live, others_have_segments, this_thread


def _saved_data(node: Any) -> list[Any]:
    """What a node's saved-tensor hooks packed for each of its saved tensors (``[]`` once the node is freed).

    Needs ``SavedTensor.data`` (``_compat.SAVED_DATA``).
    """
    items = _compat.saved_items(node)
    return [] if items is None else [None if s is None else _compat.saved_data(s) for s in items]


def _saved_by(node: Any) -> list[int]:
    """The bytes of the placeholders the forward hooks recorded for ``node`` by its sequence number, in this
    thread's live segments: what :func:`held_bytes` reads where torch has no ``SavedTensor.data``. (A node
    of a graph built in another thread reads none: the plan is the same but for the chunks' weights.)"""
    s = _compat.node_sequence_nr(node)
    return [b for f in this_thread().frames() for b in f.saved_by.get(s, ())]


def segments(nodes: Iterable[Any] | None = None) -> list[tuple[int, int]]:
    """The sequence-number ranges ``[first, end)`` of the live segments (their graphs not yet freed), sorted.

    For the planner: a node whose ``_sequence_nr()`` falls in a range belongs to that segment. Nested
    segments are reported as their outermost one.

    Args:
        nodes: the autograd nodes of the graph being planned: the answer is then the segments of the threads
            that recorded the segments among them (sequence numbers are per thread: NOTE [Segment registry],
            rule 3). ``None``: the calling thread's segments (right when the graph was built in it).
    """
    if nodes is None:
        return this_thread().ranges()
    if not _compat.SAVED_DATA:
        # the nodes cannot tell whose segments they are: this thread's while no other thread has any, else
        # none (the planner then plans as without segments, exact)
        return [] if others_have_segments() else this_thread().ranges()
    registries: dict[int, SegmentRegistry] = {}
    for node in nodes:
        for data in _saved_data(node):
            if isinstance(data, Placeholder):
                registries.setdefault(id(data.registry), data.registry)
    return merged_ranges(registries.values())


def maybe_live() -> bool:
    """Whether a ``gradroute.checkpoint`` segment may be alive in this process (False: none is, so no graph
    holds a placeholder to unpack; the router then skips what only those unpacks need)."""
    return not none_live()


def held_bytes(node: Any) -> int:
    """Bytes of the tensors a node's saved ``gradroute.checkpoint`` placeholders stand for (0 for other nodes).

    For the planner: what a recomputation of the node's segment keeps alive for it until the node is freed.
    """
    if not _compat.SAVED_DATA:
        return sum(_saved_by(node))
    return sum(d.nbytes for d in _saved_data(node) if isinstance(d, Placeholder))


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
        ``use_reentrant=True``), or ``None``. Without ``SavedTensor.data`` (see ``gradroute._compat``),
        nodes of torch's checkpoint report ``None``.
    """
    names = saved_attrs(node)
    if not names:
        return None
    if "_raw_saved_tensors" in names and node.name() == "CheckpointFunctionBackward":
        return "reentrant"
    if not _compat.SAVED_DATA:
        if not _saved_by(node):
            return None
        items = _compat.saved_items(node) or []  # the placeholders' hooks are set: the probe changes nothing
        return "gradroute" if any(_compat.saved_state(i) == "live" for i in items if i is not None) else None
    for data in _saved_data(node):
        if isinstance(data, Placeholder):
            return "gradroute"
        if TorchPlaceholder is not None and isinstance(data, TorchPlaceholder):
            return "torch"
    return None
