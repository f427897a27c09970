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
        parts: for a route that stands for several groups routed the same loss (``_losses.merge_same_losses``),
            each group's name and number of parameters, in the order of ``params``; else empty.
    """

    name: str
    losses: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...]
    parts: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class GraphCounts:
    """How a router's routed backwards (``backward`` and ``grads``) met their graphs so far.

    Attributes:
        walked: routed backwards that walked the losses' whole autograd graph (by default all of them but those
            counted in ``plain``).
        followed: routed backwards that followed the paths recorded for a static graph instead
            (``Router(static_graph=True)``).
        planned: graphs analysed: a graph not seen before, or seen with other plan options (the measured
            choice plans each candidate once); a graph seen again reuses its analysis.
        plain: ``backward`` calls whose groups were all routed the same loss, run as one plain engine call into
            all of their parameters without looking at the graph.

    Examples:
        >>> import torch, gradroute
        >>> net = torch.nn.Linear(2, 2)
        >>> router = gradroute.Router(net=net)
        >>> for _ in range(3):
        ...     router.backward(net=net(torch.randn(4, 2)).sum())
        >>> router.graph_counts
        GraphCounts(walked=3, followed=0, planned=1, plain=0)
    """

    walked: int = 0
    followed: int = 0
    planned: int = 0
    plain: int = 0
