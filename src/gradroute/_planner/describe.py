"""Step 9, describe: the :class:`Plan` users see, with its notes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .masks import bits
from .passes import Passes
from .per_call import PerCall
from .plan import Call, Plan
from .reach import Reach


def describe(
    names: Sequence[str],
    found: Reach,
    passes: Passes,
    order: Sequence[int],
    calls: Sequence[Call],
    *,
    kept: int,
    graph_nodes: int,
    chunks: int,
    per_call: PerCall,
) -> Plan:
    """The plan: ``names`` of the routes, the calls in execution order (numbered here), ``chunks`` shared
    checkpoint chunks the passes interleave through, the segments recomputed ``per_call``."""
    names = tuple(names)
    n = len(names)
    return Plan(
        groups=names,
        reach={names[r]: {names[q]: found.counts[r][q] for q in range(n)} for r in range(n)},
        leaks={names[r]: tuple(names[q] for q in bits(found.leaks[r]) if q != r) for r in range(n)},
        passes=tuple(tuple(names[r] for r in bits(passes.routes[k])) for k in order),
        calls=tuple(dataclasses.replace(c, index=k + 1) for k, c in enumerate(calls)),
        kept_nodes=kept,
        graph_nodes=graph_nodes,
        notes=_notes(chunks, per_call.segments),
    )


def _notes(chunks: int, per_call: int) -> tuple[str, ...]:
    notes = []
    if chunks:
        notes.append(
            f"{chunks} chunk(s) of gradroute.checkpoint segments are shared by several passes: the passes "
            "interleave chunk by chunk, and each shared recomputation is freed as they go"
        )
    if per_call:
        notes.append(
            f"{per_call} gradroute.checkpoint segment(s) are recomputed once per call instead of shared: the "
            "passes cannot interleave through all of them (plain code hands a tensor to ops on both sides, e.g. "
            "diffusers' skip connections) and shared recomputations would stay alive together, so the calls "
            "are those of torch's checkpoint; gradroute.cut_points on the modules whose outputs those tensors "
            "are (or gradroute.checkpoint_modules on whole blocks) lets the passes interleave"
        )
    return tuple(notes)
