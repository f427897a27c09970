"""Stage numbers for the nodes of one pass: which engine call of the pass executes each node."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from .._graph import Graph

# NOTE [Stage numbers]
# A pass is split into engine calls ("stages"). Executing a node without retain_graph frees its saved
# tensors, so a node must run in a retaining call before its last use and in a freeing call at it. A pass's
# stages are numbered along gradient flow; the numbers alternate freeing, retaining, freeing, ... (0 frees, 1
# retains, 2 frees, ...), so "the first stage at or after s that retains" is one step at most, and moving a
# node keeps the numbering monotone. That encoding lives in the four functions below and nowhere else: the
# rest of the planner asks `retains(s)`, and the stages it hands on carry an explicit `retain` flag.
# A stateless node (a view, an add: it keeps no tensors) may go in a stage of either kind.


def retains(stage: int) -> bool:
    """Whether stage ``stage`` runs with ``retain_graph=True``."""
    return stage % 2 == 1


def at_or_after(stage: int, retain: bool) -> int:
    """The first stage number from ``stage`` on whose call retains (``retain``) or frees."""
    return stage if retains(stage) == retain else stage + 1


def at_or_before(stage: int, retain: bool) -> int:
    """The last stage number up to ``stage`` whose call retains (``retain``) or frees."""
    return stage if retains(stage) == retain else stage - 1


def chunk_start(position: int) -> int:
    """The first stage of the ``position``-th chunk of shared checkpoint segments (a freeing one; the stages
    of the nodes above every segment, position 0, come before it)."""
    return 2 * position


def number_stages(
    g: Graph,
    members: Sequence[int],
    retained: Mapping[int, bool],
    stateless: Collection[int],
    needed: Collection[int],
    *,
    late: bool,
    lower: Mapping[int, int],
) -> dict[int, int]:
    """Stage numbers for one pass: monotone along gradient flow, retaining where ``retained[i]`` (a
    ``stateless`` node goes in either).

    Args:
        members: the pass's nodes, in topological order.
        retained: node -> whether a later pass uses it (its stage must retain).
        stateless: nodes that keep no tensors.
        needed: the pass's nodes, for membership tests.
        late: as late as possible (each node at the last stage its successors allow), or as early as possible
            (the first stage its predecessors and its ``lower`` bound allow).
        lower: node -> the lowest stage number it may get (``late=False`` only).
    """
    succ = g.succ
    stage: dict[int, int] = {}
    if not late:
        earliest: dict[int, int] = {}
        for i in members:
            base = max(earliest.get(i, 0), lower.get(i, 0))
            s = base if i in stateless else at_or_after(base, retained[i])
            stage[i] = s
            for j, _ in succ[i]:
                if j in needed and earliest.get(j, -1) < s:
                    earliest[j] = s
        return stage
    top = 2 * len(members) + 2  # above any stage: freeing
    for i in reversed(members):
        base = min((stage[j] for j, _ in succ[i] if j in needed), default=top)
        stage[i] = base if i in stateless else at_or_before(base, retained[i])
    low = min(stage.values())
    low = at_or_before(low, False)  # the first stage frees, as in the early numbering
    return {i: s - low for i, s in stage.items()}


def fold_stateless_stages(stage: Mapping[int, int], stateless: Collection[int]) -> dict[int, int]:
    """Move every stage made of stateless nodes only into the next stage (it would be an engine call of its
    own for a few views or adds). The numbering stays monotone: the nodes move together, to a stage their
    successors are at or after."""
    members: dict[int, list[int]] = {}
    for i, s in stage.items():
        members.setdefault(s, []).append(i)
    out = dict(stage)
    for s in sorted(members):
        if s + 1 in members and all(i in stateless for i in members[s]):
            for i in members[s]:
                out[i] = s + 1
            members[s + 1].extend(members.pop(s))
    return out
