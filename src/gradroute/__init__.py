"""gradroute: exact routed gradients for chained networks from one forward pass.

Each loss trains only its own network; the engine calls, their ``inputs=``, retains and order come from the
autograd graph. See :class:`Router`.
"""

from . import (
    _compat,  # noqa: F401  (first: it refuses a torch older than gradroute supports)
    schedules,
)
from ._autotune import Autotune
from ._checkpoint import checkpoint, checkpoint_modules, cut_points
from ._compile import CompileStats, compile, compile_stats
from ._execute import GraphFreedError
from ._group import Group
from ._hf import enable_checkpointing
from ._options import PlanOptions
from ._planner import Call, Plan
from ._router import Router
from ._step import GroupStats, StepStats
from ._types import GraphCounts

__all__ = [
    "Autotune",
    "Call",
    "CompileStats",
    "GraphCounts",
    "GraphFreedError",
    "Group",
    "GroupStats",
    "Plan",
    "PlanOptions",
    "Router",
    "StepStats",
    "checkpoint",
    "checkpoint_modules",
    "compile",
    "compile_stats",
    "cut_points",
    "enable_checkpointing",
    "schedules",
]
__version__ = "0.1.0"
