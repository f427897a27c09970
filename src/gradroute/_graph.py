"""One walk over the autograd graph of the losses, into integer-indexed adjacency lists.

The planner (``_planner``) works on this structure only; nothing here knows about routes or groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import torch
from torch.autograd.graph import Node, get_gradient_edge

from ._compat import SAVED_ATTRS, SAVED_DATA, SAVED_TENSOR, saved_attrs, saved_state

# the class of a leaf tensor's ``AccumulateGrad`` node, found through the public API
with torch.enable_grad():
    _ACCUMULATE_GRAD: type = type(get_gradient_edge(torch.zeros((), device="cpu", requires_grad=True)).node)


@dataclass(eq=False)
class Graph:
    """The part of an autograd graph reachable from a set of root edges.

    Attributes:
        nodes: every reachable node, indexed by id.
        edges, ends: the edges as the walk records them, flat: node ``i``'s are the pairs ``j, input_nr`` in
            ``edges[ends[i - 1]:ends[i]]`` (from 0 for node 0).
        succ: ``succ[i]`` lists ``(j, input_nr)`` for each non-None ``next_functions`` entry of node ``i``:
            gradient flows from node ``i`` into input slot ``input_nr`` of node ``j`` (made from ``edges``
            on first use: a cached plan needs no adjacency lists).
        topo: node ids in topological order (a node comes before every node it sends gradient to).
        leaf: node id -> the leaf tensor of an ``AccumulateGrad`` node.
        index: node -> id.
        kinds: the node classes present.
        signature: the graph's structure (where the losses enter, node classes, edges, which leaves are the
            given parameters, by identity) as a list: two graphs with equal signatures get the same plan.
        freed: the id of a node whose saved tensors an earlier backward released, or None (see
            :func:`walk`); a graph with one cannot be run.
        followed: only the nodes a cached plan needs are known (``_planner.follow``): ``nodes`` holds None
            elsewhere and ``succ``, ``index`` and ``kinds`` are empty. Nothing can be planned on it.
    """

    nodes: list[Node]
    leaf: dict[int, torch.Tensor]
    index: dict[Node, int]
    signature: list
    kinds: set[type]
    freed: int | None = None
    followed: bool = False
    edges: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    @cached_property
    def succ(self) -> list[list[tuple[int, int]]]:
        edges, out, start = self.edges, [], 0
        for end in self.ends:
            out.append(list(zip(edges[start:end:2], edges[start + 1 : end : 2], strict=True)))
            start = end
        return out

    @cached_property
    def topo(self) -> list[int]:
        """Computed on first use only: a cached plan needs no order."""
        return _topological(self.succ)

    @classmethod
    def of(cls, succ: list[list[tuple[int, int]]], **fields: Any) -> Graph:
        """A graph given by its adjacency lists (``succ``) rather than walked."""
        edges: list[int] = []
        ends: list[int] = []
        for out in succ:
            for j, nr in out:
                edges += (j, nr)
            ends.append(len(edges))
        return cls(edges=edges, ends=ends, **fields)


def root_node(tensor: torch.Tensor) -> Node:
    """The node a backward from ``tensor`` starts at: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    fn = tensor.grad_fn
    return fn if fn is not None else get_gradient_edge(tensor).node


