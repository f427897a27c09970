"""Which routed backward is running now, for code that hooks into the engine (``gradroute.checkpoint``).

A plain module global, not a ``contextvars.ContextVar``: autograd runs CUDA backward work on its own device
threads, which do not inherit the caller's context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ._options import PlanOptions


class Session:
    """One ``Router.backward``/``Router.grads`` call. ``on_exit`` callbacks run when the call returns."""

    def __init__(self, remake_min_bytes: int) -> None:
        self.on_exit: list = []
        # autograd nodes whose gradroute.checkpoint segment is recomputed once per engine call, not shared
        self.recompute_per_call: set = set()
        # PlanOptions.remake_min_bytes of the router running this backward
        self.remake_min_bytes = remake_min_bytes


_current: Session | None = None


def current() -> Session | None:
    """The routed backward in progress, or None."""
    return _current


@contextmanager
def routed_backward(
    remake_min_bytes: int = PlanOptions.remake_min_bytes, recompute_per_call: set | None = None
) -> Iterator[Session]:
    global _current
    outer = _current
    session = Session(remake_min_bytes)
    session.recompute_per_call = recompute_per_call or set()
    _current = session
    try:
        yield session
    finally:
        _current = outer
        # the callbacks hold the session (their key): drop them so nothing waits for the cycle collector
        callbacks, session.on_exit = session.on_exit, []
        for fn in callbacks:
            fn()
