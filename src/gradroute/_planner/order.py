"""Step 4, order: the passes' execution order, and the pass at which each node is used for the last time."""

from __future__ import annotations

from .._graph import Graph
from .masks import bits
from .needs import Needs


def order_passes(g: Graph, need: Needs, n_passes: int) -> tuple[int, ...]:
    """The passes in execution order.

    A pass whose weight-gradient nodes (those feeding one of its parameters) another pass also needs goes after
    that pass: its weight gradients are then computed while the shared activations are being freed, not while
    they are retained. Where the constraints form a cycle (parameters shared across passes), the least
    constrained pass goes first.
    """
    succ, needed_by, targets = g.succ, need.needed_by, need.targets
    after = [0] * n_passes  # per pass, the passes it should run after
    for i, nd in enumerate(needed_by):
        if not nd:
            continue
        w = 0
        for j, _ in succ[i]:
            w |= targets.get(j, 0)
        w &= nd
        for k in bits(w):
            after[k] |= nd & ~(1 << k)
    order: list[int] = []
    placed = 0
    while len(order) < n_passes:
        ready = [k for k in range(n_passes) if not (placed >> k) & 1 and not (after[k] & ~placed)]
        if not ready:
            left = (k for k in range(n_passes) if not (placed >> k) & 1)
            ready = [min(left, key=lambda k: bin(after[k] & ~placed).count("1"))]
        k = ready[0]
        order.append(k)
        placed |= 1 << k
    return tuple(order)


def last_use(need: Needs, order: tuple[int, ...]) -> list[int]:
    """Per node, the pass (by index, not position) that executes it last; -1 for nodes no pass executes."""
    position = {k: p for p, k in enumerate(order)}
    last = [-1] * len(need.needed_by)
    for i, nd in enumerate(need.needed_by):
        if nd:
            last[i] = max(bits(nd), key=position.__getitem__)
    return last