def walk(roots: list[Node], params: dict[int, int], *, probe: bool = True) -> Graph:
    """Collect the graph below ``roots`` with one breadth-first sweep, and find a node freed by a backward.

    ``params`` maps ``id(parameter)`` of the routed groups' parameters to a mark recorded in the signature.
    ``probe=False`` skips the freed check (``Graph.freed`` is then None): for a backward that writes no
    ``.grad``, or whose writes the router can undo (NOTE [Undoing a failed routed backward] in ``_execute.py``).

    NOTE [One walk: structure, signature and the freed check]
    1. This runs on every routed backward, cache hit or not, and is the router's largest fixed cost when the
       host is the bottleneck (torch makes a Python object for each node ``next_functions`` hands out, and the
       nodes' memory is cold after the forward). So everything per node is done in this one loop, with as few
       Python objects and calls as it can: the edges go into one flat list, and the adjacency lists the
       planner reads are made from it on a cache miss only.
    2. The freed check looks only at nodes that keep tensors (their classes have saved attributes), at the
       first defined saved tensor of each: a non-retaining backward releases all of a node's saved tensors at
       once (``node_state``), so one tells for all.
    3. It looks at the whole graph, so a graph freed only in part (another loss's ``.backward()`` freed the
       nodes they share) is refused before any engine call. Where the router can undo a failed backward, the
       check is skipped (``probe=False``), and the engine refuses a freed node when it reaches it.
    """
    index: dict[Node, int] = {}
    nodes: list[Node] = []
    for r in roots:
        if r not in index:
            index[r] = len(nodes)
            nodes.append(r)
    classes: list[type] = []
    edges: list[int] = []  # flat: fewer objects than a list of pairs per node (NOTE above)
    ends: list[int] = []
    leaf: dict[int, torch.Tensor] = {}
    marks: list[int] = []
    freed: int | None = None if probe else -1  # -1: the check below is skipped, at no cost per node
    saved, accumulate, raw = SAVED_ATTRS, _ACCUMULATE_GRAD, SAVED_TENSOR  # looked up once
    fast = SAVED_DATA
    i = 0
    for node in nodes:  # grows while the loop runs: breadth first
        kind = type(node)
        classes.append(kind)
        following = node.next_functions
        if following:
            for fn, nr in following:
                if fn is None:
                    continue
                j = index.get(fn)
                if j is None:
                    j = index[fn] = len(nodes)
                    nodes.append(fn)
                edges.append(j)
                edges.append(nr)
        elif kind is accumulate:  # a leaf
            var = node.variable  # type: ignore[attr-defined]
            leaf[i] = var
            marks.append(i)
            marks.append(params.get(id(var), 0))
        ends.append(len(edges))
        if freed is None:
            names = saved.get(kind)
            if names is None:
                names = saved_attrs(node)  # fills SAVED_ATTRS
            if names:
                # the usual case inline: a first saved tensor that holds its value (``node_state`` otherwise)
                item: Any
                try:
                    item = getattr(node, names[0]) if fast else None
                except RuntimeError:  # a list of saved tensors, released: ``node_state`` tells
                    item = None
                if (type(item) is not raw or item.data is None) and node_state(node, names) == "freed":
                    freed = i
        i += 1
    if freed == -1:
        freed = None
    sig = [[index[r] for r in roots], classes, edges, marks, ends]  # marks at 3 (``signature_marks``)
    return Graph(
        nodes=nodes, leaf=leaf, index=index, signature=sig, kinds=set(classes), freed=freed, edges=edges, ends=ends
    )


def signature_marks(signature: list) -> list[int]:
    """The parameter marks in a walked graph's signature: ``node id, mark`` pairs of its leaves."""
    return signature[3]  # type: ignore[no-any-return]


def node_state(node: Any, names: tuple[str, ...]) -> Literal["live", "freed", "none"]:
    """Whether ``node``'s saved tensors are alive, released by a backward, or tell nothing (all undefined).

    Reads the raw ``SavedTensor`` objects (``names``: ``_compat.saved_attrs``), so no saved-tensor hook (a
    checkpoint's recomputation) runs. One with data (or a hook) is alive; an empty one is either an optional
    tensor never defined (``unpack()`` gives None, before and after a backward: skipped) or released
    (``unpack()`` raises); a list of saved tensors raises when read once released.
    """
    for name in names:
        try:
            item = getattr(node, name)
        except RuntimeError:  # a released list
            return "freed"
        if isinstance(item, (list, tuple)):
            item = next((x for x in item if x is not None), None)
        if item is None:
            continue
        state = saved_state(item)
        if state != "none":
            return state
        # an optional tensor never defined ("none"): it tells nothing either way (unlike the first probe, which
        # stopped here and missed a released node whose first saved tensor is an absent bias)
    return "none"


def reaches(g: Graph, starts: list[int], target: int) -> bool:
    """Whether node ``target`` is reachable from any of the nodes ``starts`` (ids in ``g``)."""
    seen = set(starts)
    frontier = list(starts)
    while frontier:
        i = frontier.pop()
        if i == target:
            return True
        for j, _ in g.succ[i]:
            if j not in seen:
                seen.add(j)
                frontier.append(j)
    return False


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
