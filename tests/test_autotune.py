"""Router(autotune=...): every candidate plan exact; the measured choice tries each, keeps one, per graph."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from gradroute._autotune import _Candidate, _State

from ._reference import assert_grads_match, reference_grads, route_into_grad

D = 4
CANDIDATES = gradroute.Autotune.default_candidates(gradroute.PlanOptions(), keep_graph=True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.lin1(x)), 0.2, training=True)  # RNG replayed by the recomputation
        return x + self.lin2(h * torch.sigmoid(h))


def _model(blocks: int = 6, per_segment: int = 3) -> tuple[nn.Module, nn.Module, Callable]:
    """tenc -> unet (residual blocks, ``per_segment`` per gradroute.checkpoint segment); both losses pass
    through every unet segment, so several engine calls enter each."""
    torch.manual_seed(0)
    tenc = nn.Linear(D, D).double()
    unet = nn.ModuleList(_Block() for _ in range(blocks)).double()

    def run(h: torch.Tensor, k: int) -> torch.Tensor:
        for b in unet[k : k + per_segment]:
            h = b(h)
        return h

    def forward(extra: bool = False) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        x, target = torch.randn(5, D, generator=g, dtype=torch.float64), torch.randn(5, D, generator=g)
        mask = (torch.rand(5, D, generator=g) > 0.5).double()
        torch.manual_seed(7)
        h = tenc(x)
        if extra:  # a graph of another signature
            h = h * 1.5
        for k in range(0, blocks, per_segment):
            h = gradroute.checkpoint(run, h, k)
        loss = (h - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return tenc, unet, forward


def _groups(tenc: nn.Module, unet: nn.Module) -> dict[str, list[torch.Tensor]]:
    return {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}


def _exact_backward(router: gradroute.Router, forward: Callable, groups: dict[str, Any], expected: Any) -> None:
    params = groups["tenc"] + groups["unet"]
    for p in params:
        p.grad = None
    router.backward(**forward())
    assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)


def test_default_candidates_make_different_plans_here() -> None:
    # the graphs below exercise the candidates: most of them plan differently on it
    tenc, unet, forward = _model()
    plans = set()
    for options in CANDIDATES:
        plan = gradroute.Router(tenc=tenc, unet=unet, plan_options=options, autotune=False).plan(**forward())
        plans.add((tuple((c.retain, c.edges_in, c.edges_out, c.nodes) for c in plan.calls), plan.notes))
    assert len(plans) >= 4, plans


@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize(("blocks", "per_segment"), [(6, 3), (4, 1), (3, 3)])
@pytest.mark.parametrize("k", range(len(CANDIDATES)))
def test_every_candidate_exact(k: int, blocks: int, per_segment: int, method: str) -> None:
    tenc, unet, forward = _model(blocks, per_segment)
    groups = _groups(tenc, unet)
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet, plan_options=CANDIDATES[k], autotune=False)
    params = groups["tenc"] + groups["unet"]
    route_into_grad(router, method, forward(), params)
    assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("trials", [1, 2])
def test_measures_every_candidate_then_keeps_one_each_backward_exact(trials: int) -> None:
    tenc, unet, forward = _model()
    groups = _groups(tenc, unet)
    expected = reference_grads(forward, groups)
    # every candidate fits (tolerance inf), so each is measured
    router = gradroute.Router(
        tenc=tenc, unet=unet, autotune=gradroute.Autotune(trials=trials, memory_tolerance=math.inf)
    )
    note = next(n for n in router.plan(**forward()).notes if n.startswith("autotune"))
    n_cands = len(note.splitlines()) - 1
    assert n_cands >= 4 and "measuring" in note
    calls = 0
    while router.autotuning:
        _exact_backward(router, forward, groups, expected)
        calls += 1
        assert calls <= n_cands * trials
    assert calls >= n_cands  # every candidate ran at least once
    note = next(n for n in router.plan(**forward()).notes if n.startswith("autotune"))
    assert "chosen" in note and note.count("<- chosen") == 1 and "not run yet" not in note
    _exact_backward(router, forward, groups, expected)  # the chosen plan, for good
    assert not router.autotuning


def test_graph_with_one_call_per_pass_and_no_shared_segments_has_nothing_to_measure() -> None:
    tenc, unet = nn.Linear(D, D).double(), nn.Linear(D, D).double()
    x = torch.randn(3, D, dtype=torch.float64)
    router = gradroute.Router(tenc=tenc, unet=unet)
    plan = router.plan(tenc=tenc(x).sum(), unet=unet(x).pow(2).sum())  # losses that share no node
    assert len(plan.calls) == len(plan.passes)  # one pass here: the losses are routed together
    assert not router.autotuning
    assert not any(n.startswith("autotune") for n in plan.notes)


def _split_chain() -> tuple[nn.Module, nn.Module, Callable]:
    """A plain chain whose text encoder's pass the default plan cuts at its output (two calls for that pass)."""
    tenc, unet = nn.Linear(D, D).double(), nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).double()

    def forward() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        x, mask = torch.randn(5, D, generator=g, dtype=torch.float64), torch.rand(5, D, generator=g) > 0.5
        loss = unet(tenc(x)).pow(2)
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return tenc, unet, forward


