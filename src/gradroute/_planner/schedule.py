"""Step 7, schedule: the passes' calls interleaved into one sequence, downstream work first."""

from __future__ import annotations

from collections.abc import Sequence

from .._compat import node_sequence_nr
from .._graph import Graph, stateless
from .stage import PassStages


def schedule(g: Graph, per_pass: Sequence[PassStages], roots: Sequence[Sequence[int]]) -> PassStages:
    """Interleave the passes' calls (given in pass order) as a plain backward would order the work.

    Constraints: a pass's calls run in order, and a retaining call through a node runs before the call that
    frees it. Among the calls that may run, the one reaching the most recently created node that holds
    something (highest autograd sequence number) goes first: e.g. the text encoder's deferred part runs after
    the UNet pass, so the UNet's activations are freed before the text encoder's weight gradients are
    allocated, even where autocast's casts of the text encoder's output, made inside the UNet, start it.

    Returns all calls (``index`` still 0) with their members, in execution order.
    """
    calls = [c for p in per_pass for c in p.calls]
    members = [m for p in per_pass for m in p.members]
    kept = sum(p.kept for p in per_pass)
    n = len(calls)
    if n <= 1:
        return PassStages(calls=tuple(calls), members=tuple(members), kept=kept)
    deps = _dependencies(calls, members)
    key = [_recency(g, c.wiring.losses, c.wiring.edges_in, m, roots) for c, m in zip(calls, members)]
    done: set[int] = set()
    order: list[int] = []
    while len(order) < n:
        ready = [c for c in range(n) if c not in done and deps[c] <= done]
        c = max(ready, key=lambda c: (key[c], -c))
        done.add(c)
        order.append(c)
    return PassStages(calls=tuple(calls[c] for c in order), members=tuple(members[c] for c in order), kept=kept)


def _dependencies(calls: Sequence, members: Sequence[Sequence[int]]) -> list[set[int]]:
    """Per call, the calls that must run before it (its pass's previous call; retaining calls through the
    nodes it frees)."""
    n = len(calls)
    frees: dict[int, int] = {}
    for c, call in enumerate(calls):
        if not call.retain:
            for v in members[c]:
                frees[v] = c
    deps: list[set[int]] = [set() for _ in range(n)]
    for c in range(1, n):
        if calls[c].wiring.pass_index == calls[c - 1].wiring.pass_index:
            deps[c].add(c - 1)
    for c, call in enumerate(calls):
        if call.retain:
            for v in members[c]:
                f = frees.get(v)
                if f is not None and f != c:
                    deps[f].add(c)
    return deps


def _recency(
    g: Graph,
    losses: Sequence[tuple[int, int]],
    edges_in: Sequence[tuple[int, int]],
    members: Sequence[int],
    roots: Sequence[Sequence[int]],
) -> int:
    """The highest sequence number among the call's nodes that hold something; stateless ones (views, adds,
    autocast's casts of a tensor consumed downstream) run wherever convenient and say nothing about where a
    call is. Without any, the highest among the nodes it starts from."""
    held = [_sequence_nr(g, i) for i in members if not stateless(g.nodes[i])]
    if held:
        return max(held)
    starts = [roots[r][t] for r, t in losses] + [j for j, _ in edges_in]
    return max((_sequence_nr(g, i) for i in starts), default=-1)


def _sequence_nr(g: Graph, i: int) -> int:
    try:
        return node_sequence_nr(g.nodes[i])
    except (AttributeError, RuntimeError):
        return -1
