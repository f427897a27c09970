"""Activation checkpointing whose recomputation is shared by all engine calls of one routed backward.

User guide: docs/checkpointing.md. One mechanism per file:

- ``_api.py``: the public functions (``checkpoint``, ``checkpoint_modules``, ``cut_points``);
- ``_frame.py``: the frame (one ``checkpoint`` call) and its recomputation;
- ``_hooks.py``: the saved-tensor hooks of the original forward, and the three unpack modes;
- ``_placeholder.py``: what the graph saves in place of a tensor, and how a dropped one is remade;
- ``_remakes.py``: the dispatch mode that records which saved tensors cheap ops made (remade tensors);
- ``_views.py``: per-consumer views of a segment's inputs and outputs, and cut points;
- ``_advice.py``: the warning where a routed backward recomputes diffusers' layers per call (no cut points);
- ``_registry.py``: which sequence numbers belong to which live segment, per thread;
- ``_queries.py``: what the planner and the router ask (``segments``, ``held_bytes``, ``checkpoint_kind``,
  ``maybe_live``);
- private torch APIs: from ``gradroute._compat``, as everywhere in gradroute.
"""

from ._api import checkpoint, checkpoint_modules, cut_points
from ._queries import checkpoint_kind, held_bytes, maybe_live, segments

__all__ = [
    "checkpoint",
    "checkpoint_kind",
    "checkpoint_modules",
    "cut_points",
    "held_bytes",
    "maybe_live",
    "segments",
]
