"""Which routed backward is running now, for code that hooks into the engine (``gradroute.checkpoint``).

NOTE [Routing state is per call]
A saved-tensor unpack hook must know whether the engine call it runs in belongs to a routed backward, and to
which. It runs on the thread that called ``Router.backward`` (the engine runs CPU work there) or on one of
autograd's device threads (CUDA work), which inherit nothing from the caller, neither thread-locals nor
``contextvars``. So:

1. The calling thread finds its own routed backward in a ``threading.local``, set for the duration of the call.
2. Any other thread finds it by the engine's graph task: a routed call puts a pre-hook on the nodes its engine
   calls start from, which records ``graph task id -> session`` before any other node of that call runs (every
   node of an engine call runs after the node it starts from). Graph task ids are unique in the process.
   Saved-tensor unpacks, which is what ``gradroute.checkpoint`` does, run inside the nodes and so always after
   that record (a tensor hook on a start node's tensor may run before it on a device thread).
3. Only those unpacks ask, so a routed backward opens no session while no ``gradroute.checkpoint`` segment is
   alive anywhere (``_checkpoint.maybe_live``): no placeholder exists then, so no unpack can run in it.
4. The entries are dropped when the routed call returns or raises, and nothing is a process-wide "current":
   concurrent ``Router.backward`` calls from several threads each see their own session, and a plain backward
   in another thread sees none.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ._compat import current_graph_task_id
from ._options import PlanOptions

_local = threading.local()
_by_task: dict[int, Session] = {}  # graph task id -> the routed backward it belongs to
_lock = threading.Lock()


class Session:
    """One ``Router.backward``/``Router.grads`` call. ``on_exit`` callbacks run when the call returns."""

    def __init__(self, remake_min_bytes: int) -> None:
        self.on_exit: list = []
        # autograd nodes whose gradroute.checkpoint segment is recomputed once per engine call, not shared
        self.recompute_per_call: set = set()
        # PlanOptions.remake_min_bytes of the router running this backward
        self.remake_min_bytes = remake_min_bytes
        self._tasks: list[int] = []
        self._handles: list[Any] = []

    def watch(self, roots: Iterable[Any]) -> None:
        """Recognise this call's engine calls on every thread: ``roots`` are the nodes they start from (None
        for a loss that is a leaf: nothing below it saves a tensor)."""
        for node in dict.fromkeys(roots):
            if node is not None:
                self._handles.append(node.register_prehook(self._enter))

    def _enter(self, grad_outputs: Any) -> None:
        task = current_graph_task_id()
        if task != -1 and _by_task.get(task) is not self:
            with _lock:
                _by_task[task] = self
            self._tasks.append(task)

    def _close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self._tasks:
            return
        with _lock:
            for task in self._tasks:
                if _by_task.get(task) is self:
                    del _by_task[task]
        self._tasks = []


def current() -> Session | None:
    """The routed backward the running engine call belongs to, or None (a plain backward, or none)."""
    session: Session | None = getattr(_local, "session", None)
    if session is not None or not _by_task:
        return session
    return _by_task.get(current_graph_task_id())


@contextmanager
def routed_backward(
    remake_min_bytes: int = PlanOptions.remake_min_bytes,
    recompute_per_call: set | None = None,
    starts: Iterable[Any] = (),
) -> Iterator[Session]:
    """A routed backward in the calling thread: :func:`current` gives its session until the block ends.

    Args:
        remake_min_bytes: :attr:`gradroute.PlanOptions.remake_min_bytes` of the router.
        recompute_per_call: the nodes whose checkpoint segment is recomputed once per engine call.
        starts: the nodes the engine calls start from (see :meth:`Session.watch`).
    """
    outer = getattr(_local, "session", None)
    session = Session(remake_min_bytes)
    session.recompute_per_call = recompute_per_call or set()
    _local.session = session
    try:
        session.watch(starts)
        yield session
    finally:
        _local.session = outer
        session._close()
        # the callbacks hold the session (their key): drop them so nothing waits for the cycle collector
        callbacks, session.on_exit = session.on_exit, []
        for fn in callbacks:
            fn()
