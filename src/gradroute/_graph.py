"""One walk over the autograd graph of the losses, into integer-indexed adjacency lists.

The planner (``_planner``) works on this structure only; nothing here knows about routes or groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ._compat import saved_attrs


@dataclass(eq=False)
class Graph:
    """The part of an autograd graph reachable from a set of root edges.

    Attributes:
        nodes: every reachable node, indexed by id.
        succ: ``succ[i]`` lists ``(j, input_nr)`` for each non-None ``next_functions`` entry of node ``i``:
            gradient flows from node ``i`` into input slot ``input_nr`` of node ``j``.
        topo: node ids in topological order (a node comes before every node it sends gradient to).
        leaf: node id -> the leaf tensor of an ``AccumulateGrad`` node.
        index: node -> id.
        kinds: the node classes present.
        signature: the graph's structure as a flat list (node classes, edges, which leaves are the given
            parameters, by identity): two graphs with equal signatures get the same plan.
    """

    nodes: list[Node]
    succ: list[list[tuple[int, int]]]
    leaf: dict[int, torch.Tensor]
    index: dict[Node, int]
    signature: list
    kinds: set[type]
    _topo: list[int] | None = None

    @property
    def topo(self) -> list[int]:
        """Computed on first use only: a cached plan needs no order."""
        if self._topo is None:
            self._topo = _topological(self.succ)
        return self._topo


def root_edge(tensor: torch.Tensor) -> GradientEdge:
    """The gradient edge a backward from ``tensor`` starts at (its ``grad_fn``, or its ``AccumulateGrad``)."""
    return get_gradient_edge(tensor)


def walk(roots: list[Node], params: dict[int, int]) -> Graph:
    """Collect the graph below ``roots`` with one breadth-first sweep.

    ``params`` maps ``id(parameter)`` of the routed groups' parameters to a mark recorded in the signature.
    """
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    for r in roots:
        if r not in index:
            index[r] = len(nodes)
            nodes.append(r)
    succ: list[list[tuple[int, int]]] = []
    sig: list = [len(roots), *(index[r] for r in roots)]
    kinds: set[type] = set()
    i = 0
    while i < len(nodes):
        node = nodes[i]
        kind = type(node)
        kinds.add(kind)
        out: list[tuple[int, int]] = []
        for fn, nr in node.next_functions:
            if fn is None:
                continue
            j = index.get(fn)
            if j is None:
                j = len(nodes)
                index[fn] = j
                nodes.append(fn)
            out.append((j, nr))
        sig.append(kind)
        sig.append(out)
        succ.append(out)
        i += 1
    leaf: dict[int, torch.Tensor] = {}
    for i, out in enumerate(succ):
        if not out:
            var = getattr(nodes[i], "variable", None)
            if isinstance(var, torch.Tensor):
                leaf[i] = var
                sig.append(i)
                sig.append(params.get(id(var), 0))
    return Graph(nodes=nodes, succ=succ, leaf=leaf, index=index, signature=sig, kinds=kinds)


def _topological(succ: list[list[tuple[int, int]]]) -> list[int]:
    """Kahn's algorithm: every node before the nodes it sends gradient to."""
    indeg = [0] * len(succ)
    for out in succ:
        for j, _ in out:
            indeg[j] += 1
    ready = [i for i in range(len(succ)) if indeg[i] == 0]
    topo: list[int] = []
    while ready:
        i = ready.pop()
        topo.append(i)
        for j, _ in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return topo


_STATELESS: dict[type, bool] = {}


def stateless(node: Any) -> bool:
    """Whether an autograd node keeps no tensors for its backward (a view, a transpose, an add...).

    Such a node can run in any number of engine calls, retaining or not: freeing it frees nothing. Only nodes
    generated from ``derivatives.yaml`` qualify (they keep every tensor in a ``SavedVariable``, exposed as
    ``_raw_saved_*``); ``CopySlices``, custom Functions and C++ nodes never do.
    """
    cls = type(node)
    out = _STATELESS.get(cls)
    if out is None:
        name = node.name()
        out = name[:-1].endswith("Backward") and name[-1].isdigit() and not saved_attrs(node)
        _STATELESS[cls] = out
    return out
