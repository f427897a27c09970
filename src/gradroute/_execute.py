"""Runs a program built by ``_plan.build``: one engine call per stage, cut gradients carried between calls."""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge

from ._plan import Program
from ._session import routed_backward

_FREED = "backward through the graph a second time"


class GraphFreedError(RuntimeError):
    """A routed loss's autograd graph was already freed by an earlier backward."""


def freed_message(what: str) -> str:
    return (
        f"{what}: its autograd graph was already freed by an earlier backward (a loss can be backpropagated "
        "once; run a new forward for every backward, and do not call `.backward()` on a loss you route)"
    )


def execute(program: Program, *, accumulate: bool) -> list[dict[int, torch.Tensor]]:
    """Run ``program``.

    Args:
        program: what ``_plan.build`` returned.
        accumulate: add into ``.grad`` (``Router.backward``); otherwise collect (``Router.grads``).

    Returns:
        With ``accumulate=False``: per route, ``id(param) -> gradient``. Otherwise empty dicts.
    """
    with routed_backward():
        return _run(program, accumulate)


def _run(program: Program, accumulate: bool) -> list[dict[int, torch.Tensor]]:
    nodes = program.graph.nodes
    pending: dict[tuple[int, int, int], torch.Tensor] = {}  # (pass, node, input_nr) -> cut gradient
    collected: list[dict[int, torch.Tensor]] = [{} for _ in program.routes]
    for st in program.stages:
        outputs: list[torch.Tensor | GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for r, k in st.losses:
            t = program.routes[r].losses[k]
            outputs.append(t)
            seeds.append(torch.ones_like(t))
        for j, nr in st.cuts_in:
            g_in = pending.pop((st.pass_index, j, nr), None)
            if g_in is not None:
                outputs.append(GradientEdge(nodes[j], nr))
                seeds.append(g_in)
        if not outputs:
            continue
        cuts: list[torch.Tensor | GradientEdge] = [GradientEdge(nodes[j], nr) for j, nr in st.cuts_out]
        try:
            if accumulate and not cuts:
                torch.autograd.backward(outputs, seeds, retain_graph=st.retain, inputs=st.targets)  # type: ignore[arg-type]
                continue
            res = torch.autograd.grad(
                outputs,  # type: ignore[arg-type]
                cuts + st.targets,  # type: ignore[arg-type]
                grad_outputs=seeds,
                retain_graph=st.retain,
                allow_unused=True,
            )
        except RuntimeError as e:
            if _FREED in str(e):
                raise GraphFreedError(freed_message("a routed loss")) from e
            raise
        for (j, nr), g in zip(st.cuts_out, res):
            if g is not None:
                key = (st.pass_index, j, nr)
                prev = pending.get(key)
                pending[key] = g if prev is None else prev + g
        if accumulate:
            # a call that cuts cannot also accumulate (autograd.grad captures instead): hand the captured
            # parameter gradients to their AccumulateGrad nodes in one more engine call, so .grad is written
            # the way the engine writes it (layout, buffer stealing, hooks such as DDP's and FSDP's)
            edges: list[torch.Tensor | GradientEdge] = []
            grads: list[torch.Tensor] = []
            for j, g in zip(st.target_ids, res[len(cuts) :]):
                if g is not None:
                    edges.append(GradientEdge(nodes[j], 0))
                    grads.append(g)
            if edges:
                torch.autograd.backward(edges, grads)  # type: ignore[arg-type]
        else:
            for p, r, g in zip(st.targets, st.target_routes, res[len(cuts) :]):
                if g is not None:
                    prev = collected[r].get(id(p))
                    collected[r][id(p)] = g if prev is None else prev + g
    return collected
