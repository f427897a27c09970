"""The pipeline: reach -> passes -> needs -> order, last use -> chunks -> stage -> schedule -> per call -> describe."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._graph import Graph
from .._options import PlanOptions
from .chunks import chunk_shared_segments
from .describe import describe
from .masks import bits, several
from .needs import Needs, needs
from .order import last_use, order_passes
from .passes import merge_routes
from .per_call import recompute_per_call
from .plan import Plan
from .reach import reach
from .schedule import schedule
from .stage import PassInputs, PassStages, stage_pass

# NOTE [Free at the last use]
# What every plan keeps, whatever its options (the words are those of docs/design.md's glossary):
#   1. Routes merge into one pass only where that is exact: no loss of the pass reaches a parameter that only
#      another route of the pass owns (it would leak into it).
#   2. A pass needs the nodes on a path from one of its losses to one of its parameters: exactly what the engine
#      executes for ``backward(inputs=params)``, so a call's gradients are those of a plain backward per route.
#   3. Executing a node without ``retain_graph`` frees its saved tensors; so every node is executed with
#      ``retain_graph=False`` exactly at its last use and with ``retain_graph=True`` before: freed earlier, a
#      later pass would fail; kept, the saved tensors would outlive the backward while the caller holds the losses.
#   4. A pass is split into stages (one engine call each, a :class:`Call`) where its nodes switch between
#      retained and freed. The gradients flowing across such an edge are captured as ``GradientEdge`` inputs of
#      one call and fed as outputs of the next ("edges out", "edges in"; unrelated to ``gradroute.cut_points``).
#   5. A stateless node (a view, an add) keeps no tensors, so it may run in a call of either kind.
#   6. Nothing here touches ``.grad``: the executor (``_execute.py``) runs the calls.


@dataclass(frozen=True)
class Checkpoints:
    """What the planner reads about ``gradroute.checkpoint`` segments, passed in by the caller.

    Attributes:
        segments: ``nodes -> `` the sequence-number ranges ``[first, end)`` of the live segments recorded by
            the threads that made ``nodes`` (the graph's nodes; sequence numbers are per thread), sorted (called
            on a cache miss only).
        node_bytes: ``node -> bytes`` a recomputation of the node's segment keeps alive for it.
    """

    segments: Callable[[Sequence[object]], Sequence[tuple[int, int]]]
    node_bytes: Callable[[object], int]


NO_CHECKPOINTS = Checkpoints(segments=lambda nodes: (), node_bytes=lambda node: 0)


@dataclass(frozen=True)
class Planned:
    """What the pipeline makes of one graph; valid for every graph of the same signature (no graph references).

    Attributes:
        plan: the plan; its calls carry the node ids the executor needs.
        unreached: the routes whose losses reach none of their own parameters, by position.
        shared: the nodes that more than one pass executes.
        per_call: the nodes of checkpoint segments recomputed once per call instead of shared.
        leaf_routes: leaf node id -> the routes whose losses reach it (for the reach of groups not routed).
        held: the most bytes of shared checkpoint recomputations alive at once between calls (``PerCall.held``).
        any_graph: per call, its route, where the plan is exact on any graph once each call backpropagates
            into all of its route's parameters (``_any_graph``; NOTE [Static graphs] in ``follow.py``); else None.
    """

    plan: Plan
    unreached: tuple[int, ...]
    shared: tuple[int, ...]
    per_call: tuple[int, ...]
    leaf_routes: dict[int, int]
    held: int = 0
    any_graph: tuple[int, ...] | None = None


def analyse(
    g: Graph,
    names: Sequence[str],
    params: Sequence[Sequence[object]],
    roots: Sequence[Sequence[int]],
    *,
    merge_shared: bool,
    options: PlanOptions,
    checkpoints: Checkpoints = NO_CHECKPOINTS,
) -> Planned:
    """Run the pipeline on graph ``g``: route ``r`` is named ``names[r]``, owns ``params[r]`` and starts at
    the nodes ``roots[r]`` (one per loss tensor)."""
    found = reach(g, params, roots, merge_shared=merge_shared)
    passes = merge_routes(found)
    need = needs(g, found, passes)
    order = order_passes(g, need, len(passes.routes))
    last = last_use(need, order)
    inputs = [
        PassInputs(
            index=k,
            routes=passes.routes[k],
            groups=tuple(names[r] for r in bits(passes.routes[k])),
            roots=roots,
            owners=found.owners,
        )
        for k in order
    ]
    ranges = checkpoints.segments(g.nodes)
    interleave = options.interleave and options.split
    chunk_of = chunk_shared_segments(g, need.needed_by, ranges, options.chunk) if interleave else {}
    staged = _stage_all(g, inputs, need, last, chunk_of, roots, options.split)
    per_call = recompute_per_call(g, staged.members, ranges, checkpoints.node_bytes, options.held_factor)
    if per_call.segments:
        # shared recomputations would pile up (the passes cannot interleave through the segments, or must
        # not: FSDP2): plan as for torch's checkpoint (no cuts inside the segments) and recompute every
        # segment once per call, each tensor dropped once used
        if chunk_of:
            chunk_of = {}
            staged = _stage_all(g, inputs, need, last, chunk_of, roots, options.split)
        per_call = recompute_per_call(g, staged.members, ranges, checkpoints.node_bytes, 0)
    plan = describe(
        names,
        found,
        passes,
        order,
        staged.calls,
        kept=staged.kept,
        graph_nodes=len(g.nodes),
        chunks=len(set(chunk_of.values())),
        per_call=per_call,
    )
    return Planned(
        plan=plan,
        unreached=passes.unreached,
        shared=tuple(i for i, nd in enumerate(need.needed_by) if several(nd)),
        per_call=per_call.nodes,
        leaf_routes={i: found.reached_by[i] for i in g.leaf},
        held=per_call.held,
        any_graph=_any_graph(plan, per_call.nodes, [len(r) for r in roots]),
    )


def _any_graph(plan: Plan, per_call: Sequence[int], loss_counts: Sequence[int]) -> tuple[int, ...] | None:
    """Per call, its route, where ``plan`` gives exact gradients on any graph once each call backpropagates
    into all of its route's parameters: every call starts from all the losses of one route (and of no other),
    captures no gradient edge and resumes from none, every route has a call, no segment is recomputed per
    call, and every call but the last retains the graph (on another graph a later call may need the nodes of
    an earlier one that this graph's plan lets free). Else None (NOTE [Static graphs] in ``follow.py``)."""
    if per_call or not all(call.retain for call in plan.calls[:-1]):
        return None
    out = []
    for call in plan.calls:
        w = call.wiring
        owners = {r for r, _ in w.losses}
        if w.edges_in or w.edges_out or len(owners) != 1:
            return None
        (r,) = owners
        if len(w.losses) != loss_counts[r]:  # a loss term the plan found reaching nothing was left out
            return None
        out.append(r)
    return tuple(out) if sorted(out) == list(range(len(loss_counts))) else None


def _stage_all(
    g: Graph,
    inputs: Sequence[PassInputs],
    need: Needs,
    last: Sequence[int],
    chunk_of: dict[int, int],
    roots: Sequence[Sequence[int]],
    split: bool,
) -> PassStages:
    """Stage every pass (in execution order) and schedule the calls."""
    per_pass = [stage_pass(g, p, need, last, chunk_of, split=split) for p in inputs]
    return schedule(g, per_pass, roots)
