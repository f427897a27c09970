"""What a routed call refuses once its graph is walked or followed, before the first engine call (NOTE [Exact by
default] rule 4, in ``_routing.py``): a freed graph, named by the losses that reach the freed node; a loss that
reaches none of its group's parameters; after a failed backward that followed paths, a reentrant checkpoint
segment there."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ._execute import GraphFreedError, freed_message
from ._graph import reaches, root_node
from ._group import Group
from ._losses import group_names, unreached
from ._planner import Program, refuse_reentrant
from ._types import Route


def check_walked(program: Program, groups: Mapping[str, Group], allow_unreached: Collection[str]) -> None:
    """Raise :class:`GraphFreedError` where the walk found a freed node, else ValueError for the first group of
    ``groups`` not in ``allow_unreached`` whose loss reaches none of its parameters."""
    _check_not_freed(program)
    bad = [n for n in _unreached(program) if n not in allow_unreached]
    if bad:
        raise ValueError(unreached_message(bad[0], groups))


def unreached_message(name: str, groups: Mapping[str, Group]) -> str:
    """The refusal of a loss for group ``name`` that reaches none of that group's parameters."""
    return (
        f"loss for group `{name}` reaches none of that group's {len(groups[name].params)} "
        "parameters (a stray .detach() or torch.no_grad()?); pass "
        f"Router(..., allow_unreached=[{name!r}]) if that is intended"
    )


def refuse_reentrant_after(routes: list[Route], error: Exception) -> None:
    """After ``error`` in a backward that followed paths: the walk's error for a reentrant checkpoint segment
    there, raised from ``error`` (the engine's own names ``.grad()``, which the user never called)."""
    try:
        refuse_reentrant(routes)
    except ValueError as reentrant:
        raise reentrant from error


def _unreached(program: Program) -> list[str]:
    """The names of the groups whose losses reach none of their parameters (per group for a route that stands for
    several groups routed the same loss)."""
    out: list[str] = []
    for r, route in enumerate(program.routes):
        if route.parts:
            leaf = program.graph.leaf
            reached = {id(leaf[i]) for i, m in program.planned.leaf_routes.items() if m >> r & 1 and i in leaf}
            out += unreached(route, reached)
        elif r in program.planned.unreached:
            out.append(route.name)
    return out


def _check_not_freed(program: Program) -> None:
    """Raise :class:`GraphFreedError` naming the losses whose graphs reach the node the walk found freed.

    The walk checks the whole graph once (NOTE [One walk: structure, signature and the freed check]); only
    when it found a freed node are the losses' graphs searched, for the message.
    """
    g = program.graph
    if g.freed is None:
        return
    routes = program.routes
    if not g.followed:  # a followed graph has no edges to search
        routes = [r for r in routes if reaches(g, [g.index[root_node(t)] for t in r.losses], g.freed)]
    raise GraphFreedError(freed_message(group_names(routes)))
