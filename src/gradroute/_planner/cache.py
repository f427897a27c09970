"""The plan cache: analyses by call shape and signature, and for graphs that backwards follow the paths to the nodes
a plan needs."""

from __future__ import annotations

import itertools
import operator
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import Node

from .._graph import Graph, signature_marks
from .._locate import Paths, freed_probe, located, paths
from .._types import Route
from .build import Planned


@dataclass(eq=False)
class _Entry:
    """One cached analysis: the signature it was made for, when it was last used, and (graphs that backwards
    follow) the paths to the nodes its plan needs and the backwards located since the graph was last walked."""

    signature: list
    planned: Planned
    used: int
    paths: Paths | None = None
    leaves: tuple[tuple[int, int], ...] = ()
    since_walk: int = 0
    # routed backwards in a row whose graph was this one, and the last walks' times in seconds (``walk_note``)
    streak: int = 0
    walks: list[float] = field(default_factory=list)
    # the ids of parameters requiring grad that got none in a followed backward, where a walk then found no error
    no_gradient: frozenset[int] = frozenset()
    # the parameters by mark these were made from, the leaf map, and per call its parameters
    leaf: tuple[Sequence[torch.Tensor], dict[int, torch.Tensor], tuple[tuple[torch.Tensor, ...], ...]] = ((), {}, ())


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
    A call shape can alternate between graphs: a loop that switches checkpointing on and off, a model with an
    optional branch, several strategies timed with one router. Each graph keeps its own entry (up to ``size``
    in all, the least recently used dropped first); with one entry per call shape, two alternating graphs
    would each be analysed anew on every call. A lookup compares the signatures of the call shape's entries,
    newest first; unequal ones usually differ in length, which list equality checks first.

    Args:
        size: the most analyses kept.
        static_graph: 0, or every how many backwards of a static graph the whole graph is walked and checked
            (NOTE [Static graphs]).
        follow: without ``static_graph``: 0, or every how many backwards a graph seen ``_STREAK`` times in a row
            whose plan is right on any graph is walked while the others follow its paths (NOTE [Following
            without a promise]).
    """

    def __init__(self, size: int = 8, static_graph: int = 0, follow: int = 0) -> None:
        self.size = size
        self.static_graph = static_graph
        self.follow = 0 if static_graph else follow
        # key -> entries, most recently used first
        self.entries: dict[tuple, list[_Entry]] = {}
        self.hits = 0
        self.misses = 0
        self.located = 0
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
            if self._last_walked.get(old_key) is old:  # not followed once dropped (``recheck`` cannot reach it)
                del self._last_walked[old_key]
        self._clock += 1
        entry = _Entry(signature, planned, self._clock)
        self.entries.setdefault(key, []).insert(0, entry)
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self._last_walked.clear()

    def recheck(self) -> None:
        """Walk the next backward of every call shape (a backward that followed paths failed)."""
        for found in self.entries.values():
            for entry in found:
                entry.since_walk = _WALK_NEXT

    def walked(self, key: tuple, entry: _Entry, seconds: float) -> None:
        """A routed backward of call shape ``key`` walked ``entry``'s graph in ``seconds`` (``walk_note``)."""
        entry.streak = entry.streak + 1 if self._last_walked.get(key) is entry else 1
        self._last_walked[key] = entry
        entry.walks.append(seconds)
        del entry.walks[:-_WALKS_KEPT]

    def walk_note(self, planned: Planned, nodes: int, *, follows: bool) -> str | None:
        """A line for the plan printout where routed backwards walk the same graph again and again (``static_graph``
        off, ``_STREAK`` or more in a row): the walk's time, and the switch that skips it, or that backwards follow
        the graph's paths already (``follows``: the router would let them; NOTE [Following without a promise])."""
        entry = next((e for found in self.entries.values() for e in found if e.planned is planned), None)
        if self.static_graph or entry is None or entry.streak < _STREAK:
            return None
        ms = statistics.median(entry.walks) * 1e3
        if follows and self.follow and entry.planned.any_graph is not None:
            return (
                f"walk: the last {entry.streak} walks found this graph, and its plan is exact on any graph: routed "
                f"backwards from empty gradients follow the paths from the losses instead of walking its {nodes} "
                f'nodes ({ms:.2f} ms each), and walk it once every {self.follow} backwards (README, "Static graphs")'
            )
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

    def confirmed(self, key: tuple) -> _Entry | None:
        """The entry of call shape ``key`` whose graph a static-graph backward confirmed (the newest), or None."""
        found = self.entries.get(key)
        return found[0] if found and found[0].paths is not None else None

    def confirm(self, entry: _Entry, g: Graph, route_roots: Sequence[Sequence[Node]]) -> None:
        """A graph ``g`` (walked from ``route_roots``: per route, per loss) equal to ``entry``'s, walked by a backward
        that may follow paths: restart the count to the next walk, and record the paths later backwards follow
        (once; without ``static_graph``, only once ``entry`` is one they follow)."""
        entry.since_walk = 0
        if entry.paths is None and (self.static_graph or self._followable(entry)):
            _record_paths(entry, g, route_roots)

    def _followable(self, entry: _Entry) -> bool:
        """Without ``static_graph``: whether backwards may follow ``entry``'s paths (NOTE [Following without a
        promise])."""
        return bool(self.follow) and entry.planned.any_graph is not None and entry.streak >= _STREAK

    def no_gradient_seen(self, planned: Planned, missing: frozenset[int]) -> bool:
        """Whether a walk of the graph followed with ``planned`` found parameters ``missing`` getting no gradient
        without error (``Router._check_followed``)."""
        entry = self._followed(planned)
        return entry is not None and entry.no_gradient == missing

    def saw_no_gradient(self, planned: Planned, missing: frozenset[int]) -> None:
        entry = self._followed(planned)
        if entry is not None:
            entry.no_gradient = missing

    def _followed(self, planned: Planned) -> _Entry | None:
        return next((e for e in self._last_walked.values() if e.planned is planned), None)

    def targets(
        self, entry: _Entry, routes: Sequence[Route]
    ) -> tuple[tuple[tuple[torch.Tensor, ...], ...], tuple[tuple[int, ...], ...] | None] | None:
        """Per call of a located backward, the parameters it backpropagates into and (or None: the plan's) their
        routes: for a plan right on any graph (``Planned.any_graph``), every parameter of the call's route that
        requires grad; else those the plan found reached (call :meth:`locate` first). None where this backward
        must walk: a group frozen since, without ``static_graph``."""
        if entry.planned.any_graph is None:
            return entry.leaf[2], None
        targets = tuple(_trainable(routes[r].params) for r in entry.planned.any_graph)
        if not all(targets):  # a group frozen since: an engine call without inputs would write every leaf
            return (entry.leaf[2], None) if self.static_graph else None
        return targets, tuple((r,) * len(t) for r, t in zip(entry.planned.any_graph, targets, strict=True))

    def locate(self, entry: _Entry, roots: Sequence[Node], routes: Sequence[Route]) -> Graph | None:
        """The graph below ``roots`` as far as ``entry``'s plan needs it, or None where it differs on the paths
        (``_locate.located``); the parameters come from ``routes`` by mark."""
        by_mark = self.marks(routes)[1]
        if entry.leaf[0] is not by_mark:  # the same list while the routes' parameters are (see marks)
            leaf = {j: by_mark[m - 1] for j, m in entry.leaves}
            per_call = tuple(tuple(leaf[j] for j in c.wiring.targets) for c in entry.planned.plan.calls)
            entry.leaf = (by_mark, leaf, per_call)
        if entry.paths is None:  # not confirmed (to_follow() returns entries with paths only)
            return None
        return located(entry.paths, roots, entry.signature, entry.leaf[1])

    def to_follow(self, key: tuple) -> _Entry | None:
        """The entry whose paths a backward of call shape ``key`` follows now; None when this backward walks the
        graph (no graph confirmed yet, or the periodic walk is due). With ``static_graph``: the confirmed graph;
        else (``follow``): the graph the last walks found, if backwards may follow it."""
        if self.static_graph:
            entry, every = self.confirmed(key), self.static_graph
        else:
            entry, every = self._last_walked.get(key), self.follow
            if entry is None or entry.paths is None or not self._followable(entry):
                return None
        if entry is None or entry.since_walk + 1 >= every:
            return None
        entry.since_walk += 1
        return entry


