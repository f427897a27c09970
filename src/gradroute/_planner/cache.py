"""The plan cache: analyses by call shape and signature."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._options import PlanOptions
from .._types import Route
from .build import Planned


def call_shape(routes: Sequence[Route], *, merge_shared: bool, options: PlanOptions) -> tuple:
    """The key of a kind of router call (the glossary's *call shape*): ``backward`` (``merge_shared``) or ``grads``,
    the options, the group names and loss counts. The cache, a static graph's record and the measured choice keep
    their state per call shape."""
    return (merge_shared, options, tuple((r.name, len(r.losses)) for r in routes))


@dataclass(eq=False)
class _Entry:
    """One cached analysis: the signature it was made for, when it was last used, and the routed backwards in a
    row whose walk found this graph with the last walks' times in seconds (for the plan printout's note)."""

    signature: list
    planned: Planned
    used: int
    streak: int = 0
    walks: list[float] = field(default_factory=list)


class PlanCache:
    """The analyses of the last ``size`` graphs planned, by call shape (group names, loss counts, mode, options)
    and signature; reused for an equal graph.

    Reuse is safe because the routing is a function of the graph's signature alone (node classes, edges with
    their input slots, which leaves are which group parameters, where the losses enter): the walk that
    computes the signature runs on every call, only the analysis is skipped. Parameters are compared by
    identity; the router holds them, so their ids cannot be reused while the cache exists. (The analysis also
    reads the live ``gradroute.checkpoint`` segments, which show in the structure: a segment gives its outputs
    views of their own, so another segmentation is another signature. It reads the bytes a recomputation
    holds, which the signature does not record: a graph of equal structure with other tensor sizes gets the
    plan made for the first, exact, with the first's choice of which segments to recompute per call.)

    NOTE [Several graphs per call shape]
    1. A call shape can alternate between graphs (checkpointing switched on and off, an optional branch, a
       regulariser every other step): each graph keeps its own entry, up to ``size`` in all, the least recently
       used dropped first; with one entry per call shape, alternating graphs would be analysed on every call.
    2. A lookup compares the signatures of the call shape's entries, newest first; unequal ones usually differ
       in length, which list equality checks first.
    3. A cache is used by one thread at a time (the router holds a lock around planning), so it takes no lock.

    Args:
        size: the most analyses kept.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        # key -> entries, most recently used first
        self.entries: dict[tuple, list[_Entry]] = {}
        self.hits = 0
        self.misses = 0
        self._clock = 0
        self._marks: tuple[tuple, dict[int, int], list[torch.Tensor]] = ((), {}, [])
        self._last_walked: dict[tuple, _Entry] = {}

    def __len__(self) -> int:
        return sum(len(found) for found in self.entries.values())

    def lookup(self, key: tuple, signature: list) -> _Entry | None:
        """The entry of an equal graph of call shape ``key``, or None (counted)."""
        found = self.entries.get(key, [])
        for k, entry in enumerate(found):
            if entry.signature is signature or entry.signature == signature:
                self._clock += 1
                entry.used = self._clock
                if k:
                    found.insert(0, found.pop(k))
                self.hits += 1
                return entry
        self.misses += 1
        return None

    def store(self, key: tuple, signature: list, planned: Planned) -> _Entry:
        """Keep ``planned`` for graphs of call shape ``key`` and this signature (dropping the least recently used
        entry when full)."""
        if len(self) >= self.size:
            old_key, old = min(((k, e) for k, found in self.entries.items() for e in found), key=lambda ke: ke[1].used)
            self.entries[old_key].remove(old)
            if not self.entries[old_key]:
                del self.entries[old_key]
            if self._last_walked.get(old_key) is old:
                del self._last_walked[old_key]
        self._clock += 1
        entry = _Entry(signature, planned, self._clock)
        self.entries.setdefault(key, []).insert(0, entry)
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self._last_walked.clear()

    def walked(self, key: tuple, entry: _Entry, seconds: float) -> None:
        """A routed backward of call shape ``key`` walked ``entry``'s graph in ``seconds`` (``walk_note``)."""
        entry.streak = entry.streak + 1 if self._last_walked.get(key) is entry else 1
        self._last_walked[key] = entry
        entry.walks.append(seconds)
        del entry.walks[:-_WALKS_KEPT]

    def walk_note(self, planned: Planned, nodes: int) -> str | None:
        """A line for the plan printout where routed backwards walked the same graph ``_STREAK`` or more times in a
        row: the walk's time, and the switch that skips it."""
        entry = next((e for found in self.entries.values() for e in found if e.planned is planned), None)
        if entry is None or entry.streak < _STREAK:
            return None
        ms = statistics.median(entry.walks) * 1e3
        return (
            f"walk: the last {entry.streak} routed backwards had this graph; walking its {nodes} nodes took "
            f"{ms:.2f} ms each (median of the last {len(entry.walks)}). If it is the same on every step, "
            'Router(static_graph=True) follows a few paths instead (README, "Static graphs")'
        )

    def marks(self, routes: Sequence[Route]) -> tuple[dict[int, int], list[torch.Tensor]]:
        """:func:`param_marks` of ``routes`` and the parameters by mark (mark ``m`` at ``m - 1``), kept for the last
        parameter tuples seen (compared by identity: the router passes its groups' own tuples, so a loop gets
        the same ones every call)."""
        params, marks, by_mark = self._marks
        if len(params) != len(routes) or any(p is not r.params for p, r in zip(params, routes)):
            marks = param_marks(routes)
            by_param = {id(p): p for r in routes for p in r.params}
            by_mark = [by_param[i] for i in marks]  # marks count up in insertion order
            self._marks = (tuple(r.params for r in routes), marks, by_mark)
        return marks, by_mark


_WALKS_KEPT = 16  # walk times kept per entry
_STREAK = 8  # walked backwards in a row with one graph before the printout mentions the walk


def param_marks(routes: Sequence[Route]) -> dict[int, int]:
    """``id(parameter) -> mark`` for the signature: which leaves are which routed parameters."""
    marks: dict[int, int] = {}
    for route in routes:
        for p in route.params:
            marks.setdefault(id(p), len(marks) + 1)
    return marks
