"""Routing: a router's routed backwards planned and run (the walk or the followed paths, the plan cache, the
measured choice, the executor), with the counts ``Router.graph_counts`` reports."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _checkpoint
from ._autotune import Tuner
from ._distributed import fsdp2_unsharded, has_dtensor, live_params
from ._execute import execute, undoable
from ._group import Group
from ._loss_checks import checked_losses
from ._losses import merge_same_losses
from ._options import PlanOptions
from ._plain import run_plain, runs_plain
from ._plan_notes import router_plan
from ._planner import Checkpoints, Plan, PlanCache, Program, StaticGraph, build, call_shape
from ._refusals import check_walked, refuse_reentrant_after, unreached_message
from ._router_options import RoutingOptions
from ._types import GraphCounts, Route

LossLike = torch.Tensor | Sequence[torch.Tensor]

# what the planner reads about gradroute.checkpoint segments (it imports nothing of the checkpoint module);
# looked up at call time, so the planner sees the module's functions as they are then
CHECKPOINTS = Checkpoints(
    segments=lambda nodes: _checkpoint.segments(nodes), node_bytes=lambda node: _checkpoint.held_bytes(node)
)

# NOTE [Exact by default]
# What makes every routed backward of a default ``Router`` exact, whatever the sequence of graphs:
#   1. Every backward walks its losses' whole graph (``static_graph`` is the user's promise and off by default).
#   2. The plan is a function of the walked graph's signature; an analysis is reused only for an equal signature
#      under the same call shape and options (``PlanCache``), and the executor takes its targets from the walked
#      graph, never from a cache.
#   3. The measured choice only chooses which options plan the walked graph; each option's plan is exact
#      (``_planner``), its tuning is per signature, and a followed graph is never planned again.
#   4. What a walk refuses (a loss that reaches none of its group, a reentrant segment, a freed graph) is refused
#      before the first engine call; a failure in the engine is undone where every ``.grad`` was None.
#   5. The one exception to rule 1 is exact on any graph: every group of a call routed the same loss is one plain
#      engine call into all their parameters (NOTE [One plain call without a walk]).
# Rules 1-3 make the gradients those of the plan for this very graph; rule 4 makes refusals immediate.


class Routing:
    """The routed backwards of one router's groups.

    Args:
        groups: the router's groups, by name.
        options: the router's routing options.
        distributed: whether a DDP module holds any of the groups' parameters (asked on every backward).
    """

    def __init__(self, groups: Mapping[str, Group], options: RoutingOptions, distributed: Callable[[], bool]) -> None:
        self._groups = groups
        self._options = options
        self._distributed = distributed
        self._tuner = None if options.autotune is None else Tuner(options.autotune, CHECKPOINTS)
        self._static = StaticGraph(options.static_every) if options.static_every else None
        self._cache = PlanCache(size=8 if self._tuner is None else 16)  # every candidate's program of two call shapes
        self._lock = threading.Lock()  # one thread plans at a time (the cache and the tuner's state)
        self._walked = self._followed = self._plain = 0
        self._merged: dict[tuple[str, ...], tuple] = {}  # the parameters of groups routed one loss (``_losses``)
        # the groups whose parameters FSDP2 may have sharded: only theirs are looked up on every backward
        self._sharded = {name for name, group in groups.items() if has_dtensor(group.params)}

    @property
    def measuring(self) -> bool:
        """Whether the measured choice is still timing the plans of some graph."""
        return self._tuner is not None and self._tuner.measuring

    def counts(self) -> GraphCounts:
        """How the routed backwards met their graphs so far."""
        return GraphCounts(walked=self._walked, followed=self._followed, planned=self._cache.misses, plain=self._plain)

    def routes(self, losses: Mapping[str, LossLike] | None, named: Mapping[str, LossLike], what: str) -> list[Route]:
        """The checked losses of a call as routes into their groups' parameters (FSDP2's unsharded ones)."""
        routes = []
        for name, tensors in checked_losses(losses, named, what, self._groups).items():
            params = self._groups[name].params
            params = live_params(params) if name in self._sharded else params
            routes.append(Route(name=name, losses=tensors, params=params))
        return routes

    def backward(self, original: list[Route], routes: list[Route]) -> None:
        """Accumulate ``routes`` (``original`` scaled for the backward) into ``.grad``."""
        merged = routes if self._sharded else merge_same_losses(original, routes, self._merged)
        distributed = self._distributed()  # asked once per backward
        if runs_plain(merged, distributed=distributed):  # NOTE [One plain call without a walk]
            unreached_group = run_plain(merged[0], self._options.allow_unreached)
            if unreached_group is not None:
                raise ValueError(unreached_message(unreached_group, self._groups))
            self._plain += 1
        else:
            self._route(merged, accumulate=True, distributed=distributed)

    def grads(self, routes: list[Route]) -> dict[str, tuple[torch.Tensor | None, ...]]:
        """Each route's gradients, ``.grad`` untouched."""
        collected = self._route(routes, accumulate=False, distributed=self._distributed())
        return {r.name: tuple(collected[k].get(id(p)) for p in r.params) for k, r in enumerate(routes)}

    def plan(self, routes: list[Route]) -> Plan:
        """What :meth:`backward` would do with ``routes``; nothing is run."""
        routes = routes if self._sharded else merge_same_losses(routes, routes, self._merged)
        with self._lock:
            program, _ = self._program(routes, merge_shared=True)
        named = {name for r in routes for name, _ in r.parts} | {r.name for r in routes}
        others = {n: g.params for n, g in self._groups.items() if n not in named}
        return router_plan(program, others, cache=self._cache if self._static is None else None, tuner=self._tuner)

    def _route(self, routes: list[Route], *, accumulate: bool, distributed: bool) -> list[dict[int, torch.Tensor]]:
        """Plan and run ``routes`` (:meth:`backward` accumulates and merges shared routes; :meth:`grads` collects
        each route's own gradients); a freed graph is refused with every ``.grad`` as it was (NOTE [Undoing a failed
        routed backward]). ``distributed``: whether a DDP module holds any of the groups' parameters."""
        # a backward whose writes can be undone needs no freed probe (NOTE [Undoing a failed routed backward])
        undo = accumulate and not self._sharded and not distributed and undoable(routes)
        with self._lock:
            program, trial = self._program(
                routes, merge_shared=accumulate, backward=True, probe=accumulate and not undo, distributed=distributed
            )
            followed = program.graph.followed
        with trial:
            try:
                return execute(
                    program,
                    accumulate=accumulate,
                    remake_min_bytes=program.options.remake_min_bytes,
                    watch=_checkpoint.maybe_live(),
                    undo=undo,
                )
            except Exception as e:
                if followed and self._static is not None:  # the next backward walks; name the cause
                    self._static.recheck()
                    refuse_reentrant_after(routes, e)
                raise

    def _program(
        self,
        routes: list[Route],
        *,
        merge_shared: bool,
        backward: bool = False,
        probe: bool = True,
        distributed: bool = False,
    ) -> tuple[Program, Any]:
        """The program for ``routes`` and the context to run it in (a trial of the measured choice, or nothing);
        ``backward``: for a routed backward (may follow a static graph's paths), not a :meth:`plan`; ``probe``:
        look for freed nodes while walking; ``distributed``: as for :meth:`_route` (read for a backward only).
        Called with ``_lock`` held."""
        # FSDP2 reduce-scatters a module's gradients at the end of the first engine call that computes any of
        # them: keep each pass through it in one call
        fsdp2 = bool(self._sharded) and fsdp2_unsharded(routes, {n: g.params for n, g in self._groups.items()})
        options = dataclasses.replace(self._options.plan, interleave=False) if fsdp2 else self._options.plan
        # a static graph is followed once nothing is being measured, and never under DDP or FSDP2 (their hooks
        # expect the plan's parameters): NOTE [Static graphs] in _planner/follow.py
        follow = backward and not (self._sharded or distributed or self.measuring)
        static = self._static if follow else None

        def make(options: PlanOptions, graph: Any = None) -> Program:
            return build(
                routes,
                merge_shared=merge_shared,
                options=options,
                cache=self._cache,
                checkpoints=CHECKPOINTS,
                graph=graph,
                static=static,
                backward=backward,
                probe=probe,
            )

        if self._tuner is None:
            program, trial = make(options), _NOTHING
        else:
            shape = call_shape(routes, merge_shared=merge_shared, options=options)
            program, trial = self._tuner.program(shape, options, routes, make, measure=backward)
        if backward:
            if program.graph.followed:
                self._followed += 1
            else:
                self._walked += 1
        check_walked(program, self._groups, self._options.allow_unreached)
        return program, trial


_NOTHING = contextlib.nullcontext()