_WALKS_KEPT = 16  # walk times kept per entry
_STREAK = 8  # walked backwards in a row with one graph before the printout mentions the walk, or one may follow
_WALK_NEXT = 1 << 30  # ``since_walk`` that makes the next backward walk


# NOTE [Static graphs]
# ``Router(static_graph=True)`` is the user's promise that every backward of a call shape has the same graph
# (as DDP's ``static_graph``). The first backward walks and plans; the second walks, finds the cached analysis
# (the graph is the same: confirmed) and records the paths from the losses to the few nodes the plan starts
# engine calls from or captures at (``_locate.paths``); later backwards follow those paths only, checking the
# class of every node on them, and take the parameters from the routes. Every ``static_graph``-th backward
# walks the whole graph again and raises if it changed, as does a backward whose paths reach another class.
# What the located backwards cannot see: a change off the paths (another branch, another parameter reached),
# and a node freed off the paths (the engine then reports it, possibly after earlier calls wrote ``.grad``).
# A change off the paths routes wrong gradients only where the plan depends on the graph: a plan of one engine
# call per route that captures nothing (``PlanOptions(split=False)``, no routes merged, no recomputation per
# call) and retains the graph in every call but the last is right on any graph when each call backpropagates
# its route's losses into all of the route's parameters (the engine finds which it reaches), so located
# backwards of such a plan do that (``Planned.any_graph``). The retaining matters: a plan whose calls share no
# node lets the first free what it ran, and on a changed graph the second may need those nodes.
# The walk costs about a microsecond per node, following the paths about as much per node on them.


