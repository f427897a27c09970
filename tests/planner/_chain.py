"""The text encoder -> UNet graph in six nodes, the planner's canonical case, built by hand.

Node 0 is the text encoder's loss, node 1 the UNet's (both views: they keep nothing); node 2 is the UNet's op
(it saves its input), feeding the UNet weight (leaf 3) and the text encoder's op (node 4), which feeds the
text encoder's weight (leaf 5). Route 0 is ``tenc`` (weight ``T``), route 1 ``unet`` (weight ``U``).
"""

from __future__ import annotations

import torch

from gradroute._graph import Graph

from ._graphs import graph

NAMES = ("tenc", "unet")
ROOTS = [[0], [1]]


def chain() -> tuple[Graph, list[list[torch.Tensor]]]:
    t, u = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    g = graph({0: [2], 1: [2], 2: [3, 4], 4: [5]}, {3: u, 5: t}, views=[0, 1])
    return g, [[t], [u]]
