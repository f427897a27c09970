"""Finding the few nodes a cached plan starts from in a new graph of the same structure, without walking it all.

The plan cache uses this for ``Router(static_graph=True)`` and, by default, for graphs whose plan is exact on any
graph; see NOTE [Static graphs] and NOTE [Following without a promise] in ``_planner/cache.py``.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

from ._compat import saved_attrs
from ._graph import Graph, node_state

_PROBE = 2  # nodes the freed check of a located graph reads


@dataclass(frozen=True)
class Paths:
    """How to reach chosen nodes of any graph of one signature from its roots, and what to check on the way.

    Attributes:
        roots: per root (in the order given to the walk), its node id and class.
        steps: ``(node id, parent id, position in the parent's next_functions, class)``, parents first: each
            node is the first through which the walk found it, so the paths are the shortest.
        saved: the ids of a few nodes that keep tensors and that the last engine call of the plan runs
            (:func:`freed_probe`), on the paths: the freed check looks at these only, up to the first that holds
            a defined one (a second backward of the same losses freed them all).
        size: the number of nodes of the graph.
    """

    roots: tuple[tuple[int, type], ...]
    steps: tuple[tuple[int, int, int, type], ...]
    saved: tuple[int, ...]
    size: int


def freed_probe(g: Graph, starts: Sequence[int], ends: Iterable[int]) -> tuple[int, ...]:
    """The nodes for the freed check of graphs like ``g`` whose last engine call runs from the nodes ``starts`` into
    ``ends``: the first few that keep tensors on the shortest path between them that has any (the call runs every
    node on such a path and, not retaining, frees it: a second backward of the same losses finds it freed, where
    nodes run only by earlier, retaining calls still hold theirs). Else the first few of ``g`` that keep tensors
    (breadth first)."""
    targets = set(ends)
    parent = dict.fromkeys(starts, -1)
    frontier = collections.deque(starts)
    while frontier:
        i = frontier.popleft()
        if i in targets:
            chain = []
            k = i
            while k != -1:
                chain.append(k)
                k = parent[k]
            found = tuple(itertools.islice((j for j in reversed(chain) if saved_attrs(g.nodes[j])), _PROBE))
            if found:
                return found
        for j, _ in g.succ[i]:
            if j not in parent:
                parent[j] = i
                frontier.append(j)
    return tuple(itertools.islice((j for j, n in enumerate(g.nodes) if saved_attrs(n)), _PROBE))


def paths(g: Graph, roots: Sequence[Node], wanted: Iterable[int], probe: Sequence[int] = ()) -> Paths:
    """The paths from ``roots`` (the nodes ``g`` was walked from) to the nodes ``wanted`` of ``g``, and to the nodes
    ``probe`` that the freed check looks at (:func:`freed_probe`)."""
    root_ids = {g.index[r] for r in roots}
    keeping = tuple(probe)
    parent: dict[int, int] = {}
    for i, out in enumerate(g.succ):  # ids are in breadth-first order: the first parent seen is the walk's
        for j, _ in out:
            if j not in parent and j not in root_ids:
                parent[j] = i
    on_path: set[int] = set()
    for j in (*wanted, *keeping):
        while j not in on_path and j not in root_ids:
            on_path.add(j)
            j = parent[j]
    steps = []
    for j in sorted(on_path):  # a parent's id is below its children's
        i = parent[j]
        pos = next(k for k, (fn, _) in enumerate(g.nodes[i].next_functions) if fn is g.nodes[j])
        steps.append((j, i, pos, type(g.nodes[j])))
    return Paths(
        roots=tuple((g.index[r], type(r)) for r in roots),
        steps=tuple(steps),
        saved=keeping,
        size=len(g.nodes),
    )


def follow(p: Paths, roots: Sequence[Node]) -> list[Node | None] | None:
    """The nodes on the paths of ``p`` in the graph below ``roots``, by id (None elsewhere), or None where a node
    on the way has another class than in the graph ``p`` was made from (the graph changed)."""
    nodes: list[Node | None] = [None] * p.size
    for (i, kind), root in zip(p.roots, roots):
        if type(root) is not kind:
            return None
        nodes[i] = root
    try:
        for j, i, pos, kind in p.steps:
            node = nodes[i].next_functions[pos][0]  # type: ignore[union-attr]
            if type(node) is not kind:
                return None
            nodes[j] = node  # type: ignore[call-overload]
    except IndexError:  # fewer next functions than in the graph the paths were made from
        return None
    return nodes


def located(p: Paths, roots: Sequence[Node], signature: list, leaf: dict[int, torch.Tensor]) -> Graph | None:
    """A graph holding only the nodes on the paths of ``p`` (and ``leaf``), with the cached ``signature``; its
    ``freed`` is a node on the paths an earlier backward freed. None where the graph changed on the way."""
    nodes = follow(p, roots)
    if nodes is None:
        return None
    return Graph(
        nodes=nodes,  # type: ignore[arg-type]
        leaf=leaf,
        index={},
        signature=signature,
        kinds=set(),
        freed=_freed(p, nodes),
        located=True,
    )


def _freed(p: Paths, nodes: list[Node | None]) -> int | None:
    """The first node of ``p.saved`` that tells (holds a defined saved tensor), if a backward freed it."""
    for j in p.saved:
        state = node_state(nodes[j], saved_attrs(nodes[j]))
        if state != "none":
            return j if state == "freed" else None
    return None
