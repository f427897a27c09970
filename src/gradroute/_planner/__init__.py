"""The planner: from the autograd graph of the routed losses to a list of engine calls.

A pipeline of small steps, each a function of its inputs with a frozen result (NOTE [Free at the last use] in
``build.py``; the words are docs/design.md's glossary):

* ``reach.py`` -- which routes' losses reach which nodes and parameters (:class:`Reach`);
* ``passes.py`` -- routes merged into passes (:class:`Passes`);
* ``needs.py`` -- the nodes each pass executes, the parameters it accumulates into (:class:`Needs`);
* ``order.py`` -- the passes' order, and each node's last use;
* ``chunks.py`` -- shared checkpoint segments cut into chunks the passes interleave through;
* ``numbering.py``, ``conflicts.py``, ``stage.py`` -- each pass split into retaining and freeing calls;
* ``schedule.py`` -- the passes' calls interleaved;
* ``per_call.py`` -- the checkpoint segments better recomputed once per call;
* ``describe.py`` -- the public :class:`Plan` (``plan.py``);
* ``build.py`` runs the steps; ``program.py`` walks the graph (or follows a static one's paths) and makes the
  program; ``cache.py`` keeps the analyses; ``follow.py`` holds everything about following a static graph.

Nothing here imports the checkpoint module: its segments come in through :class:`Checkpoints`.
"""

from .build import NO_CHECKPOINTS, Checkpoints, Planned, analyse
from .cache import PlanCache, call_shape
from .follow import StaticGraph
from .plan import Call, Plan, Wiring
from .program import Program, build, refuse_reentrant

__all__ = [
    "NO_CHECKPOINTS",
    "Call",
    "Checkpoints",
    "Plan",
    "PlanCache",
    "Planned",
    "Program",
    "StaticGraph",
    "Wiring",
    "analyse",
    "build",
    "call_shape",
    "refuse_reentrant",
]
