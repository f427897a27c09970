"""``Router(static_graph=True)``: backwards that follow a few recorded paths instead of walking the whole graph.

Everything about skipping the walk lives here, in one state object (:class:`StaticGraph`); the plan cache
(``cache.py``) only keeps analyses. Words: a backward *walks* the graph (``_graph.walk``) or *follows* the
*paths* recorded from an earlier walk of the same graph; the *check* is the periodic walk that compares the
graph with the one recorded.

NOTE [Static graphs]
``static_graph`` is the user's promise that every backward of a call shape (group names, loss counts, mode,
options) has the graph of the first, as DDP's ``static_graph``. Without it (the default) every backward walks.
  1. The first backward of a call shape walks and plans; the next walk of an equal graph (a cache hit) records
     the paths from the losses to the few nodes the plan needs (``_wanted``) and to the freed probe.
  2. Later backwards follow those paths only, checking the class of every node on them; a node of another
     class makes that backward walk, and a walk that finds a graph other than the recorded one raises
     RuntimeError before any ``.grad`` is touched.
  3. Every ``every``-th backward of a call shape walks (the check). A backward that followed and raised makes
     the next one walk (``recheck``).
  4. The engine calls' targets are the parameters of the recorded graph, by mark, except for a plan exact on
     any graph (``Planned.any_graph``: one call per route from all of its losses, capturing nothing, every call
     but the last retaining, so that no call frees a node a later one may need on another graph): each call
     then backpropagates into all of its route's parameters that require grad, which the engine finds on
     whatever graph it meets.
  5. Nothing is followed while the measured choice is measuring, nor under DDP or FSDP2 (the router's call).
What a followed backward cannot see, and the promise covers: a change off the paths (another branch, another
parameter reached: wrong gradients unless rule 4's exception holds) until the next check, and a node freed
off the paths (the engine reports it, possibly after earlier calls wrote ``.grad``).
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

from .._compat import saved_attrs
from .._graph import Graph, node_state, signature_marks
from .._types import Route
from .build import Planned

_PROBE = 2  # nodes the freed check of a followed graph reads


@dataclass(frozen=True)
class Paths:
    """How to reach chosen nodes of any graph of one signature from its roots, and what to check on the way.

    Attributes:
        roots: per root (in the order given to the walk), its node id and class.
        steps: ``(node id, parent id, position in the parent's next_functions, class)``, parents first: each
            node is the first through which the walk found it, so the paths are the shortest.
        saved: the ids of a few nodes that keep tensors and that the last engine call of the plan runs
            (:func:`freed_probe`), on the paths: the freed check looks at these only, up to the first that holds
            a defined one (a second backward of the same losses freed them all).
        size: the number of nodes of the graph.
    """

    roots: tuple[tuple[int, type], ...]
    steps: tuple[tuple[int, int, int, type], ...]
    saved: tuple[int, ...]
    size: int


@dataclass(eq=False)
class _Record:
    """A call shape's recorded graph: its analysis, the paths to what the plan needs, and its leaves by mark."""

    signature: list
    planned: Planned
    paths: Paths
    leaves: tuple[tuple[int, int], ...]  # (leaf node id, parameter mark) of every call's targets
    since_check: int = 0
    # the parameters by mark the leaf map was made from, the leaf map, and per call its parameters
    leaf: tuple[Sequence[torch.Tensor], dict[int, torch.Tensor], tuple[tuple[torch.Tensor, ...], ...]] = ((), {}, ())


@dataclass(frozen=True)
class Followed:
    """What a followed backward runs on: the graph of the nodes on the paths, and per engine call its targets
    (and, for a plan exact on any graph, their routes)."""

    planned: Planned
    graph: Graph
    targets: tuple[tuple[torch.Tensor, ...], ...]
    target_routes: tuple[tuple[int, ...], ...] | None


class StaticGraph:
    """The state of ``Router(static_graph=...)``: per call shape, the recorded graph (NOTE [Static graphs]).

    Args:
        every: every how many backwards of a call shape the whole graph is walked and checked.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.records: dict[tuple, _Record] = {}

    def follow(
        self, key: tuple, roots: Sequence[Node], routes: Sequence[Route], by_mark: Sequence[torch.Tensor]
    ) -> Followed | None:
        """The graph a backward of call shape ``key`` follows now, or None where it walks (nothing recorded, the
        check is due, a node on the paths changed, or a group frozen since under a plan exact on any graph)."""
        record = self.records.get(key)
        if record is None or record.since_check + 1 >= self.every:
            return None
        record.since_check += 1
        graph = _graph_on_paths(record, roots, by_mark)
        if graph is None:
            return None
        targets, target_routes = _targets(record, routes)
        return Followed(record.planned, graph, targets, target_routes)

    def changed(self, key: tuple, signature: list) -> bool:
        """After a walk: whether call shape ``key`` recorded another graph (rule 2)."""
        record = self.records.get(key)
        return record is not None and not (record.signature is signature or record.signature == signature)

    def walked(self, key: tuple, g: Graph, planned: Planned, route_roots: Sequence[Sequence[Node]]) -> None:
        """A walk of call shape ``key`` found the graph of ``planned`` cached (rule 1): restart the count to the
        check, and record the paths once."""
        record = self.records.get(key)
        if record is not None and record.planned is planned:
            record.since_check = 0
            return
        self.records[key] = _record(g, planned, route_roots)

    def recheck(self) -> None:
        """The next backward of every call shape walks (a followed backward raised)."""
        for record in self.records.values():
            record.since_check = _CHECK_NEXT

    def clear(self) -> None:
        self.records.clear()


_CHECK_NEXT = 1 << 30  # ``since_check`` that makes the next backward walk


def _record(g: Graph, planned: Planned, route_roots: Sequence[Sequence[Node]]) -> _Record:
    """The record of walked graph ``g`` planned as ``planned`` (roots per route, per loss)."""
    marks = signature_marks(g.signature)
    mark_of = dict(zip(marks[::2], marks[1::2]))
    targets = {j for call in planned.plan.calls for j in call.wiring.targets}
    calls = planned.plan.calls
    last = calls[-1].wiring if calls else None  # no call: no loss reaches a routed parameter
    starts = [g.index[route_roots[r][k]] for r, k in last.losses] + [j for j, _ in last.edges_in] if last else []
    probe = freed_probe(g, starts, [*last.targets, *(j for j, _ in last.edges_out)] if last else [])
    return _Record(
        signature=g.signature,
        planned=planned,
        paths=paths(g, [n for nodes in route_roots for n in nodes], _wanted(planned), probe),
        leaves=tuple((j, mark_of[j]) for j in sorted(targets)),
    )


def _graph_on_paths(record: _Record, roots: Sequence[Node], by_mark: Sequence[torch.Tensor]) -> Graph | None:
    """The graph below ``roots`` as far as the record's plan needs it, or None where it differs on the paths."""
    if record.leaf[0] is not by_mark:  # the same list while the routes' parameters are (PlanCache.marks)
        leaf = {j: by_mark[m - 1] for j, m in record.leaves}
        per_call = tuple(tuple(leaf[j] for j in c.wiring.targets) for c in record.planned.plan.calls)
        record.leaf = (by_mark, leaf, per_call)
    nodes = trace(record.paths, roots)
    if nodes is None:
        return None
    return Graph(
        nodes=nodes,  # type: ignore[arg-type]
        leaf=record.leaf[1],
        index={},
        signature=record.signature,
        kinds=set(),
        freed=_freed(record.paths, nodes),
        followed=True,
    )


def _targets(
    record: _Record, routes: Sequence[Route]
) -> tuple[tuple[tuple[torch.Tensor, ...], ...], tuple[tuple[int, ...], ...] | None]:
    """Per engine call, the parameters it backpropagates into and (or None: the plan's) their routes (rule 4)."""
    if record.planned.any_graph is None:
        return record.leaf[2], None
    targets = tuple(_trainable(routes[r].params) for r in record.planned.any_graph)
    if not all(targets):  # a group frozen since: an engine call without inputs would write every leaf
        return record.leaf[2], None
    return targets, tuple((r,) * len(t) for r, t in zip(record.planned.any_graph, targets, strict=True))


_requires_grad = operator.attrgetter("requires_grad")


def _trainable(params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The parameters that require grad, in C loops (every followed backward asks, for every routed parameter)."""
    flags = list(map(_requires_grad, params))
    return tuple(params) if all(flags) else tuple(itertools.compress(params, flags))


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


def freed_probe(g: Graph, starts: Sequence[int], ends: Iterable[int]) -> tuple[int, ...]:
    """The nodes for the freed check of graphs like ``g`` whose last engine call runs from the nodes ``starts`` into
    ``ends``: the first few that keep tensors on the shortest path between them that has any (the call runs every
    node on such a path and, not retaining, frees it: a second backward of the same losses finds it freed, where
    nodes run only by earlier, retaining calls still hold theirs). Else the first few of ``g`` that keep tensors
    (breadth first)."""
    targets = set(ends)
    parent = dict.fromkeys(starts, -1)
    frontier = collections.deque(starts)
    while frontier:
        i = frontier.popleft()
        if i in targets:
            chain = []
            k = i
            while k != -1:
                chain.append(k)
                k = parent[k]
            found = tuple(itertools.islice((j for j in reversed(chain) if saved_attrs(g.nodes[j])), _PROBE))
            if found:
                return found
        for j, _ in g.succ[i]:
            if j not in parent:
                parent[j] = i
                frontier.append(j)
    return tuple(itertools.islice((j for j, n in enumerate(g.nodes) if saved_attrs(n)), _PROBE))


def paths(g: Graph, roots: Sequence[Node], wanted: Iterable[int], probe: Sequence[int] = ()) -> Paths:
    """The paths from ``roots`` (the nodes ``g`` was walked from) to the nodes ``wanted`` of ``g``, and to the nodes
    ``probe`` that the freed check looks at (:func:`freed_probe`)."""
    root_ids = {g.index[r] for r in roots}
    keeping = tuple(probe)
    parent: dict[int, int] = {}
    for i, out in enumerate(g.succ):  # ids are in breadth-first order: the first parent seen is the walk's
        for j, _ in out:
            if j not in parent and j not in root_ids:
                parent[j] = i
    on_path: set[int] = set()
    for j in (*wanted, *keeping):
        while j not in on_path and j not in root_ids:
            on_path.add(j)
            j = parent[j]
    steps = []
    for j in sorted(on_path):  # a parent's id is below its children's
        i = parent[j]
        pos = next(k for k, (fn, _) in enumerate(g.nodes[i].next_functions) if fn is g.nodes[j])
        steps.append((j, i, pos, type(g.nodes[j])))
    return Paths(
        roots=tuple((g.index[r], type(r)) for r in roots),
        steps=tuple(steps),
        saved=keeping,
        size=len(g.nodes),
    )


def trace(p: Paths, roots: Sequence[Node]) -> list[Node | None] | None:
    """The nodes on the paths of ``p`` in the graph below ``roots``, by id (None elsewhere), or None where a node
    on the way has another class than in the graph ``p`` was made from (the graph changed)."""
    nodes: list[Node | None] = [None] * p.size
    for (i, kind), root in zip(p.roots, roots):
        if type(root) is not kind:
            return None
        nodes[i] = root
    try:
        for j, i, pos, kind in p.steps:
            node = nodes[i].next_functions[pos][0]  # type: ignore[union-attr]
            if type(node) is not kind:
                return None
            nodes[j] = node  # type: ignore[call-overload]
    except IndexError:  # fewer next functions than in the graph the paths were made from
        return None
    return nodes


def _freed(p: Paths, nodes: list[Node | None]) -> int | None:
    """The first node of ``p.saved`` that tells (holds a defined saved tensor), if a backward freed it."""
    for j in p.saved:
        state = node_state(nodes[j], saved_attrs(nodes[j]))
        if state != "none":
            return j if state == "freed" else None
    return None