def test_plain_graph_with_a_split_pass_has_nothing_to_measure_by_default() -> None:
    # one call per pass would keep the nodes only its retaining call ran: not a default candidate
    tenc, unet, forward = _split_chain()
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=gradroute.Autotune(trials=1, memory_tolerance=math.inf))
    plan = router.plan(**forward())
    assert len(plan.calls) > len(plan.passes)
    assert not router.autotuning
    assert not any(n.startswith("autotune") for n in plan.notes)


def test_plain_graph_with_a_split_pass_measures_one_call_per_pass_exactly_with_keep_graph() -> None:
    tenc, unet, forward = _split_chain()
    groups = _groups(tenc, unet)
    params = groups["tenc"] + groups["unet"]
    expected = reference_grads(forward, groups)
    autotune = gradroute.Autotune(trials=1, memory_tolerance=math.inf, keep_graph=True)
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=autotune)
    plan = router.plan(**forward())
    assert len(plan.calls) > len(plan.passes)  # the text encoder's pass is cut at its output
    note = next(n for n in plan.notes if n.startswith("autotune"))
    assert "measuring" in note and "PlanOptions(split=False)" in note
    one_call = gradroute.Router(tenc=tenc, unet=unet, plan_options=gradroute.PlanOptions(split=False), autotune=False)
    assert len(one_call.plan(**forward()).calls) == len(plan.passes)
    while router.autotuning:
        _exact_backward(router, forward, groups, expected)
    _exact_backward(router, forward, groups, expected)
    for options in (gradroute.PlanOptions(split=False), gradroute.PlanOptions(split=False, interleave=False)):
        route_into_grad(gradroute.Router(**groups, plan_options=options, autotune=False), "grads", forward(), params)
        assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)


def test_new_signature_measured_again_and_a_seen_one_reuses_its_choice() -> None:
    tenc, unet, forward = _model()
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=gradroute.Autotune(trials=1))
    router.backward(**forward())
    assert router.autotuning
    while router.autotuning:
        router.backward(**forward())
    router.backward(**forward(extra=True))
    assert router.autotuning
    while router.autotuning:
        router.backward(**forward(extra=True))
    router.backward(**forward())
    assert not router.autotuning


def test_autotune_false_always_plans_with_plan_options() -> None:
    tenc, unet, forward = _model()
    options = gradroute.PlanOptions(held_factor=0.0)
    router = gradroute.Router(tenc=tenc, unet=unet, plan_options=options, autotune=False)
    assert router.autotune is None
    want = gradroute.Router(tenc=tenc, unet=unet, plan_options=options, autotune=False).plan(**forward())
    for _ in range(3):
        router.backward(**forward())
        assert not router.autotuning
    assert router.plan(**forward()) == want


