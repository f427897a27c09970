"""A routed backward that needs no plan: every group of the call routed the same loss, one plain engine call."""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from ._compat import engine_will_execute
from ._execute import refuse_freed, run_engine, undo_writes, undoable
from ._types import Route

# NOTE [One plain call without a walk]
# ``router.backward(tenc=loss, unet=loss)`` merges into one route (NOTE [One loss routed to several groups]). Such
# a backward is run as one engine call ``backward(loss, inputs=<all of the groups' parameters>)`` without walking
# the graph, when:
#   1. the call's groups merged into that one route: every parameter ``p`` of every group then gets exactly
#      ``d loss / d p``, which is what that engine call accumulates, whatever the graph is (nothing is planned,
#      cached or carried from an earlier backward);
#   2. the backward can be undone by putting None back (``undoable``: every ``.grad`` is None, no parameter
#      hooks; not under DDP or FSDP2, which the caller rules out), and every parameter still requires grad;
#   3. the walk's refusals are made by the engine call itself: a group none of whose parameters it will
#      execute (the walk's "reaches none of its parameters") is refused from a pre-hook of the node the call
#      starts from, which runs before any node of the call (the engine raises before the node frees anything),
#      so the graph and every ``.grad`` are as they were; a freed node raises in the engine and is undone (2).
# Any other backward walks (NOTE [Exact by default] in _routing.py, whose rule 5 this is).


_requires_grad = operator.attrgetter("requires_grad")


def runs_plain(routes: Sequence[Route], *, distributed: bool) -> bool:
    """Whether ``routes`` (merged) are run by :func:`run_plain` (rules 1-2)."""
    if len(routes) != 1 or not routes[0].parts or distributed:
        return False
    route = routes[0]
    return (
        all(t.grad_fn is not None for t in route.losses) and all(map(_requires_grad, route.params)) and undoable(routes)
    )


def run_plain(route: Route, allowed: Collection[str]) -> str | None:
    """One engine call of ``route``'s losses into its parameters (rule 3). Returns the name of a group the losses
    reach none of whose parameters and that is not in ``allowed`` (nothing was run), else None."""
    check = _Check(route, allowed)
    roots = dict.fromkeys(t.grad_fn for t in route.losses if t.grad_fn is not None)  # all of them (runs_plain)
    handles = [fn.register_prehook(check) for fn in roots]
    try:
        run_engine(route.losses, tuple(map(torch.ones_like, route.losses)), False, route.params, accumulate=True)
    except _Unreached as e:
        return e.group
    except BaseException as e:
        undo_writes([route])
        refuse_freed(e, [n for n, _ in route.parts])
        raise
    finally:
        for h in handles:
            h.remove()
    return None


class _Unreached(Exception):
    def __init__(self, group: str) -> None:
        super().__init__(group)
        self.group = group


class _Check:
    """The pre-hook of rule 3: raises :class:`_Unreached` for the first group, not in ``allowed``, none of whose
    parameters the running engine call will execute (it runs before any node of the call)."""

    def __init__(self, route: Route, allowed: Collection[str]) -> None:
        self.route, self.allowed, self.done = route, allowed, False

    def __call__(self, grad_outputs: object) -> None:
        if self.done:  # a second loss's node: the call is already checked
            return
        self.done = True
        start = 0
        for name, n in self.route.parts:
            params = self.route.params[start : start + n]
            start += n
            if name not in self.allowed and not any(engine_will_execute(get_gradient_edge(p).node) for p in params):
                raise _Unreached(name)
