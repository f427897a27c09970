"""Clean cuts: stage numbers changed until every engine call executes exactly its own nodes."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .._graph import Graph
from .numbering import Stage, at_or_after, at_or_before

# NOTE [Why a cut can be unclean]
#   1. The engine executes every node on a path from a call's starting edges to its captured edges and targets.
#      So if a call captures (or accumulates into) node j, and a node p of a later stage also feeds j, the
#      earlier call executes p too, out of turn: the calls would no longer split the pass's nodes between them,
#      and the retain/free decisions made per call would not hold for p.
#   2. Such a conflict is resolved by moving nodes or by merging stages (``resolve``), until every call executes
#      exactly its own nodes.
#   3. A hook reading one edge cannot replace a capture: the engine computes no gradient for an edge whose
#      target the call does not need.


def find_conflict(g: Graph, stage: Mapping[int, Stage], targets: Collection[int]) -> tuple[Stage, Stage, int] | None:
    """``(s, t, j)``: the call of stage ``s`` captures or accumulates node ``j`` and would also execute a node of
    the later stage ``t`` that feeds ``j``; None when every call executes exactly its own nodes.

    ``targets``: the leaves the pass accumulates into.
    """
    found = _conflict(g, {i: s.number for i, s in stage.items()}, targets)
    return None if found is None else (_with_number(stage, found[0]), stage[found[1]], found[2])


def resolve(
    g: Graph,
    numbered: Mapping[int, Stage],
    targets: Collection[int],
    retained: Mapping[int, bool],
    stateless: Collection[int],
    *,
    move: bool,
) -> dict[int, Stage]:
    """Resolve every conflict (see :func:`find_conflict`) at a node ``j`` that stage ``s`` captures.

    With ``move``, the stage-``s`` nodes whose only successor in the pass is ``j`` move to ``j``'s stage: their
    own inputs, fed by nobody else, become the captured edges (the views ``gradroute.checkpoint`` gives every
    edge into and out of a segment). Otherwise, or if there are none, the stages from ``s`` to the conflicting
    one merge into one call, retaining if any of its nodes must.
    """
    stage = dict(numbered)
    at = {i: v.number for i, v in stage.items()}  # kept in step with ``stage``, for _conflict
    while (conflict := _conflict(g, at, targets)) is not None:
        s, t, j = _with_number(stage, conflict[0]), stage[conflict[1]], conflict[2]
        moved = _move_into(g, stage, s, j, targets, retained, stateless) if move and j in stage else []
        if moved:
            at.update((u, stage[u].number) for u in moved)
        else:  # (a parameter j has no stage: merge)
            retain = any(retained[i] for i, v in stage.items() if s <= v <= t and i not in stateless)
            merged = at_or_after(s, retain)
            stage = {i: merged if s <= v <= t else v for i, v in stage.items()}
            at = {i: v.number for i, v in stage.items()}
    return stage


def _conflict(g: Graph, at: Mapping[int, int], targets: Collection[int]) -> tuple[int, int, int] | None:
    """:func:`find_conflict` on stage numbers (``at``: node -> its stage's number), as ``(the number of s, a node
    of t, j)``. Plain ints: this walks the whole pass once per conflict."""
    succ = g.succ
    # sets of stages as bit masks, bit ``s.number`` for stage ``s``
    reach_from: dict[int, int] = {}  # node -> mask of stages that reach it
    sink_of: dict[int, int] = {}  # node -> mask of stages that capture into it or accumulate it
    for i in g.topo:
        s = at.get(i)
        if s is None:
            continue
        m = reach_from.get(i, 0) | (1 << s)
        for j, _ in succ[i]:
            if j in targets:
                sink_of[j] = sink_of.get(j, 0) | (1 << s)
                reach_from[j] = reach_from.get(j, 0) | m
            elif j in at:
                reach_from[j] = reach_from.get(j, 0) | m
                if at[j] > s:
                    sink_of[j] = sink_of.get(j, 0) | (1 << s)
    for p, s_p in at.items():
        earlier = reach_from.get(p, 0) & ((1 << s_p) - 1)  # earlier stages that reach p
        if not earlier:
            continue
        for j, _ in succ[p]:
            both = sink_of.get(j, 0) & earlier
            if both:
                return (both & -both).bit_length() - 1, p, j
    return None


def _with_number(stage: Mapping[int, Stage], number: int) -> Stage:
    """The stage numbered ``number`` (some node has it)."""
    return next(v for v in stage.values() if v.number == number)


def _move_into(
    g: Graph,
    stage: dict[int, Stage],
    s: Stage,
    j: int,
    targets: Collection[int],
    retained: Mapping[int, bool],
    stateless: Collection[int],
) -> list[int]:
    """Move the stage-``s`` nodes whose only successor in the pass is ``j`` to ``j``'s stage (in place); the
    nodes moved."""
    moved = []
    for u, s_u in list(stage.items()):
        if s_u != s:
            continue
        outs = [jj for jj, _ in g.succ[u] if jj in stage or jj in targets]
        if outs and all(jj == j for jj in outs):
            later = stage[j] if u in stateless else at_or_before(stage[j], retained[u])
            if later > s_u:
                stage[u] = later
                moved.append(u)
    return moved
