"""Hand-built graphs for the planner's unit tests: adjacency lists in, a :class:`gradroute._graph.Graph` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gradroute._graph import Graph


class SavingNode:
    """A node that keeps a tensor for its backward (as ``MulBackward0`` does)."""

    _raw_saved_self = None

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def name(self) -> str:
        return "MulBackward0"

    def _sequence_nr(self) -> int:
        return self.seq


class ViewNode(SavingNode):
    """A node that keeps nothing (as ``ViewBackward0`` does): the planner may run it in any call."""

    _raw_saved_self = None

    def name(self) -> str:
        return "ViewBackward0"

    def __dir__(self) -> list[str]:
        return [a for a in super().__dir__() if not a.startswith("_raw_saved_")]


class LeafNode(SavingNode):
    """An ``AccumulateGrad`` node: no successors, its ``variable`` a leaf tensor."""

    def __init__(self, seq: int, variable: torch.Tensor) -> None:
        super().__init__(seq)
        self.variable = variable

    def name(self) -> str:
        return "torch::autograd::AccumulateGrad"


def graph(
    succ: Mapping[int, Sequence[int]],
    leaves: Mapping[int, torch.Tensor],
    *,
    views: Sequence[int] = (),
    seq: Mapping[int, int] | None = None,
) -> Graph:
    """Nodes ``0..n-1``: ``succ[i]`` lists the nodes ``i`` sends gradient to (each node has one input slot, 0),
    ``leaves`` the leaf tensors of the ``AccumulateGrad`` nodes, ``views`` the stateless nodes. Sequence numbers
    default to ``n - i`` (node 0, a loss, made last)."""
    n = 1 + max([*succ, *leaves, *(j for js in succ.values() for j in js)])
    numbers = {i: n - i for i in range(n)} if seq is None else seq
    nodes: list = []
    for i in range(n):
        if i in leaves:
            nodes.append(LeafNode(numbers[i], leaves[i]))
        else:
            nodes.append((ViewNode if i in views else SavingNode)(numbers[i]))
    edges = [[(j, 0) for j in succ.get(i, ())] for i in range(n)]
    return Graph.of(
        edges,
        nodes=nodes,
        leaf=dict(leaves),
        index={node: i for i, node in enumerate(nodes)},
        signature=[],
        kinds={type(node) for node in nodes},
    )
