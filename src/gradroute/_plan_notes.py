"""What :meth:`gradroute.Router.plan` adds to the planner's :class:`Plan`: the reach and leak columns of the
router's groups the call does not name, and notes on what the router measured and on the graph's checkpointed
and compiled parts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from . import _checkpoint
from ._autotune import Tuner
from ._compile import plan_note
from ._planner import Plan, PlanCache, Program


def router_plan(
    program: Program,
    others: Mapping[str, Sequence[torch.Tensor]],
    *,
    cache: PlanCache | None,
    tuner: Tuner | None,
) -> Plan:
    """``program``'s plan with columns for ``others`` (``name -> parameters``: the groups not named in the call)
    and the router's notes; ``cache``: where routed backwards walk (no ``static_graph``), for the walk's note;
    ``tuner``: the measured choice, if on."""
    plan = _with_other_groups(program, others)
    extra = _notes(program, cache, tuner)
    return dataclasses.replace(plan, notes=(*plan.notes, *extra)) if extra else plan


def _notes(program: Program, cache: PlanCache | None, tuner: Tuner | None) -> list[str]:
    """The plan printout's notes on what the router measured and on the graph's checkpointed and compiled parts
    (the measured choice's note last but for those two)."""
    nodes = program.graph.nodes
    notes = [
        f"{', '.join(f'`{n}`' for n, _ in r.parts)} are routed the same loss: one plain backward into all of "
        f"their parameters gives each its exact gradient (routed as one group, `{r.name}`)"
        for r in program.routes
        if r.parts
    ]
    walked = cache.walk_note(program.planned, len(nodes)) if cache is not None else None
    if walked:
        notes.append(walked)
    tuned = tuner.describe() if tuner is not None else None
    if tuned:
        notes.append(tuned)
    torch_ckpt = sum(1 for i in program.planned.shared if _checkpoint.checkpoint_kind(nodes[i]) == "torch")
    if torch_ckpt:
        notes.append(
            f"{torch_ckpt} nodes saved by torch.utils.checkpoint are executed by more than one call: torch "
            "recomputes their segments once per call; gradroute.checkpoint recomputes each once per backward."
        )
    compiled = plan_note(nodes)
    if compiled:
        notes.append(compiled)
    return notes


def _with_other_groups(program: Program, others: Mapping[str, Sequence[torch.Tensor]]) -> Plan:
    """The plan with reach and leak columns for the router's groups that the call does not name."""
    plan = program.plan
    if not others:
        return plan
    leaf = program.graph.leaf
    reach = {loss: dict(row) for loss, row in plan.reach.items()}
    leaks = {loss: list(gs) for loss, gs in plan.leaks.items()}
    for r, route in enumerate(program.routes):
        reached = {id(leaf[i]) for i, m in program.planned.leaf_routes.items() if m >> r & 1}
        own = {id(p) for p in route.params}
        for name, params in others.items():
            n = sum(1 for p in params if id(p) in reached)
            reach[route.name][name] = n
            if any(id(p) in reached and id(p) not in own for p in params):
                leaks[route.name].append(name)
    return dataclasses.replace(plan, reach=reach, leaks={k: tuple(v) for k, v in leaks.items()}, others=tuple(others))
