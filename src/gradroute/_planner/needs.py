"""Step 3, needs: the nodes each pass executes and the parameters it accumulates into."""

from __future__ import annotations

from dataclasses import dataclass

from .._graph import Graph
from .passes import Passes
from .reach import Reach


@dataclass(frozen=True)
class Needs:
    """Masks over passes (bit ``k`` = pass ``k``).

    Attributes:
        needed_by: per node, the passes that execute it: it lies on a path from one of their losses to one of
            their parameters, which is exactly what the engine executes for ``backward(inputs=params)``. 0 for
            leaves.
        targets: leaf node id -> the passes that accumulate into it (a route of the pass owns and reaches it).
    """

    needed_by: list[int]
    targets: dict[int, int]


def needs(g: Graph, found: Reach, passes: Passes) -> Needs:
    """Intersect what each pass's losses reach (down) with what reaches its targets (up)."""
    reached_by, to_pass = found.reached_by, passes.of_routes
    targets = {i: to_pass(m & reached_by[i]) for i, m in found.owners.items() if m & reached_by[i]}
    n = len(g.nodes)
    leaf, succ = g.leaf, g.succ
    reaches_target = [0] * n  # per node, the passes one of whose targets it reaches
    for i, t in targets.items():
        reaches_target[i] = t
    for i in reversed(g.topo):
        if i in leaf:
            continue
        b = 0
        for j, _ in succ[i]:
            b |= reaches_target[j]
        reaches_target[i] = b
    needed_by = [0] * n
    for i in range(n):
        if i not in leaf:
            needed_by[i] = to_pass(reached_by[i]) & reaches_target[i]
    return Needs(needed_by=needed_by, targets=targets)
