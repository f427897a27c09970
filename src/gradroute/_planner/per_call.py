"""Step 8, recompute per call: the checkpoint segments better recomputed once per engine call than shared."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._compat import node_sequence_nr
from .._graph import Graph
from .chunks import segment_of

# NOTE [Shared or per-call recomputation]
# A tensor that plain, un-checkpointed code hands to ops on both sides of a segment (diffusers' skip connections
# leave from its downsamplers and transformer models) has one node for both sides, so the planner cannot cut
# there and must put the segments in between into one call. One retaining call then recomputes a whole run of
# segments, and all of it stays alive until the other pass has been through it.
#   1. The planner sees it coming: the bytes that shared recomputations would hold at once after a call,
#      against the largest segment's times ``PlanOptions.held_factor`` (``recompute_per_call``).
#   2. The segments holding the most are then recomputed once per engine call instead, each recomputed tensor
#      dropped once its node has used it, as torch.utils.checkpoint does: torch's cost in time, no pile-up. The
#      executor hands their nodes to the session (``Session.recompute_per_call``), which gradroute.checkpoint's
#      unpack hook reads (NOTE [Recomputation keys] in _checkpoint/_hooks.py).
#   3. The plan says so in a note, and the router warns (NOTE [Advice on missing cut points] in
#      _checkpoint/_advice.py): ``cut_points`` or ``checkpoint_modules`` give the planner the cuts it needs to
#      interleave instead (NOTE [Interleaving shared segments] in chunks.py).


@dataclass(frozen=True)
class PerCall:
    """The segments picked for recomputation once per call.

    Attributes:
        nodes: their autograd node ids, sorted.
        segments: how many segments they make.
        held: the most bytes the other (shared) segments' recomputations hold at once after a call: the
            plan's own estimate of what it keeps beyond a plain backward (read by the measured plan choice).
    """

    nodes: tuple[int, ...] = ()
    segments: int = 0
    held: int = field(default=0, compare=False)


def recompute_per_call(
    g: Graph,
    call_members: Sequence[Sequence[int]],
    ranges: Sequence[tuple[int, int]],
    node_bytes: Callable[[Any], int],
    factor: float,
) -> PerCall:
    """Pick the segments (``ranges``: sequence-number ranges ``[first, end)``, sorted) to recompute per call.

    While the bytes that shared recomputations hold after some call exceed ``factor`` times the largest
    segment's, the segments holding the most there are picked (``factor`` 0: every segment that more than
    one call enters). ``node_bytes(node)``: what a recomputation of the node's segment keeps alive for it.
    """
    if not ranges:
        return PerCall()
    starts = [a for a, _ in ranges]
    first: dict[int, int] = {}  # segment -> the first call through it
    members: dict[int, dict[int, int]] = {}  # segment -> node -> its last call
    for t, mem in enumerate(call_members):
        for i in mem:
            r = segment_of(node_sequence_nr(g.nodes[i]), ranges, starts)
            if r >= 0:
                first.setdefault(r, t)
                members.setdefault(r, {})[i] = t
    nbytes = {i: node_bytes(g.nodes[i]) for m in members.values() for i in m}
    size = {r: sum(nbytes[i] for i in m) for r, m in members.items()}
    if not size or not max(size.values()):
        return PerCall()
    budget = factor * max(size.values())
    held = {r: _held(m, first[r], nbytes, len(call_members)) for r, m in members.items()}
    out: set[int] = set()
    for t in range(len(call_members)):
        live = sorted((held[r][t], r) for r in held if r not in out and held[r][t])
        total = sum(b for b, _ in live)
        while total > budget and live:
            b, r = live.pop()  # the segment holding the most at this call
            out.add(r)
            total -= b
    peak = max((sum(row[t] for r, row in held.items() if r not in out) for t in range(len(call_members))), default=0)
    return PerCall(nodes=tuple(sorted(i for r in out for i in members[r])), segments=len(out), held=peak)


def _held(last_call: dict[int, int], first: int, nbytes: dict[int, int], n_calls: int) -> list[int]:
    """Per call, the bytes of one segment's shared recomputation alive after it (made by call ``first``, each
    node's part freed by its last call)."""
    diff = [0] * (n_calls + 1)
    for i, t_last in last_call.items():
        if t_last > first and nbytes[i]:
            diff[first] += nbytes[i]
            diff[t_last] -= nbytes[i]
    acc, row = 0, []
    for t in range(n_calls):
        acc += diff[t]
        row.append(acc)
    return row
