"""Stage numbers for the nodes of one pass: which engine call of the pass executes each node."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from .._graph import Graph

# NOTE [Stage numbers]
# A pass is split into engine calls ("stages"). Executing a node without retain_graph frees its saved
# tensors, so a node must run in a retaining call before its last use and in a freeing call at it. A pass's
# stages are numbered along gradient flow and each carries its kind, `retain`. The kinds alternate: FIRST
# frees, its `next()` retains, the one after frees, ... so "the first stage at or after s that retains" is
# one step at most, and moving a node keeps the numbering monotone. A stage is made from another one
# (`next()`, `previous()`, `shifted()`) or as the k-th freeing stage (`freeing(k)`), never from a bare number:
# the kind comes with the number, and nothing reads it off the number. A stateless node (a view, an add: it
# keeps no tensors) may go in a stage of either kind.


class Stage(NamedTuple):
    """One engine call of a pass, as numbered while the pass is split: its position along gradient flow and
    whether it runs with ``retain_graph=True``.

    A named tuple rather than a frozen dataclass: the planner compares, hashes and makes stages per node and
    per edge, and a tuple does that in C, where a dataclass does it in Python.

    Attributes:
        number: the position, from 0 (ordering compares it first; two stages of one numbering with the same
            number have the same ``retain``).
        retain: whether the call retains (its nodes are needed by a later pass) or frees.
    """

    number: int
    retain: bool

    def next(self) -> Stage:
        """The stage after this one (of the other kind)."""
        return Stage(self.number + 1, not self.retain)

    def previous(self) -> Stage:
        """The stage before this one (of the other kind)."""
        return Stage(self.number - 1, not self.retain)

    def shifted(self, origin: Stage) -> Stage:
        """This stage renumbered so that ``origin``, a freeing stage at or before it, becomes :data:`FIRST`."""
        if origin.retain:
            raise ValueError(f"`origin` must be a freeing stage, got {origin}")
        return Stage(self.number - origin.number, self.retain)


FIRST = Stage(0, retain=False)
"""The first stage of a pass: it frees."""


def at_or_after(stage: Stage, retain: bool) -> Stage:
    """The first stage from ``stage`` on whose call retains (``retain``) or frees."""
    return stage if stage.retain == retain else stage.next()


def at_or_before(stage: Stage, retain: bool) -> Stage:
    """The last stage up to ``stage`` whose call retains (``retain``) or frees."""
    return stage if stage.retain == retain else stage.previous()


def freeing(k: int) -> Stage:
    """The ``k``-th freeing stage after :data:`FIRST` (``freeing(0)`` is FIRST): the kinds alternate, so it is
    ``2 * k`` stages on."""
    return Stage(2 * k, retain=False)


def chunk_start(position: int) -> Stage:
    """The first stage of the ``position``-th chunk of shared checkpoint segments, a freeing one (the stages of
    the nodes above every segment, position 0, come before it)."""
    return freeing(position)


def ladder(last: Stage) -> list[Stage]:
    """The stages from :data:`FIRST` to ``last``, in order (the numbers in between that no node has too)."""
    stages = [FIRST]
    while stages[-1] < last:
        stages.append(stages[-1].next())
    if stages[-1] != last:
        raise ValueError(f"`last` must be a stage numbered from FIRST, got {last}")
    return stages


def number_stages(
    g: Graph,
    members: Sequence[int],
    retained: Mapping[int, bool],
    stateless: Collection[int],
    needed: Collection[int],
    *,
    late: bool,
    lower: Mapping[int, Stage],
) -> dict[int, Stage]:
    """Stage numbers for one pass: monotone along gradient flow, retaining where ``retained[i]`` (a
    ``stateless`` node goes in either).

    Args:
        members: the pass's nodes, in topological order.
        retained: node -> whether a later pass uses it (its stage must retain).
        stateless: nodes that keep no tensors.
        needed: the pass's nodes, for membership tests.
        late: as late as possible (each node at the last stage its successors allow), or as early as possible
            (the first stage its predecessors and its ``lower`` bound allow).
        lower: node -> the lowest stage it may get (``late=False`` only).
    """
    succ = g.succ
    stage: dict[int, Stage] = {}
    if not late:
        earliest: dict[int, Stage] = {}
        for i in members:
            base = max(earliest.get(i, FIRST), lower.get(i, FIRST))
            s = base if i in stateless else at_or_after(base, retained[i])
            stage[i] = s
            for j, _ in succ[i]:
                if j in needed and (j not in earliest or earliest[j] < s):
                    earliest[j] = s
        return stage
    top = freeing(len(members) + 1)  # above any stage a node can get
    for i in reversed(members):
        base = min((stage[j] for j, _ in succ[i] if j in needed), default=top)
        stage[i] = base if i in stateless else at_or_before(base, retained[i])
    low = min(stage.values())
    low = at_or_before(low, False)  # the first stage frees, as in the early numbering
    return {i: s.shifted(low) for i, s in stage.items()}


def fold_stateless_stages(stage: Mapping[int, Stage], stateless: Collection[int]) -> dict[int, Stage]:
    """Move every stage made of stateless nodes only into the next stage (it would be an engine call of its
    own for a few views or adds). The numbering stays monotone: the nodes move together, to a stage their
    successors are at or after."""
    members: dict[Stage, list[int]] = {}
    for i, s in stage.items():
        members.setdefault(s, []).append(i)
    out = dict(stage)
    for s in sorted(members):
        after = s.next()
        if after in members and all(i in stateless for i in members[s]):
            for i in members[s]:
                out[i] = after
            members[after].extend(members.pop(s))
    return out


def pull_stateless(
    g: Graph,
    members: Sequence[int],
    stage: Mapping[int, Stage],
    stateless: Collection[int],
    lower: Mapping[int, Stage],
) -> dict[int, Stage]:
    """Move stateless nodes up into their predecessors' stage where that leaves fewer gradient edges cut.

    NOTE [Stateless nodes at a cut]
    A tensor consumed by several ops reaches each through a view or a transpose, and its gradient comes back in
    as many edges, which the engine sums into one. Numbered as late as possible, those stateless nodes land in
    the later call and the cut runs above them: the earlier call captures one gradient per consumer and hands
    each to the later one. Run in the earlier call, they leave one edge, as a hand cut at the tensor does: one
    captured gradient held between the calls, and one hand-off.
      1. A node moves unless that cuts more distinct edges (``(node, input slot)``). Ties move too: the first of
         a tensor's consumers to move cuts as many edges as before, the others then fewer.
      2. It moves to the latest stage of its predecessors, and not at all if that is below its ``lower`` bound:
         that stage has a call already, so no call is added and the numbering stays monotone.
      3. A stateless node may run in a call of either kind (NOTE [Stage numbers]), so the move frees nothing
         early and keeps nothing longer.

    Args:
        members: the pass's nodes, in topological order (predecessors first).
        stage: each member's stage.
        stateless: the members that keep no tensors.
        lower: node -> the lowest stage it may get.
    """
    out = dict(stage)
    preds: dict[int, list[tuple[int, int]]] = {}
    crossing: dict[tuple[int, int], int] = {}  # (node, input slot) -> edges into it from an earlier stage
    for i in members:
        for j, nr in g.succ[i]:
            if j in out:
                preds.setdefault(j, []).append((i, nr))
                if out[j] > out[i]:
                    crossing[j, nr] = crossing.get((j, nr), 0) + 1
    for i in members:
        if i not in stateless or i not in preds:
            continue
        s = out[i]
        to = max(out[p] for p, _ in preds[i])  # a predecessor's stage: it has a call already
        if to >= s or to < lower.get(i, FIRST):
            continue
        gained = {(j, nr) for j, nr in g.succ[i] if j in out and not crossing.get((j, nr))}
        lost = {(i, nr) for p, nr in preds[i] if out[p] < s} - {(i, nr) for p, nr in preds[i] if out[p] < to}
        if len(gained) > len(lost):  # a tie moves too: the consumers of one tensor move one by one
            continue
        for p, nr in preds[i]:
            if to <= out[p] < s:
                crossing[i, nr] -= 1
        for j, nr in g.succ[i]:
            if j in out and out[j] <= s:  # not crossing before (out[j] >= s): crossing now
                crossing[j, nr] = crossing.get((j, nr), 0) + 1
        out[i] = to
    return out
