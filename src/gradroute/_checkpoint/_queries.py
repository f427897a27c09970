"""What the planner and the router ask about checkpointed autograd nodes: segments, held bytes, checkpoint kind."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._graph import saved_attrs
from ._placeholder import Placeholder
from ._registry import SegmentRegistry, merged_ranges, this_thread
from ._torch_private import TorchPlaceholder


def _saved_data(node: Any) -> list[Any]:
    """What a node's saved-tensor hooks packed for each of its saved tensors (``[]`` once the node is freed)."""
    out: list[Any] = []
    for name in saved_attrs(node):
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed by an earlier backward
            return []
        out.extend(s.data if s is not None else None for s in (raw if isinstance(raw, (list, tuple)) else (raw,)))
    return out


def segments(nodes: Iterable[Any] | None = None) -> list[tuple[int, int]]:
    """The sequence-number ranges ``[first, end)`` of the live segments (their graphs not yet freed), sorted.

    For the planner: a node whose ``_sequence_nr()`` falls in a range belongs to that segment. Nested
    segments are reported as their outermost one.

    Args:
        nodes: the autograd nodes of the graph being planned: the answer is then the segments of the threads
            that recorded the segments among them (sequence numbers are per thread, see NOTE [Segment registry
            per thread]). ``None``: the calling thread's segments (right when the graph was built in it).
    """
    if nodes is None:
        return this_thread().ranges()
    registries: dict[int, SegmentRegistry] = {}
    for node in nodes:
        for data in _saved_data(node):
            if isinstance(data, Placeholder):
                registries.setdefault(id(data.registry), data.registry)
    return merged_ranges(registries.values())


def held_bytes(node: Any) -> int:
    """Bytes of the tensors a node's saved ``gradroute.checkpoint`` placeholders stand for (0 for other nodes).

    For the planner: what a recomputation of the node's segment keeps alive for it until the node is freed.
    """
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
        ``use_reentrant=True``), or ``None``.
    """
    names = saved_attrs(node)
    if not names:
        return None
    if "_raw_saved_tensors" in names and node.name() == "CheckpointFunctionBackward":
        return "reentrant"
    for data in _saved_data(node):
        if isinstance(data, Placeholder):
            return "gradroute"
        if TorchPlaceholder is not None and isinstance(data, TorchPlaceholder):
            return "torch"
    return None
