"""The segment registry: which autograd nodes belong to which live checkpointed segment, for the planner.

NOTE [Segment registry]
The planner must know which nodes of the graph it plans belong to which ``gradroute.checkpoint`` segment, to
cut shared segments into chunks and to weigh what a shared recomputation holds.

1. A segment's nodes are those created between two autograd sequence numbers: ``checkpoint`` reads the next
   number before and after the forward, and a node belongs to the segment whose range ``[first, end)`` holds
   its ``_sequence_nr()``. Nested segments are reported as their outermost one. Sequence numbers need no
   reference from a node to its segment, which torch does not offer.
2. A range is kept weakly, while its frame lives (the frame lives while the segment's nodes do); the record is
   pruned once it has grown past twice its live size since the last prune, so that forwards that are never
   routed (or whose plan comes from the cache) do not grow it.
3. Each thread records its segments in a registry of its own: sequence numbers are per thread, so one
   process-wide list would take a node of thread B for a member of thread A's segment. A registry is an
   object, not the thread's ident: idents are reused when a thread ends, while its segments may live on.
4. ``segments(nodes)`` answers with the registries of the placeholders those nodes saved (a placeholder knows
   its thread's registry); ``segments()`` with the calling thread's, right whenever the graph was built in the
   thread that plans it (the router's case).
5. If one graph holds segments of several threads whose ranges overlap, sequence numbers cannot tell them
   apart: ``segments`` reports none, and the planner plans as for a graph without segments (exact: each shared
   segment is still recomputed once per routed backward, only not interleaved chunk by chunk).
6. A torch without ``SavedTensor.data`` (``gradroute._compat``) does not show what a node saved:
   ``segments(nodes)`` then answers with the calling thread's registry while no other thread has live
   segments, and with none otherwise (rule 5's fallback).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

_MIN_PRUNE_AT = 64


class SegmentRegistry:
    """The sequence-number ranges of one thread's live checkpointed segments.

    Written by its own thread (:meth:`record`), read by any (the planner's); a lock keeps the two apart.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, weakref.ref[Any]]] = []
        self._prune_at = _MIN_PRUNE_AT  # twice the live count after the last prune, at least 64
        self._lock = threading.Lock()

    def record(self, first: int, end: int, frame: Any) -> None:
        """Remember a segment's range ``[first, end)`` while ``frame`` lives (amortised pruning)."""
        with self._lock:
            self._entries.append((first, end, weakref.ref(frame)))
            if len(self._entries) > self._prune_at:
                self._prune()

    def ranges(self) -> list[tuple[int, int]]:
        """The live segments' ranges, nested ones reported as their outermost one, sorted."""
        with self._lock:
            live = self._prune()
        out: list[tuple[int, int]] = []
        for a, b, _ in live:  # appended in forward order: a nested segment ends before its parent does
            while out and out[-1][0] >= a:
                out.pop()
            out.append((a, b))
        return sorted(out)

    def frames(self) -> list[Any]:
        """The live segments' frames, in forward order."""
        with self._lock:
            return [f for f in (ref() for _, _, ref in self._entries) if f is not None]

    def __len__(self) -> int:
        """How many ranges are recorded (live or not yet pruned)."""
        return len(self._entries)

    def any_live(self) -> bool:
        """Whether a recorded segment is still alive (the records of dead ones are dropped when one is found)."""
        if not self._entries:  # the usual case without segments: no lock
            return False
        with self._lock:
            return bool(self._prune())

    def _prune(self) -> list[tuple[int, int, weakref.ref[Any]]]:
        self._entries = [(a, b, f) for a, b, f in self._entries if f() is not None]
        self._prune_at = max(_MIN_PRUNE_AT, 2 * len(self._entries))
        return self._entries


_local = threading.local()
_all: weakref.WeakSet[SegmentRegistry] = weakref.WeakSet()  # every thread's, while its segments may live


def this_thread() -> SegmentRegistry:
    """The calling thread's registry (made on first use)."""
    registry: SegmentRegistry | None = getattr(_local, "registry", None)
    if registry is None:
        registry = _local.registry = SegmentRegistry()
        _all.add(registry)
    return registry


def others_have_segments() -> bool:
    """Whether another thread's registry holds live segments."""
    mine = this_thread()
    return any(r is not mine and r.ranges() for r in list(_all))


def none_live() -> bool:
    """Whether no thread has a live segment: then no ``gradroute.checkpoint`` placeholder is alive anywhere (a
    live frame's range stays recorded). Without records, no lock is taken."""
    return not _all or not any(r.any_live() for r in list(_all))  # (``not _all``: no thread ever made one)


def merged_ranges(registries: Iterable[SegmentRegistry]) -> list[tuple[int, int]]:
    """The ranges of all ``registries``, sorted; none if two registries' ranges overlap (NOTE [Segment
    registry], rule 5)."""
    out = sorted(r for registry in registries for r in registry.ranges())
    if any(b > c for (_, b), (c, _) in itertools.pairwise(out)):
        return []
    return out
