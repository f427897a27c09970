"""Step 6, stage: one pass split into engine calls, each retaining or freeing, cut where the label changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._graph import Graph, stateless
from .conflicts import resolve
from .masks import bits
from .needs import Needs
from .numbering import FIRST, Stage, chunk_start, fold_stateless_stages, ladder, number_stages, pull_stateless
from .plan import Call, Wiring


@dataclass(frozen=True)
class PassStages:
    """One pass's engine calls, in order.

    Attributes:
        calls: the calls (``index`` 0: numbered once scheduled).
        members: per call, the nodes it executes.
        kept: nodes whose last execution had to retain (0 unless a cut could not be made clean).
    """

    calls: tuple[Call, ...]
    members: tuple[tuple[int, ...], ...]
    kept: int


@dataclass(frozen=True)
class PassInputs:
    """What staging one pass reads besides the graph.

    Attributes:
        index: the pass's index (bit ``index`` in the :class:`Needs` masks).
        routes: the mask of its routes.
        groups: their names.
        roots: per route (of all routes), its loss nodes' ids.
        owners: leaf node id -> the routes (of all routes) whose parameter it is (``Reach.owners``).
    """

    index: int
    routes: int
    groups: tuple[str, ...]
    roots: Sequence[Sequence[int]]
    owners: Mapping[int, int]


def stage_pass(
    g: Graph, p: PassInputs, need: Needs, last: Sequence[int], chunk_of: Mapping[int, int], *, split: bool = True
) -> PassStages:
    """Split pass ``p`` into calls of one label each; where a cut is not clean, merge the calls involved.

    ``chunk_of`` maps the nodes of checkpoint segments that several passes enter to their chunk's position
    (see :func:`~.chunks.chunk_shared_segments`): such passes are cut between chunks too, so that their calls
    interleave chunk by chunk and each shared recomputation is freed as the passes go down it. ``split``
    False: one call, retaining if a later pass needs any of its nodes (``PlanOptions.split``).
    """
    bit = 1 << p.index
    members = [i for i in g.topo if need.needed_by[i] & bit]
    stage, kept = _number(g, p.index, members, need, last, chunk_of) if split else _whole(g, p.index, members, last)
    stages = ladder(max(stage.values(), default=FIRST))
    n_stages = len(stages)
    losses: list[list[tuple[int, int]]] = [[] for _ in range(n_stages)]
    targets: list[set[int]] = [set() for _ in range(n_stages)]
    for r in bits(p.routes):
        for pos, i in enumerate(p.roots[r]):
            if i in g.leaf:  # the loss is a leaf itself: it is its own target
                losses[0].append((r, pos))
                targets[0].add(i)
            elif i in stage:  # a loss term that reaches none of the pass's parameters is left out
                losses[stage[i].number].append((r, pos))
    edges_out: list[dict[tuple[int, int], None]] = [{} for _ in range(n_stages)]
    edges_in: list[dict[tuple[int, int], None]] = [{} for _ in range(n_stages)]
    members_of: list[list[int]] = [[] for _ in range(n_stages)]
    succ, needed_by, pass_targets = g.succ, need.needed_by, need.targets
    for i, at in stage.items():
        s = at.number
        members_of[s].append(i)
        for j, nr in succ[i]:
            if pass_targets.get(j, 0) & bit:
                targets[s].add(j)
            elif needed_by[j] & bit and stage[j] > at:
                edges_out[s][j, nr] = None
                edges_in[stage[j].number][j, nr] = None
    calls: list[Call] = []
    kept_members: list[tuple[int, ...]] = []
    for s, at in enumerate(stages):
        if n_stages > 1 and not members_of[s] and not losses[s] and not targets[s]:
            continue
        ids = tuple(sorted(targets[s]))
        wiring = Wiring(
            pass_index=p.index,
            losses=tuple(losses[s]),
            edges_in=tuple(edges_in[s]),
            edges_out=tuple(edges_out[s]),
            targets=ids,
            target_routes=tuple(_first_bit(p.owners[j] & p.routes) for j in ids),
        )
        calls.append(Call.make(0, p.groups, at.retain, len(members_of[s]), wiring))
        kept_members.append(tuple(members_of[s]))
    return PassStages(calls=tuple(calls), members=tuple(kept_members), kept=kept)


def _number(
    g: Graph, k: int, members: list[int], need: Needs, last: Sequence[int], chunk_of: Mapping[int, int]
) -> tuple[dict[int, Stage], int]:
    """The stage of every node of pass ``k``, and how many nodes retain at their last use.

    Cut per shared checkpoint chunk (if any), as late as possible (deferred parts stay together, like a hand
    cut at the frontier), or as early as possible; resolve the unclean cuts (see :func:`~.conflicts.resolve`).
    Keep the numbering that leaves the fewest nodes retained at their last use, preferring them in that order.
    """
    retained = {i: last[i] != k for i in members}
    # stateless nodes (views, adds...) may run in a retaining call at their last use: it keeps nothing alive
    free = {i for i in members if stateless(g.nodes[i])}
    starts = {c: chunk_start(c) for c in set(chunk_of.values())}
    lower = {i: starts[chunk_of[i]] for i in members if i in chunk_of}
    if not lower and not any(retained.values()):
        return {i: FIRST for i in members}, 0
    needed = set(members)
    targets = {j for j, m in need.targets.items() if m & (1 << k)}
    best: tuple[int, dict[int, Stage]] | None = None
    for how in ("chunks", "late", "early") if lower else ("late", "early"):
        numbered = number_stages(
            g, members, retained, free, needed, late=how == "late", lower=lower if how == "chunks" else {}
        )
        numbered = fold_stateless_stages(numbered, free)
        pulled = pull_stateless(g, members, numbered, free, lower if how == "chunks" else {})
        # the numbering as it was is resolved too only if the pulled one keeps nodes (NOTE [Stateless nodes at
        # a cut]): moving nodes can make a cut that resolving must merge
        for candidate in (pulled, numbered) if pulled != numbered else (numbered,):
            done = resolve(g, candidate, targets, retained, free, move=how == "chunks")
            n_kept = sum(1 for i, v in done.items() if v.retain and not retained[i] and i not in free)
            if best is None or n_kept < best[0]:
                best = (n_kept, done)
            if n_kept == 0:
                break
        if best is not None and best[0] == 0:
            break
    assert best is not None  # the loop runs at least twice
    return best[1], best[0]


def _whole(g: Graph, k: int, members: list[int], last: Sequence[int]) -> tuple[dict[int, Stage], int]:
    """Pass ``k`` in one stage: retaining if a later pass needs any of its nodes, which then keeps the nodes
    it uses last (but stateless ones, which hold nothing) until the graph is dropped."""
    if all(last[i] == k for i in members):
        return {i: FIRST for i in members}, 0
    kept = sum(1 for i in members if last[i] == k and not stateless(g.nodes[i]))
    return {i: FIRST.next() for i in members}, kept


def _first_bit(mask: int) -> int:
    """The lowest set bit's position: a parameter of several routes of a pass counts for the first."""
    return (mask & -mask).bit_length() - 1