# NOTE [Following without a promise]
# Without ``static_graph`` (``Router(static_graph=None)``, the default), the router follows paths only where
# nothing the walk finds could change a gradient or what a failure leaves: the call shape's last ``_STREAK``
# walks found one graph; its plan is right on any graph (``Planned.any_graph``: one engine call per route,
# from all its losses into all of its parameters that require grad, capturing nothing, every call but the last
# retaining; the measured choice keeps such a plan wherever it is as fast); and the backward has no gradient
# to add to (``Router.grads``, or every routed ``.grad`` None: a failure is undone, so no probe of the whole
# graph is needed). The paths lead from the losses to a few nodes the last engine call runs (the freed check);
# every ``follow``-th backward walks again. A graph found changed is no error: it is planned as a new graph,
# and following stops until it, too, has been walked ``_STREAK`` times in a row. The gradients of the
# backwards in between were exact whatever changed: the engine finds what each call reaches. What the walk
# would have refused is refused all the same, with every routed ``.grad`` None again: a reentrant
# ``torch.utils.checkpoint`` segment that an engine call runs is refused by the engine, and the router walks
# at once to name it; where a parameter that requires grad got no gradient, the router walks
# (``Router._check_followed``) and raises what the walk raises: a loss that stopped reaching its group, a
# reentrant segment that no call ran (it hides the parameters inside it; the one mark it leaves is the
# gradient they no longer get). Such a set of parameters that the walk finds without error (a custom
# ``autograd.Function`` may return None for an input it is connected to; a parameter may be unused) is
# remembered for the graph, and not walked for again; a walk that finds another graph (changed off the paths)
# stops following, as any walk that finds the graph changed. What waits for the next walk: a loss that stopped
# reaching a group whose trainable parameters are all shared with other groups routed in the same call (their
# calls write them), and a reentrant segment holding only parameters no backward of this graph reached. A
# followed backward that raises makes the next one walk; a group frozen since makes the backward walk. Off
# under DDP and FSDP2, whose hooks expect the plan's parameters.


_requires_grad = operator.attrgetter("requires_grad")


def _trainable(params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The parameters that require grad, in C loops (every located backward asks, for every routed parameter)."""
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


def _record_paths(entry: _Entry, g: Graph, route_roots: Sequence[Sequence[Node]]) -> None:
    """Record the paths from the roots (per route, per loss) to the nodes ``entry``'s plan needs in ``g``, and its
    parameters' marks."""
    marks = signature_marks(g.signature)
    mark_of = dict(zip(marks[::2], marks[1::2]))
    targets = {j for call in entry.planned.plan.calls for j in call.wiring.targets}
    entry.leaves = tuple((j, mark_of[j]) for j in sorted(targets))
    calls = entry.planned.plan.calls
    last = calls[-1].wiring if calls else None  # no call: no loss reaches a routed parameter
    starts = [g.index[route_roots[r][k]] for r, k in last.losses] + [j for j, _ in last.edges_in] if last else []
    probe = freed_probe(g, starts, [*last.targets, *(j for j, _ in last.edges_out)] if last else [])
    entry.paths = paths(g, [n for nodes in route_roots for n in nodes], _wanted(entry.planned), probe)


def param_marks(routes: Sequence[Route]) -> dict[int, int]:
    """``id(parameter) -> mark`` for the signature: which leaves are which routed parameters."""
    marks: dict[int, int] = {}
    for route in routes:
        for p in route.params:
            marks.setdefault(id(p), len(marks) + 1)
    return marks
