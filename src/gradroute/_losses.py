"""Groups routed the same loss: one route, one plain backward (NOTE [One loss routed to several groups])."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ._types import Route

# NOTE [One loss routed to several groups]
# ``router.backward(tenc=loss, unet=loss)`` (DreamBooth without prior preservation) asks for the gradient of one
# loss in every parameter of both groups: exactly what one plain ``loss.backward(inputs=...)`` into all of them
# gives, so there is nothing to route.
#   1. Routes whose losses are the same tensor objects, in the same order, become one route whose parameters are
#      all of theirs (the first route's scaled losses stand for all: the scaling is the same for every group).
#   2. Only where no parameter is in two of them: a shared one needs the loss's gradient once per group.
#   3. Only for ``backward`` and ``plan``, and not under FSDP2 (its unsharded parameters are looked up per group):
#      ``grads`` returns each group's gradients on their own.
#   4. Each group is still refused on its own where the loss reaches none of its parameters (:func:`unreached`).


def merge_same_losses(
    original: Sequence[Route], routes: Sequence[Route], merged: dict[tuple[str, ...], tuple]
) -> list[Route]:
    """``routes`` (``original`` scaled for the backward, route by route) with the routes of each set of groups
    routed the same loss (rules 1-2) made one. ``merged`` keeps each set's parameter tuple between calls, so
    that a loop passes the planner the same tuple every time."""
    out: list[Route] = []
    taken: set[int] = set()
    for k, first in enumerate(original):
        if k in taken:
            continue
        same = [j for j in range(k, len(original)) if j not in taken and _same(original[j], first)]
        params = _params(merged, [original[j] for j in same]) if len(same) > 1 else None
        if params is not None:
            taken.update(same)
            names = tuple(original[j].name for j in same)
            parts = tuple((original[j].name, len(original[j].params)) for j in same)
            out.append(Route(name="+".join(names), losses=routes[k].losses, params=params, parts=parts))
        else:
            taken.add(k)
            out.append(routes[k])
    return out


def unreached(route: Route, reached: set[int]) -> Iterator[str]:
    """The names of ``route``'s parts none of whose parameters are in ``reached`` (ids) (rule 4)."""
    start = 0
    for name, n in route.parts:
        if not any(id(p) in reached for p in route.params[start : start + n]):
            yield name
        start += n


def group_names(routes: Sequence[Route]) -> list[str]:
    """The names of the groups ``routes`` stand for, in order (a merged route's parts in its place)."""
    return [name for r in routes for name in ([n for n, _ in r.parts] or [r.name])]


def _same(a: Route, b: Route) -> bool:
    return len(a.losses) == len(b.losses) and all(x is y for x, y in zip(a.losses, b.losses))


def _disjoint(param_sets: Iterator[tuple[torch.Tensor, ...]]) -> bool:
    seen: set[int] = set()
    for params in param_sets:
        ids = {id(p) for p in params}
        if seen & ids:
            return False
        seen |= ids
    return True


def _params(merged: dict[tuple[str, ...], tuple], same: list[Route]) -> tuple[torch.Tensor, ...] | None:
    """The parameters of the routes ``same`` (routed the same losses) as one tuple, or None where two of them
    share a parameter (rule 2); kept in ``merged`` while the routes' parameter tuples are the same objects."""
    names = tuple(r.name for r in same)
    parts = tuple(r.params for r in same)
    kept = merged.get(names)
    if kept is not None and len(kept[0]) == len(parts) and all(a is b for a, b in zip(kept[0], parts)):
        return kept[1]  # type: ignore[no-any-return]
    params = tuple(p for ps in parts for p in ps) if _disjoint(iter(parts)) else None
    merged[names] = (parts, params)
    return params
