"""Random DAGs of small modules with random routes, against independent per-loss references (float64).

Each generated case: modules wired into a DAG (inputs summed, through views or scalings so the autograd graph
has pass-through nodes), weights sometimes reused by a later node, 1-4 groups (a parameter sometimes in two),
and each group's loss a random sum of terms on random nodes (it may leak into other groups, or reach none of
its own: allowed here).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import gradroute
from tests._reference import assert_grads_match, reference_grads

D = torch.float64
W = 3

ACTS = {"tanh": torch.tanh, "sin": torch.sin, "square": lambda t: t * t, "softplus": nn.functional.softplus}
WRAPS = ("direct", "view", "scale", "slice")
TERMS = ("square", "sin", "masked", "abs")


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """The heap frozen while this module runs (:func:`_collect`), unfrozen after."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _collect() -> None:
    """A full collection at the end of an example, of what the examples made only.

    Its reference cycles hold ``gradroute.checkpoint`` frames, whose segments stay recorded until they are
    collected. What survives is frozen (``gc.freeze``) with the rest of the suite's heap (torch, diffusers,
    lightning...): collections scan those objects again and again otherwise, which took most of this module's
    time when it ran after the integration tests.
    """
    gc.collect()
    gc.freeze()


@st.composite
def cases(draw):
    n_nodes = draw(st.integers(2, 6))
    nodes = []
    for k in range(n_nodes):
        srcs = draw(st.lists(st.integers(-1, k - 1), min_size=1, max_size=3, unique=True))
        nodes.append(
            {
                "srcs": srcs,
                "wraps": [draw(st.sampled_from(WRAPS)) for _ in srcs],
                "act": draw(st.sampled_from(sorted(ACTS))),
                # reuse an earlier node's module (weight sharing) sometimes
                "module": draw(st.one_of(st.just(k), st.integers(0, k))) if k else 0,
            }
        )
    n_groups = draw(st.integers(1, 4))
    owner = [draw(st.integers(0, n_groups - 1)) for _ in range(n_nodes)]
    also = draw(st.one_of(st.none(), st.tuples(st.integers(0, n_nodes - 1), st.integers(0, n_groups - 1))))
    losses = {
        g: [(draw(st.integers(0, n_nodes - 1)), draw(st.sampled_from(TERMS))) for _ in range(draw(st.integers(1, 3)))]
        for g in range(n_groups)
    }
    as_list = draw(st.booleans())
    return {"nodes": nodes, "owner": owner, "also": also, "losses": losses, "as_list": as_list, "ckpt": ()}


@st.composite
def checkpointed_cases(draw):
    """As :func:`cases`, with some nodes' module + activation run under ``gradroute.checkpoint``."""
    case = draw(cases())
    # spans [a, b) of consecutive nodes, each run as one segment (fan-outs and sums inside it)
    spans, k, n = [], 0, len(case["nodes"])
    while k < n:
        length = draw(st.integers(1, n - k))
        if draw(st.booleans()):
            spans.append((k, k + length))
        k += length
    case["ckpt"] = tuple(spans)
    # nodes per interleaved chunk of a shared segment (None: the planner's default)
    case["chunk"] = draw(st.sampled_from([None, 1, 2, 3]))
    # what pointwise ops and views make is dropped between calls and made again (these segments are small)
    case["recipes"] = draw(st.booleans())
    return case


