"""Types shared by the layers above the graph: the planner, the executor, the training step, the distributed code."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Route:
    """One routed loss: a group name, its loss tensors (summed), and the group's parameters.

    Attributes:
        name: the group's name.
        losses: the loss tensors routed to the group; their gradients are summed.
        params: the group's parameters (under FSDP2, their unsharded tensors).
    """

    name: str
    losses: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...]