def test_custom_candidates_measured_in_order() -> None:
    tenc, unet, forward = _model()
    cands = (gradroute.PlanOptions(held_factor=0.0), gradroute.PlanOptions(chunk=2))
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=gradroute.Autotune(trials=1, candidates=cands))
    note = next(n for n in router.plan(**forward()).notes if n.startswith("autotune"))
    assert note.splitlines()[1].startswith("  #0 PlanOptions(held_factor=0.0)")
    assert note.splitlines()[2].startswith("  #1 PlanOptions(chunk=2)")


@pytest.mark.parametrize(
    ("times", "peaks", "chosen"),
    [
        ([3.0, 1.0, 2.0], [100, 100, 100], 1),  # the fastest
        ([3.0, 1.0, 2.0], [100, 120, 105], 2),  # the fastest within 10% of the lowest peak
        ([1.0, 2.0, 3.0], [150, 100, 100], 1),
        ([2.0, 2.0, 3.0], [100, 100, 100], 0),  # a tie keeps the earlier candidate (the router's options)
    ],
)
def test_choice_is_the_fastest_within_the_memory_tolerance(times: list[float], peaks: list[int], chosen: int) -> None:
    cands = [_Candidate(gradroute.PlanOptions(chunk=k + 1)) for k in range(3)]
    state = _State([], cands, resident=0, largest=0, trials=1, tolerance=0.1)
    for k, (t, p) in enumerate(zip(times, peaks, strict=True)):
        assert state.next() == k
        state.record(k, t, held=p)
    assert state.chosen == chosen


def test_a_candidate_that_fails_is_not_run_again_nor_chosen() -> None:
    cands = [_Candidate(gradroute.PlanOptions(chunk=k + 1)) for k in range(3)]
    state = _State([], cands, resident=0, largest=0, trials=2, tolerance=0.1)
    state.record(0, 2.0, held=100)
    state.fail(1)  # e.g. out of memory: the router's next backward runs the next candidate
    state.record(2, 1.0, held=100)
    assert state.queue == [0, 2]
    state.record(0, 2.0, held=100)
    state.record(2, 1.0, held=100)
    assert state.chosen == 2 and cands[1].failed


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"trials": 0}, ValueError, r"`trials` must be at least 1, got 0"),
        ({"trials": 1.5}, TypeError, r"`trials` must be an int, got float"),
        ({"memory_tolerance": -0.1}, ValueError, r"`memory_tolerance` must be at least 0, got -0.1"),
        ({"memory_tolerance": "10%"}, TypeError, r"`memory_tolerance` must be a number, got str"),
        ({"candidates": ()}, TypeError, r"`candidates` must be a non-empty tuple of gradroute.PlanOptions"),
        ({"candidates": (1,)}, TypeError, r"`candidates` must be a non-empty tuple of gradroute.PlanOptions"),
        ({"keep_graph": 1}, TypeError, r"`keep_graph` must be a bool, got int \(1\)"),
    ],
)
def test_bad_autotune_settings_fail(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        gradroute.Autotune(**kwargs)


def test_bad_autotune_argument_fails() -> None:
    with pytest.raises(TypeError, match=r"`autotune` must be a bool or a gradroute.Autotune, got str"):
        gradroute.Router(a=nn.Linear(2, 2), autotune="yes")  # type: ignore[arg-type]


def test_router_shared_by_threads_through_grads_exact_while_measuring() -> None:
    # four threads route through one router while its measured choice is trying candidates: every result exact.
    # In a process of its own: under torch 2.5, threads leave dynamo unable to compile in the process afterwards
    # (torch's own state, not the router's), which would fail later tests that compile
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    run = subprocess.run(
        [sys.executable, "-m", "tests._threaded_grads"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"errors": [], "autotuning": False}


def test_plan_note_counts_the_trial_backwards_and_their_cost() -> None:
    tenc, unet, forward = _model()
    router = gradroute.Router(tenc=tenc, unet=unet, autotune=gradroute.Autotune(trials=2))
    trials = 0
    while True:
        router.backward(**forward())
        trials += 1
        if not router.autotuning:
            break
    note = next(n for n in router.plan(**forward()).notes if n.startswith("autotune"))
    head = note.splitlines()[0]
    assert f"; {trials} trial backwards, " in head and head.endswith(" ms more than the chosen plan's")
