"""Step 1, reach: which routes' losses reach which nodes and parameters, and which routes may share a pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._graph import Graph
from .masks import bits, several


@dataclass(frozen=True)
class Reach:
    """What one sweep down the graph from the losses finds (masks over routes, bit ``r`` = route ``r``).

    Attributes:
        owners: leaf node id -> the routes whose parameter the leaf is (0: nobody's).
        reached_by: per node, the routes whose losses reach it.
        counts: ``counts[r][q]``: how many of route ``q``'s parameters route ``r``'s losses reach.
        leaks: per route, the routes owning a parameter it reaches that it does not own itself.
        apart: per route, the routes it must not share a pass with.
    """

    owners: dict[int, int]
    reached_by: list[int]
    counts: list[list[int]]
    leaks: list[int]
    apart: list[int]


def reach(g: Graph, params: Sequence[Sequence[object]], roots: Sequence[Sequence[int]], *, merge_shared: bool) -> Reach:
    """Sweep the graph from every route's loss nodes ``roots[r]``; ``params[r]`` are route ``r``'s parameters.

    Two routes must run apart when one reaches a parameter the other owns alone (a merged pass would write
    its gradient there), and, without ``merge_shared``, when they share a parameter (each route's gradient
    is reported on its own).
    """
    by_param: dict[int, int] = {}  # id(parameter) -> the routes owning it
    for r, ps in enumerate(params):
        for p in ps:
            by_param[id(p)] = by_param.get(id(p), 0) | (1 << r)
    owners = {i: by_param.get(id(v), 0) for i, v in g.leaf.items()}
    reached_by = _reached_by(g, roots)
    n_routes = len(params)
    counts = [[0] * n_routes for _ in range(n_routes)]
    leaks = [0] * n_routes
    apart = [0] * n_routes
    for i, owning in owners.items():
        reaching = reached_by[i]
        if not reaching or not owning:
            continue
        for r in bits(reaching):
            for q in bits(owning):
                counts[r][q] += 1
        strangers = reaching & ~owning
        if strangers:
            for r in bits(strangers):
                apart[r] |= owning
                leaks[r] |= owning
            for q in bits(owning):
                apart[q] |= strangers
    if not merge_shared:
        for owning in by_param.values():
            if several(owning):
                for r in bits(owning):
                    apart[r] |= owning & ~(1 << r)
    return Reach(owners=owners, reached_by=reached_by, counts=counts, leaks=leaks, apart=apart)


def _reached_by(g: Graph, roots: Sequence[Sequence[int]]) -> list[int]:
    """Per node, the routes whose loss nodes it is below (one pass in topological order)."""
    out = [0] * len(g.nodes)
    for r, ids in enumerate(roots):
        for i in ids:
            out[i] |= 1 << r
    succ = g.succ
    for i in g.topo:
        f = out[i]
        if f:
            for j, _ in succ[i]:
                out[j] |= f
    return out