def _wrap(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "view":
        return t.reshape(-1).reshape(t.shape)
    if how == "scale":
        return t * 0.5
    if how == "slice":
        return torch.cat([t[:, :1], t[:, 1:]], 1)
    return t


class _Block:
    def __init__(self, module, act):
        self.module, self.act = module, act

    def __call__(self, h):
        return self.act(self.module(h))


def _build(case):
    nodes = case["nodes"]
    modules = [nn.Linear(W, W).to(D) for _ in nodes]
    x = torch.randn(4, W, dtype=D)
    mask = (torch.rand(4, W) > 0.5).to(D)

    def run(k: int, outs: dict[int, torch.Tensor]) -> torch.Tensor:
        spec = nodes[k]
        h = sum(_wrap(outs[s], w) for s, w in zip(spec["srcs"], spec["wraps"]))
        return _Block(modules[spec["module"]], ACTS[spec["act"]])(h)

    def forward(outs: dict[int, torch.Tensor] | None = None):
        """The losses; ``outs``, when given, receives every node's output (by node; ``-1``: the input)."""
        outs = {} if outs is None else outs
        outs[-1] = x
        spans = dict(case["ckpt"])
        k = 0
        while k < len(nodes):
            if k not in spans:
                outs[k] = run(k, outs)
                k += 1
                continue
            a, b = k, spans[k]
            ins = sorted({s for j in range(a, b) for s in nodes[j]["srcs"] if s < a})

            def segment(*xs: torch.Tensor, a: int = a, b: int = b, ins: list[int] = ins) -> tuple[torch.Tensor, ...]:
                local = dict(zip(ins, xs))
                for j in range(a, b):
                    local[j] = run(j, local)
                return tuple(local[j] for j in range(a, b))

            outs.update(zip(range(a, b), gradroute.checkpoint(segment, *(outs[s] for s in ins))))
            k = b
        result = {}
        for g, terms in case["losses"].items():
            vals = []
            for k, kind in terms:
                o = outs[k]
                if kind == "square":
                    vals.append(o.pow(2).mean())
                elif kind == "sin":
                    vals.append(o.sin().sum() * 0.1)
                elif kind == "masked":
                    vals.append((o * mask).mean())
                else:
                    vals.append(o.abs().mean())
            result[f"g{g}"] = vals if case["as_list"] else sum(vals[1:], vals[0])
        return result

    groups: dict[str, list[torch.Tensor]] = {}
    for k, g in enumerate(case["owner"]):
        groups.setdefault(f"g{g}", []).extend(modules[k].parameters())
    if case["also"] is not None:
        k, g = case["also"]
        groups.setdefault(f"g{g}", []).extend(modules[k].parameters())
    groups = {name: list(dict.fromkeys(ps)) for name, ps in groups.items()}
    params = [p for m in modules for p in m.parameters()]
    return forward, groups, params


def _check(case):
    options = case.get("options") or gradroute.PlanOptions()
    if case.get("chunk"):
        options = dataclasses.replace(options, chunk=case["chunk"])
    if case.get("recipes"):
        options = dataclasses.replace(options, remake_min_bytes=0)
    forward, groups, params = _build(case)
    routed = {name: loss for name, loss in forward().items() if name in groups}
    names = list(routed)
    expected = reference_grads(forward, groups, names=names)
    router = gradroute.Router(groups, allow_unreached=True, plan_options=options, autotune=False)
    router.backward(routed)
    assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)

    # grads(): each group's own gradient, .grad untouched
    for p in params:
        p.grad = None
    out = router.grads({name: loss for name, loss in forward().items() if name in groups})
    assert all(p.grad is None for p in params)
    for name in names:
        ref = torch.autograd.grad(
            sum(forward()[name]) if case["as_list"] else forward()[name], groups[name], allow_unused=True
        )
        for g, r in zip(out[name], ref):
            if r is None:
                assert g is None
            else:
                torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)
    _collect()


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_generated_graphs_exact(case):
    _check(case)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(checkpointed_cases())
def test_generated_graphs_with_checkpointed_segments_exact(case):
    """Segments shared by several passes make the planner cut and interleave per segment."""
    _check(case)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(checkpointed_cases(), st.sampled_from(gradroute.Autotune.default_candidates(gradroute.PlanOptions())))
def test_generated_graphs_every_autotune_candidate_exact(case, options):
    """Every plan the measured choice may keep (``Router(autotune=...)``) is exact."""
    _check({**case, "chunk": None, "recipes": False, "options": options})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), checkpointed_cases()))
def test_generated_graphs_one_call_per_pass_exact(case):
    """``PlanOptions(split=False)``: every pass one engine call, retaining if a later pass needs its nodes."""
    _check({**case, "chunk": None, "options": gradroute.PlanOptions(split=False)})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), checkpointed_cases()), st.data())
def test_generated_graphs_freed_in_part_fail_before_any_gradient_is_written(case, data):
    """A part of the graph freed by an earlier engine call (from one node's output down to an earlier output or
    to the parameters): the routed backward either raises ``GraphFreedError`` with every ``.grad`` as it was, or
    needed nothing that was freed and is exact. With ``.grad`` empty before, the router leaves the freed check
    to the engine and empties what it wrote; with gradients of an earlier micro-batch there, it probes the
    graph before the first engine call (NOTE [Undoing a failed routed backward])."""
    forward, groups, params = _build(case)
    base: dict[int, torch.Tensor | None] = {}
    if data.draw(st.booleans(), label="gradients of an earlier micro-batch"):
        gen = torch.Generator().manual_seed(len(params))
        base = {id(p): torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params}
    routed_names = [name for name in forward() if name in groups]
    expected = reference_grads(forward, groups, names=routed_names)
    outs: dict[int, torch.Tensor] = {}
    losses = forward(outs)
    k = data.draw(st.sampled_from([j for j in sorted(outs) if j >= 0 and outs[j].requires_grad]), label="freed from")
    below = [j for j in sorted(outs) if j < k and outs[j].requires_grad] + ["params"]
    to = data.draw(st.sampled_from(below), label="down to")
    inputs = params if to == "params" else [outs[to]]
    torch.autograd.grad(outs[k].sum(), inputs, allow_unused=True)  # no retain: frees what it ran
    for p in params:
        p.grad = None if base.get(id(p)) is None else base[id(p)].clone()
    router = gradroute.Router(groups, allow_unreached=True, autotune=False)
    try:
        router.backward({name: loss for name, loss in losses.items() if name in groups})
    except gradroute.GraphFreedError:
        event("refused" + (", gradients there before" if base else ""))
        assert_grads_match(params, {}, base=base)
    else:
        event("routed")
        assert_grads_match(params, expected, base=base, rtol=1e-9, atol=1e-12)
    _collect()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # random examples, unlike the others (not derandomized): a new sample on every run
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_generated_graphs_exact_many(case):
    _check(case)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), checkpointed_cases()))
