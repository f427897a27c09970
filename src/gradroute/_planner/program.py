"""The planner's entry: walk the losses' graph, reuse or make the analysis, and hand the executor a program."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import Node

from .._graph import Graph, root_node, walk
from .._locate import Paths, located, paths
from .._options import PlanOptions
from .._types import Route
from .build import NO_CHECKPOINTS, Checkpoints, Planned, analyse
from .plan import Plan


@dataclass(frozen=True, eq=False)
class Program:
    """A planned backward plus the graph it runs on. Dropped after execution.

    Attributes:
        planned: the pipeline's result (shared with the cache).
        graph: the losses' graph.
        routes: the routes, in the caller's order.
        options: the options it was planned with (the executor reads ``remake_min_bytes``).
        targets: per call, the parameters it accumulates into, when known already (a static graph's); else
            the executor reads them off ``graph.leaf``.
    """

    planned: Planned
    graph: Graph
    routes: Sequence[Route]
    options: PlanOptions = field(default_factory=PlanOptions)
    targets: tuple[tuple[torch.Tensor, ...], ...] | None = None

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @property
    def unreached(self) -> list[str]:
        """The names of the routes whose losses reach none of their own parameters."""
        return [self.routes[r].name for r in self.planned.unreached]


@dataclass(eq=False)
class _Entry:
    """One cached analysis: the signature it was made for, when it was last used, and (static graphs) the
    paths to the nodes its plan needs and the backwards located since the graph was last walked."""

    signature: list
    planned: Planned
    used: int
    paths: Paths | None = None
    leaves: tuple[tuple[int, int], ...] = ()
    since_walk: int = 0
    # the parameters by mark these were made from, the leaf map, and per call its parameters
    leaf: tuple[Sequence[torch.Tensor], dict[int, torch.Tensor], tuple[tuple[torch.Tensor, ...], ...]] = ((), {}, ())


class PlanCache:
    """The analyses of the last ``size`` graphs planned, by call shape (group names, loss counts, mode, options)
    and signature; reused for an equal graph.

    Reuse is safe because the analysis is a function of the graph's signature alone (node classes, edges with
    their input slots, which leaves are which group parameters, where the losses enter): the walk that
    computes the signature runs on every call, only the analysis is skipped. Parameters are compared by
    identity; the router holds them, so their ids cannot be reused while the cache exists.

    NOTE [Several graphs per call shape]
    A call shape can alternate between graphs: a loop that switches checkpointing on and off, a model with an
    optional branch, the bench's strategies sharing one router. Each graph keeps its own entry (up to ``size``
    in all, the least recently used dropped first); with one entry per call shape, two alternating graphs
    would each be analysed anew on every call. A lookup compares the signatures of the call shape's entries,
    newest first; unequal ones usually differ in length, which list equality checks first.

    Args:
        size: the most analyses kept.
        static_graph: 0, or every how many backwards of a static graph the whole graph is walked and checked
            (NOTE [Static graphs]).
    """

    def __init__(self, size: int = 8, static_graph: int = 0) -> None:
        self.size = size
        self.static_graph = static_graph
        # key -> entries, most recently used first
        self.entries: dict[tuple, list[_Entry]] = {}
        self.hits = 0
        self.misses = 0
        self.located = 0
        self._clock = 0
        self._marks: tuple[tuple, dict[int, int], list[torch.Tensor]] = ((), {}, [])

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

    def store(self, key: tuple, signature: list, planned: Planned) -> None:
        """Keep ``planned`` for graphs of call shape ``key`` and this signature (dropping the least recently used
        entry when full)."""
        if len(self) >= self.size:
            old_key, old = min(((k, e) for k, found in self.entries.items() for e in found), key=lambda ke: ke[1].used)
            self.entries[old_key].remove(old)
            if not self.entries[old_key]:
                del self.entries[old_key]
        self._clock += 1
        self.entries.setdefault(key, []).insert(0, _Entry(signature, planned, self._clock))

    def clear(self) -> None:
        self.entries.clear()

    def marks(self, routes: Sequence[Route]) -> tuple[dict[int, int], list[torch.Tensor]]:
        """:func:`_marks` of ``routes`` and the parameters by mark (mark ``m`` at ``m - 1``), kept for the last
        parameter tuples seen (compared by identity: the router passes its groups' own tuples, so a loop gets
        the same ones every call)."""
        params, marks, by_mark = self._marks
        if len(params) != len(routes) or any(p is not r.params for p, r in zip(params, routes)):
            marks = _marks(routes)
            by_param = {id(p): p for r in routes for p in r.params}
            by_mark = [by_param[i] for i in marks]  # marks count up in insertion order
            self._marks = (tuple(r.params for r in routes), marks, by_mark)
        return marks, by_mark

    def confirmed(self, key: tuple) -> _Entry | None:
        """The entry of call shape ``key`` whose graph a static-graph backward confirmed (the newest), or None."""
        found = self.entries.get(key)
        return found[0] if found and found[0].paths is not None else None

    def static(self, key: tuple) -> _Entry | None:
        """The entry whose paths a static graph of call shape ``key`` follows now; None when this backward walks
        the graph (no graph confirmed yet, or the periodic check is due)."""
        entry = self.confirmed(key)
        if not self.static_graph or entry is None:
            return None
        if entry.since_walk + 1 >= self.static_graph:
            return None
        entry.since_walk += 1
        self.located += 1
        return entry


def build(
    routes: Sequence[Route],
    *,
    merge_shared: bool = True,
    options: PlanOptions | None = None,
    cache: PlanCache | None = None,
    checkpoints: Checkpoints = NO_CHECKPOINTS,
    graph: Graph | None = None,
    static: bool = False,
) -> Program:
    """Walk the graph of ``routes`` and plan it (or reuse the analysis of an equal graph).

    Args:
        routes: the routes, in the caller's order.
        merge_shared: whether routes whose groups share parameters may be merged into one pass (exact for
            ``backward``, where shared parameters receive the sum; not for ``grads``, which reports each
            route's gradient separately).
        options: chunk size, interleaving and the other settings (:class:`gradroute.PlanOptions`); the
            router switches ``interleave`` off under FSDP2, which reduce-scatters a module's gradients at the
            end of the first engine call that computes any of them.
        cache: reuse the analysis of an earlier graph with the same signature.
        checkpoints: the live ``gradroute.checkpoint`` segments and their sizes.
        graph: the graph of these same ``routes`` from an earlier ``build`` (planned again with other
            ``options``: the measured choice), so that it is not walked again.
        static: the graph of this call shape is the same on every call (NOTE [Static graphs]; needs a
            ``cache`` made with ``static_graph``).

    Raises:
        ValueError: the graph holds a reentrant ``torch.utils.checkpoint`` segment.
        RuntimeError: with ``static``, the graph differs from the one confirmed for this call shape.
    """
    roots = [root_node(t) for r in routes for t in r.losses]
    options = options or PlanOptions()
    key = (merge_shared, options, tuple((r.name, len(r.losses)) for r in routes))
    static = static and cache is not None and cache.static_graph > 0 and graph is None
    confirmed = None
    if static and cache is not None:
        entry = cache.static(key)
        if entry is not None:
            found = _locate(entry, roots, cache.marks(routes)[1])
            if found is not None:
                return Program(entry.planned, found, routes, options, targets=entry.leaf[2])
        confirmed = cache.confirmed(key)
    g = walk(roots, cache.marks(routes)[0] if cache else _marks(routes)) if graph is None else graph
    if any(t.__name__ == "CheckpointFunctionBackward" for t in g.kinds):
        raise ValueError(
            "the losses' graph contains a reentrant torch.utils.checkpoint segment (use_reentrant=True): its "
            "backward refuses `torch.autograd.grad` and `backward(inputs=...)`, which routing needs, and hides "
            "the parameters inside it; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
            "gradroute.checkpoint"
        )
    if confirmed is not None and not (confirmed.signature is g.signature or confirmed.signature == g.signature):
        raise RuntimeError(_changed(routes))
    hit = cache.lookup(key, g.signature) if cache is not None else None
    if hit is not None:
        g.signature = hit.signature  # equal; the cached list, so that callers can tell the entry by identity
        if static:
            _confirm(hit, g, roots)
        return Program(hit.planned, g, routes, options)
    root_ids = [[g.index[root_node(t)] for t in r.losses] for r in routes]
    planned = analyse(
        g,
        [r.name for r in routes],
        [r.params for r in routes],
        root_ids,
        merge_shared=merge_shared,
        options=options,
        checkpoints=checkpoints,
    )
    if cache is not None:
        cache.store(key, g.signature, planned)
    return Program(planned, g, routes, options)


# NOTE [Static graphs]
# ``Router(static_graph=True)`` is the user's promise that every backward of a call shape has the same graph
# (as DDP's ``static_graph``). The first backward walks and plans; the second walks, finds the cached analysis
# (the graph is the same: confirmed) and records the paths from the losses to the few nodes the plan starts
# engine calls from or captures at (``_locate.paths``); later backwards follow those paths only, checking the
# class of every node on them, and take the parameters from the routes. Every ``static_graph``-th backward
# walks the whole graph again and raises if it changed, as does a backward whose paths reach another class.
# What the located backwards cannot see: a change off the paths (another branch, another parameter reached),
# and a node freed off the paths (the engine then reports it, possibly after earlier calls wrote ``.grad``).
# The walk costs about a microsecond per node, following the paths about as much per node on them.


def _wanted(planned: Planned) -> set[int]:
    """The node ids the executor takes from a graph for ``planned``, besides the parameters (by mark)."""
    out = set(planned.per_call)
    for call in planned.plan.calls:
        w = call.wiring
        out.update(j for j, _ in w.edges_in)
        out.update(j for j, _ in w.edges_out)
        if w.edges_out:
            out.update(w.targets)  # their AccumulateGrad nodes (``_execute._accumulate``)
    return out


def _confirm(entry: _Entry, g: Graph, roots: Sequence[Node]) -> None:
    """A walked graph equal to ``entry``'s: record (once) the paths later backwards follow; restart the count to
    the next check."""
    entry.since_walk = 0
    if entry.paths is None:
        marks = g.signature[3]
        mark_of = dict(zip(marks[::2], marks[1::2]))
        targets = {j for call in entry.planned.plan.calls for j in call.wiring.targets}
        entry.leaves = tuple((j, mark_of[j]) for j in sorted(targets))
        entry.paths = paths(g, roots, _wanted(entry.planned))


def _locate(entry: _Entry, roots: Sequence[Node], by_mark: Sequence[torch.Tensor]) -> Graph | None:
    """The graph below ``roots`` as far as ``entry``'s plan needs it, or None where it differs on the paths."""
    if entry.paths is None:
        return None
    if entry.leaf[0] is not by_mark:  # the same list while the routes' parameters are (PlanCache.marks)
        leaf = {j: by_mark[m - 1] for j, m in entry.leaves}
        per_call = tuple(tuple(leaf[j] for j in c.wiring.targets) for c in entry.planned.plan.calls)
        entry.leaf = (by_mark, leaf, per_call)
    return located(entry.paths, roots, entry.signature, entry.leaf[1])


def _changed(routes: Sequence[Route]) -> str:
    names = ", ".join(f"`{r.name}`" for r in routes)
    return (
        f"`static_graph` was set, but the autograd graph of the losses routed to {names} differs from the one "
        "planned for them on an earlier backward (another branch taken, another module, checkpointing switched, "
        "an input that now requires grad); gradients routed since the last check may be wrong. Use "
        "Router(static_graph=False), the default, for a graph that changes: it walks the graph on every backward"
    )


def _marks(routes: Sequence[Route]) -> dict[int, int]:
    """``id(parameter) -> mark`` for the signature: which leaves are which routed parameters."""
    marks: dict[int, int] = {}
    for route in routes:
        for p in route.params:
            marks.setdefault(id(p), len(marks) + 1)
    return marks
