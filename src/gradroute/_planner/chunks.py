"""Step 5, chunks: where passes through a shared ``gradroute.checkpoint`` segment are cut, to interleave."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .._compat import node_sequence_nr
from .._graph import Graph, stateless
from .masks import several

# NOTE [Interleaving shared segments]
# A gradroute.checkpoint segment that several passes enter is recomputed once and shared: its recomputed tensors
# live from the first call through a node until the call that frees it. If one retaining call went down the
# whole segment before the other pass started, the whole recomputation would be alive at once. So:
#   1. The passes are cut between chunks of the segment and their calls interleave chunk by chunk (schedule.py):
#      the text encoder's pass through the top chunk of segment k with retain, then the UNet's pass through it,
#      freeing it, then the next chunk, ..., then segment k-1. Each chunk's recomputation is freed as the passes
#      go down, and a retaining call holds about one chunk more than a plain backward would.
#   2. A chunk is at least ``PlanOptions.chunk`` nodes and ends at a clean line, one that no tensor crosses with
#      consumers on both sides (between two layers of a block, not inside a residual block): otherwise the cut
#      between the chunks would not be clean either (NOTE [Why a cut can be unclean] in conflicts.py).
#   3. Cuts at a segment's boundary need an edge per consumer (NOTE [A view per consumer] in
#      _checkpoint/_views.py); a segment's nodes are recognised by their sequence numbers (NOTE [Segment
#      registry] in _checkpoint/_registry.py).
#   4. Inside a chunk, the first call keeps what the next needs, except what cheap ops can remake (NOTE [Remade
#      tensors] in _checkpoint/_remakes.py). What stays above a plain backward's peak is what matrix products,
#      convolutions, norms and attention made in one chunk, and the second cotangent: at every cut, both passes'
#      gradients are alive.
#   5. Where the passes cannot interleave, the segments are recomputed per call instead (NOTE [Shared or
#      per-call recomputation] in per_call.py).


def segment_of(seq: int, ranges: Sequence[tuple[int, int]], starts: Sequence[int]) -> int:
    """The index of the range ``[first, end)`` of ``ranges`` holding sequence number ``seq``, or -1."""
    r = bisect.bisect_right(starts, seq) - 1
    return r if r >= 0 and seq < ranges[r][1] else -1


def chunk_shared_segments(
    g: Graph, needed_by: Sequence[int], ranges: Sequence[tuple[int, int]], chunk: int
) -> dict[int, int]:
    """The nodes of the segments ``ranges`` that more than one pass enters -> their chunk's position.

    ``ranges`` are the live segments' sequence-number ranges ``[first, end)``, sorted. Positions count in
    backward order: 1 is the chunk created last; 0 is left to the nodes above every segment. A segment is
    split into chunks of at least ``chunk`` nodes (by sequence number) at clean lines only: a line is clean
    when no tensor is consumed by ops on both sides of it (a residual stream inside a block is not; the line
    between two blocks is). Consumers that are views (stateless, one input) do not count: the planner moves a
    view to its input's side and cuts above it. Empty when no segment is shared.
    """
    if not ranges:
        return {}
    nodes = g.nodes
    starts = [a for a, _ in ranges]
    seq: dict[int, int] = {}
    of: dict[int, int] = {}  # node -> its segment
    shared: set[int] = set()
    for i, nd in enumerate(needed_by):
        if nd:
            s = seq[i] = node_sequence_nr(nodes[i])
            r = segment_of(s, ranges, starts)
            if r >= 0:
                of[i] = r
                if several(nd):
                    shared.add(r)
    if not shared:
        return {}
    events = _span_events(g, seq)
    by_segment: dict[int, list[int]] = {r: [] for r in shared}
    for i, r in of.items():
        if r in by_segment:
            by_segment[r].append(i)
    out: dict[int, int] = {}
    position = 1
    for r in sorted(shared, reverse=True):
        members = sorted(by_segment[r], key=seq.__getitem__)  # ascending: the sweep goes up
        clean = _clean_lines(members, seq, events)
        count = 0
        for p in range(len(members) - 1, -1, -1):  # from the top of the segment down
            out[members[p]] = position
            count += 1
            if count >= chunk and p > 0 and clean[p - 1]:
                position += 1
                count = 0
        position += 1
    return out


def _span_events(g: Graph, seq: dict[int, int]) -> list[tuple[int, int]]:
    """Each producer's consumers span ``(lowest, highest]`` in sequence numbers, where no line is clean: the
    spans as sorted (line, +1 open / -1 close) events."""
    nodes, succ, leaf = g.nodes, g.succ, g.leaf
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for i, s in seq.items():
        if len(succ[i]) == 1 and stateless(nodes[i]):
            continue
        for j, _ in succ[i]:
            if j not in leaf:
                lo[j] = min(lo.get(j, s), s)
                hi[j] = max(hi.get(j, s), s)
    spans = [j for j in lo if lo[j] < hi[j]]
    return sorted([(lo[j] + 1, 1) for j in spans] + [(hi[j] + 1, -1) for j in spans])


def _clean_lines(members: list[int], seq: dict[int, int], events: list[tuple[int, int]]) -> list[bool]:
    """``clean[p]``: no span contains the line between ``members[p]`` and ``members[p + 1]`` (ascending)."""
    clean = [False] * len(members)
    k = depth = 0
    for p in range(len(members) - 1):
        line = seq[members[p + 1]]
        while k < len(events) and events[k][0] <= line:
            depth += events[k][1]
            k += 1
        clean[p] = depth == 0
    return clean
