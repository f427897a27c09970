"""The planner's entry: walk the losses' graph, reuse or make the analysis, and hand the executor a program."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._graph import Graph, root_edge, walk
from .._options import PlanOptions
from .._types import Route
from .build import NO_CHECKPOINTS, Checkpoints, Planned, analyse
from .plan import Plan


@dataclass(frozen=True, eq=False)
class Program:
    """A planned backward plus the graph it runs on. Dropped after execution.

    Attributes:
        planned: the pipeline's result (shared with the cache).
        graph: the losses' graph.
        routes: the routes, in the caller's order.
        options: the options it was planned with (the executor reads ``remake_min_bytes``).
    """

    planned: Planned
    graph: Graph
    routes: Sequence[Route]
    options: PlanOptions = field(default_factory=PlanOptions)

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @property
    def unreached(self) -> list[str]:
        """The names of the routes whose losses reach none of their own parameters."""
        return [self.routes[r].name for r in self.planned.unreached]


class PlanCache:
    """The last analysis per call shape (group names, loss counts, mode, options), reused for an equal graph.

    Reuse is safe because the analysis is a function of the graph's signature alone (node classes, edges with
    their input slots, which leaves are which group parameters, where the losses enter): the walk that
    computes the signature runs on every call, only the analysis is skipped. Parameters are compared by
    identity; the router holds them, so their ids cannot be reused while the cache exists.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: dict[tuple, tuple[list, Planned]] = {}  # key -> (signature, analysis)
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self.entries.clear()


def build(
    routes: Sequence[Route],
    *,
    merge_shared: bool = True,
    options: PlanOptions | None = None,
    cache: PlanCache | None = None,
    checkpoints: Checkpoints = NO_CHECKPOINTS,
) -> Program:
    """Walk the graph of ``routes`` and plan it (or reuse the analysis of an equal graph).

    Args:
        routes: the routes, in the caller's order.
        merge_shared: whether routes whose groups share parameters may be merged into one pass (exact for
            ``backward``, where shared parameters receive the sum; not for ``grads``, which reports each
            route's gradient separately).
        options: chunk size, interleaving and the other settings (:class:`gradroute.PlanOptions`); the
            router switches ``interleave`` off under FSDP2, which reduce-scatters a module's gradients at the
            end of the first engine call that computes any of them.
        cache: reuse the analysis of an earlier graph with the same signature.
        checkpoints: the live ``gradroute.checkpoint`` segments and their sizes.

    Raises:
        ValueError: the graph holds a reentrant ``torch.utils.checkpoint`` segment.
    """
    root_nodes = [[root_edge(t).node for t in r.losses] for r in routes]
    marks: dict[int, int] = {}
    for route in routes:
        for p in route.params:
            marks.setdefault(id(p), len(marks) + 1)
    g = walk([n for nodes in root_nodes for n in nodes], marks)
    if any(t.__name__ == "CheckpointFunctionBackward" for t in g.kinds):
        raise ValueError(
            "the losses' graph contains a reentrant torch.utils.checkpoint segment (use_reentrant=True): its "
            "backward refuses `torch.autograd.grad` and `backward(inputs=...)`, which routing needs, and hides "
            "the parameters inside it; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
            "gradroute.checkpoint"
        )
    options = options or PlanOptions()
    key = (merge_shared, options, tuple((r.name, len(r.losses)) for r in routes))
    hit = cache.entries.get(key) if cache is not None else None
    if cache is not None and hit is not None and hit[0] == g.signature:
        cache.hits += 1
        g.signature = hit[0]  # equal; the cached list, so that callers can tell the entry by identity
        return Program(hit[1], g, routes, options)
    roots = [[g.index[n] for n in nodes] for nodes in root_nodes]
    planned = analyse(
        g,
        [r.name for r in routes],
        [r.params for r in routes],
        roots,
        merge_shared=merge_shared,
        options=options,
        checkpoints=checkpoints,
    )
    if cache is not None:
        cache.misses += 1
        cache.entries.pop(key, None)
        if len(cache.entries) >= cache.size:
            cache.entries.pop(next(iter(cache.entries)))
        cache.entries[key] = (g.signature, planned)
    return Program(planned, g, routes, options)
