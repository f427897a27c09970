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
    """The analyses of the last ``size`` graphs planned, by call shape (group names, loss counts, mode, options)
    and signature; reused for an equal graph.

    Reuse is safe because the analysis is a function of the graph's signature alone (node classes, edges with
    their input slots, which leaves are which group parameters, where the losses enter): the walk that
    computes the signature runs on every call, only the analysis is skipped. Parameters are compared by
    identity; the router holds them, so their ids cannot be reused while the cache exists.

    NOTE [Several graphs per call shape]
    A call shape can alternate between graphs: a loop that switches checkpointing on and off, a model with an
    optional branch, the bench's strategies sharing one router. Each graph keeps its own entry (up to ``size``
    in all, the least recently used dropped first); with one entry per call shape, two alternating graphs
    would each be analysed anew on every call. A lookup compares the signatures of the call shape's entries,
    newest first; unequal ones usually differ in length, which list equality checks first.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        # key -> [signature, analysis, last use], most recently used first
        self.entries: dict[tuple, list[list]] = {}
        self.hits = 0
        self.misses = 0
        self._clock = 0

    def __len__(self) -> int:
        return sum(len(found) for found in self.entries.values())

    def lookup(self, key: tuple, signature: list) -> tuple[list, Planned] | None:
        """The cached ``(signature, analysis)`` of an equal graph of call shape ``key``, or None (counted)."""
        found = self.entries.get(key, ())
        for k, entry in enumerate(found):
            if entry[0] is signature or entry[0] == signature:
                self._clock += 1
                entry[2] = self._clock
                if k:
                    found.insert(0, found.pop(k))  # type: ignore[union-attr]
                self.hits += 1
                return entry[0], entry[1]
        self.misses += 1
        return None

    def store(self, key: tuple, signature: list, planned: Planned) -> None:
        """Keep ``planned`` for graphs of call shape ``key`` and this signature (dropping the least recently used
        entry when full)."""
        if len(self) >= self.size:
            old_key, old = min(((k, e) for k, found in self.entries.items() for e in found), key=lambda ke: ke[1][2])
            self.entries[old_key].remove(old)
            if not self.entries[old_key]:
                del self.entries[old_key]
        self._clock += 1
        self.entries.setdefault(key, []).insert(0, [signature, planned, self._clock])

    def clear(self) -> None:
        self.entries.clear()


def build(
    routes: Sequence[Route],
    *,
    merge_shared: bool = True,
    options: PlanOptions | None = None,
    cache: PlanCache | None = None,
    checkpoints: Checkpoints = NO_CHECKPOINTS,
    graph: Graph | None = None,
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

    Raises:
        ValueError: the graph holds a reentrant ``torch.utils.checkpoint`` segment.
    """
    root_nodes = [[root_edge(t).node for t in r.losses] for r in routes]
    g = walk([n for nodes in root_nodes for n in nodes], _marks(routes)) if graph is None else graph
    if any(t.__name__ == "CheckpointFunctionBackward" for t in g.kinds):
        raise ValueError(
            "the losses' graph contains a reentrant torch.utils.checkpoint segment (use_reentrant=True): its "
            "backward refuses `torch.autograd.grad` and `backward(inputs=...)`, which routing needs, and hides "
            "the parameters inside it; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
            "gradroute.checkpoint"
        )
    options = options or PlanOptions()
    key = (merge_shared, options, tuple((r.name, len(r.losses)) for r in routes))
    hit = cache.lookup(key, g.signature) if cache is not None else None
    if hit is not None:
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
        cache.store(key, g.signature, planned)
    return Program(planned, g, routes, options)


def _marks(routes: Sequence[Route]) -> dict[int, int]:
    """``id(parameter) -> mark`` for the signature: which leaves are which routed parameters."""
    marks: dict[int, int] = {}
    for route in routes:
        for p in route.params:
            marks.setdefault(id(p), len(marks) + 1)
    return marks
