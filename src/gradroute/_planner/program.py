"""The planner's entry: walk the losses' graph (or, under ``static_graph``, follow the paths of one walked before),
reuse or make the analysis, and hand the executor a program."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import Node

from .._graph import Graph, root_node, walk
from .._options import PlanOptions
from .._types import Route
from .build import NO_CHECKPOINTS, Checkpoints, Planned, analyse
from .cache import PlanCache, call_shape, param_marks
from .follow import StaticGraph
from .plan import Plan


@dataclass(frozen=True, eq=False)
class Program:
    """A planned backward plus the graph it runs on. Dropped after execution.

    Attributes:
        planned: the pipeline's result (shared with the cache).
        graph: the losses' graph.
        routes: the routes, in the caller's order.
        options: the options it was planned with (the executor reads ``remake_min_bytes``).
        targets: per call, the parameters it accumulates into, when known already (a followed graph's); else
            the executor reads them off ``graph.leaf``.
        target_routes: per call, the route of each of ``targets``, where they are not the plan's (a followed
            graph's plan that is exact on any graph: NOTE [Static graphs] in ``follow.py``).
        walked: the seconds that walking ``graph`` took in this ``build``; None where it was not walked here.
    """

    planned: Planned
    graph: Graph
    routes: Sequence[Route]
    options: PlanOptions = field(default_factory=PlanOptions)
    targets: tuple[tuple[torch.Tensor, ...], ...] | None = None
    target_routes: tuple[tuple[int, ...], ...] | None = None
    walked: float | None = None

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @property
    def unreached(self) -> list[str]:
        """The names of the routes whose losses reach none of their own parameters."""
        return [self.routes[r].name for r in self.planned.unreached]


def build(
    routes: Sequence[Route],
    *,
    merge_shared: bool = True,
    options: PlanOptions | None = None,
    cache: PlanCache | None = None,
    checkpoints: Checkpoints = NO_CHECKPOINTS,
    graph: Graph | None = None,
    static: StaticGraph | None = None,
    backward: bool = False,
    probe: bool = True,
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
        graph: the graph of these same ``routes`` from an earlier ``build`` (planned again with other
            ``options``: the measured choice), so that it is not walked again.
        static: under ``Router(static_graph=...)``, the recorded graphs: this backward may follow the paths of
            one instead of walking, and a walk that finds another graph raises (NOTE [Static graphs] in
            ``follow.py``). None: walk.
        backward: this is a routed backward (not ``Router.plan``): its walk is timed for the plan printout
            (``PlanCache.walk_note``).
        probe: look for nodes freed by an earlier backward while walking (``_graph.walk``).

    Raises:
        ValueError: the graph holds a reentrant ``torch.utils.checkpoint`` segment.
        RuntimeError: with ``static``, the graph differs from the one recorded for this call shape.
    """
    route_roots = [[root_node(t) for t in r.losses] for r in routes]
    roots = [n for nodes in route_roots for n in nodes]
    options = options or PlanOptions()
    key = call_shape(routes, merge_shared=merge_shared, options=options)
    marks, by_mark = cache.marks(routes) if cache is not None else (param_marks(routes), [])
    if static is not None and graph is None:
        f = static.follow(key, roots, routes, by_mark)
        if f is not None:
            return Program(f.planned, f.graph, routes, options, targets=f.targets, target_routes=f.target_routes)
    start = time.perf_counter()
    g = walk(roots, marks, probe=probe) if graph is None else graph
    seconds = time.perf_counter() - start if graph is None else None
    _refuse_reentrant(g)
    if static is not None and static.changed(key, g.signature):
        raise RuntimeError(_changed(routes))
    hit = cache.lookup(key, g.signature) if cache is not None else None
    if hit is not None:
        g.signature = hit.signature  # equal; the cached list, so that callers can tell the entry by identity
    planned = hit.planned if hit is not None else _analyse(g, routes, route_roots, merge_shared, options, checkpoints)
    if cache is not None:
        entry = hit if hit is not None else cache.store(key, g.signature, planned)
        if backward and seconds is not None:
            cache.walked(key, entry, seconds)
    if static is not None and hit is not None and backward:
        static.walked(key, g, planned, route_roots)
    return Program(planned, g, routes, options, walked=seconds)


def _analyse(
    g: Graph,
    routes: Sequence[Route],
    route_roots: Sequence[Sequence[Node]],
    merge_shared: bool,
    options: PlanOptions,
    checkpoints: Checkpoints,
) -> Planned:
    root_ids = [[g.index[n] for n in nodes] for nodes in route_roots]
    names, params = [r.name for r in routes], [r.params for r in routes]
    return analyse(g, names, params, root_ids, merge_shared=merge_shared, options=options, checkpoints=checkpoints)


def refuse_reentrant(routes: Sequence[Route]) -> None:
    """Walk the graph of ``routes`` (without the freed probe) and raise the walk's ValueError if it holds a
    reentrant ``torch.utils.checkpoint`` segment: a backward that followed paths did not look."""
    _refuse_reentrant(walk([root_node(t) for r in routes for t in r.losses], param_marks(routes), probe=False))


def _refuse_reentrant(g: Graph) -> None:
    if any(t.__name__ == "CheckpointFunctionBackward" for t in g.kinds):
        raise ValueError(
            "the losses' graph contains a reentrant torch.utils.checkpoint segment (use_reentrant=True): its "
            "backward refuses `torch.autograd.grad` and `backward(inputs=...)`, which routing needs, and hides "
            "the parameters inside it; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
            "gradroute.checkpoint"
        )


def _changed(routes: Sequence[Route]) -> str:
    names = ", ".join(f"`{r.name}`" for r in routes)
    return (
        f"`static_graph` was set, but the autograd graph of the losses routed to {names} differs from the one "
        "planned for them on an earlier backward (another branch taken, another module, checkpointing switched, "
        "an input that now requires grad); gradients routed since the last check may be wrong. Use "
        "Router(static_graph=False), the default, for a graph that changes: it walks the graph on every backward"
    )