def test_generated_graphs_static_graph_exact(case):
    """``Router(static_graph=...)``: the backwards that follow paths to the plan's nodes instead of walking the
    graph route as exactly as the walked ones."""
    forward, groups, params = _build(case)
    names = [name for name in forward() if name in groups]
    expected = reference_grads(forward, groups, names=names)
    router = gradroute.Router(groups, allow_unreached=True, autotune=False, static_graph=3)
    for _ in range(4):  # walked and planned, walked and confirmed, then located twice
        for p in params:
            p.grad = None
        router.backward({name: loss for name, loss in forward().items() if name in groups})
        assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)
    assert router.graph_counts.followed == 2
    _collect()


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), checkpointed_cases()), st.data())
def test_generated_graphs_default_exact_when_a_graph_seen_many_times_changes(case, data):
    """The default router walks every backward: exact on a graph seen ten times, and on another graph of the same
    modules (other inputs, activations and views, the checkpointing dropped) right after."""
    forward, groups, params = _build(case)
    names = [name for name in forward() if name in groups]

    def routed_exactly(steps: int) -> None:
        expected = reference_grads(forward, groups, names=names)
        for _ in range(steps):
            for p in params:
                p.grad = None
            router.backward({name: loss for name, loss in forward().items() if name in groups})
            assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)

    options = gradroute.PlanOptions(split=False)
    router = gradroute.Router(groups, allow_unreached=True, autotune=False, plan_options=options)
    routed_exactly(10)
    rewire = data.draw(st.booleans())  # only other inputs (other parameters reached), or other ops too
    for k, spec in enumerate(case["nodes"]):  # the same modules, another graph
        if data.draw(st.booleans()):
            spec["srcs"] = data.draw(st.lists(st.integers(-1, k - 1), min_size=1, max_size=3, unique=True))
            spec["wraps"] = ["direct"] * len(spec["srcs"])
        if not rewire:
            spec["act"] = data.draw(st.sampled_from(sorted(ACTS)))
            spec["wraps"] = [data.draw(st.sampled_from(WRAPS)) for _ in spec["srcs"]]
    case["ckpt"] = ()  # a segment's inputs depend on the wiring
    routed_exactly(3)
    assert router.graph_counts.followed == 0
    _collect()


class _HookFailed(Exception):
    pass


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), checkpointed_cases()), st.data())
def test_generated_graphs_failing_half_way_leave_empty_gradients_empty(case, data):
    """A tensor hook on a random node's output raises on its ``n``-th call (an engine failure at a random point
    of the routed backward, after some engine calls may have written ``.grad``): with every ``.grad`` None before,
    every ``.grad`` is None after (NOTE [Undoing a failed routed backward]); if the hook never fails, the routed
    gradients are exact."""
    forward, groups, params = _build(case)
    routed_names = [name for name in forward() if name in groups]
    expected = reference_grads(forward, groups, names=routed_names)
    outs: dict[int, torch.Tensor] = {}
    losses = forward(outs)
    k = data.draw(st.sampled_from([j for j in sorted(outs) if j >= 0 and outs[j].requires_grad]), label="hooked")
    fail_at = data.draw(st.integers(1, 3), label="fails on call")
    calls = []

    def hook(g: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == fail_at:
            raise _HookFailed

    outs[k].register_hook(hook)
    for p in params:
        p.grad = None
    router = gradroute.Router(groups, allow_unreached=True, autotune=False)
    try:
        router.backward({name: loss for name, loss in losses.items() if name in groups})
    except _HookFailed:
        event("failed half-way")
        assert all(p.grad is None for p in params)
    else:
        event("never failed")
        assert_grads_match(params, expected, rtol=1e-9, atol=1e-12)
    _collect()
