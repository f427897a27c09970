"""The three unpack modes: torch-like outside a router, shared inside one, per call where shared would pile up."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import gradroute
from gradroute import _session

from .._reference import assert_grads_match, reference_grads
from ._helpers import (
    CK,
    CKS,
    Counted,
    backward_sampling_live,
    counting,
    losses,
    make,
    recomputed,
    sd_tiny,
    switch_alone,
)


def _chain(ck: CK, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, list[Counted]]:
    segs = [Counted(lambda t: nn.functional.dropout(torch.sin(t @ w), 0.3)) for _ in range(3)]
    for s in segs:
        x = ck(s, x)
    return x, segs


@pytest.mark.parametrize("how", ["backward", "grad_twice", "grad_then_backward"])
def test_outside_router_like_torch(how: str) -> None:
    results = {}
    for name, ck in CKS.items():
        torch.manual_seed(3)
        w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        y, segs = _chain(ck, x, w)
        loss = (y**2).sum()
        if how == "backward":
            loss.backward()
            grads = [w.grad, x.grad]
        elif how == "grad_twice":
            grads = [*torch.autograd.grad(loss, [w], retain_graph=True), *torch.autograd.grad(loss, [x, w])]
        else:
            grads = [*torch.autograd.grad(loss, [x], retain_graph=True)]
            loss.backward(inputs=[w])
            grads.append(w.grad)
        results[name] = (grads, [s.calls for s in segs])
    (g_ours, calls_ours), (g_torch, calls_torch) = results["gradroute"], results["torch"]
    assert calls_ours == calls_torch  # one recomputation per backward call, like torch
    for a, b in zip(g_ours, g_torch, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _peak_bytes(fn: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


def test_outside_router_same_peak_memory_as_torch() -> None:
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)

    def seg(t: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            t = torch.tanh(t @ w)
        return t

    def step(ck: CK) -> Callable[[], None]:
        def run() -> None:
            h = x
            for _ in range(6):
                h = ck(seg, h)
            h.sum().backward()
            w.grad = None

        return run

    peaks = {name: _peak_bytes(step(ck)) for name, ck in CKS.items()}
    no_ck = _peak_bytes(step(lambda f, t: f(t)))
    assert peaks["torch"] < 0.6 * no_ck  # the measurement sees checkpointing at all
    assert abs(peaks["gradroute"] - peaks["torch"]) <= 4096, peaks


def test_routed_backward_exit_drops_what_a_retained_graph_keeps() -> None:
    tenc, unet = make()
    ls = losses(tenc, unet, gradroute.checkpoint)
    params = list(unet.parameters())
    with _session.routed_backward():
        first = torch.autograd.grad(ls["unet"], params, retain_graph=True)
        again = torch.autograd.grad(ls["unet"], params, retain_graph=True)
        assert recomputed(unet) == [1, 1, 1]  # the second call is served the same recomputation
        alive = [b.storages[0] for b in unet.blocks]  # tanh's outputs (dropout's are remade: cheap ops)
        assert not any(s.expired() for s in alive)
    assert all(s.expired() for s in alive)  # graph still alive, recomputed tensors gone
    later = torch.autograd.grad(ls["unet"], params)  # a plain backward recomputes afresh
    for a, b, c in zip(first, again, later, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_recomputed_tensors_freed_with_their_node() -> None:
    tenc, unet = make()
    ls = losses(tenc, unet, gradroute.checkpoint)
    with _session.routed_backward():
        torch.autograd.grad(ls["unet"], list(unet.parameters()), retain_graph=False)
        made = [s for b in unet.blocks for s in b.storages]
        assert made and all(s.expired() for s in made)  # before the routed backward returns


@pytest.mark.parametrize("ck", ["gradroute", "torch"])
def test_diffusers_and_transformers_recompute_at_most_once_per_pass(ck: str) -> None:
    counts: dict[str, list[int]] = {"tenc": [], "unet": []}
    tenc, unet, forward = sd_tiny(counting(CKS[ck], counts))
    gradroute.Router(tenc=tenc, unet=unet).backward(**forward())
    # the first down-block resnet runs before the first cross-attention: only the unet pass enters it;
    # both passes enter every later segment (the text-encoder pass to reach encoder_hidden_states)
    n = len(counts["unet"])
    assert n >= 5 and counts["tenc"] == [1, 1]
    if ck == "torch":
        assert counts["unet"] == [1] + [2] * (n - 1), counts
    else:  # shared where the passes interleave; per call where shared ones would pile up (next test)
        assert counts["unet"][0] == 1 and set(counts["unet"]) == {1, 2}, counts


@switch_alone
def test_segments_the_passes_cannot_interleave_are_recomputed_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # diffusers' per-layer switch: its skip connections leave from un-checkpointed ops, so one text-encoder
    # call runs through a whole run of segments; shared, their recomputations would all stay alive until the
    # unet pass came through (at 512 px: several times a plain backward's peak)
    tenc, unet, forward = sd_tiny(gradroute.checkpoint)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    notes = router.plan(**losses).notes
    assert any("recomputed once per call instead of shared" in n for n in notes), notes  # printed
    live = backward_sampling_live(monkeypatch, router, losses)
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)

    share_all = gradroute.PlanOptions(held_factor=10**9)  # share every segment
    for p in groups["tenc"] + groups["unet"]:
        p.grad = None
    shared = backward_sampling_live(
        monkeypatch, gradroute.Router(tenc=tenc, unet=unet, plan_options=share_all), forward()
    )
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)
    assert max(live) < max(shared) and live[-1] == shared[-1] == 0, (live, shared)


@switch_alone
def test_grads_exact_where_segments_are_recomputed_per_call() -> None:
    tenc, unet, forward = sd_tiny(gradroute.checkpoint)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    assert any("recomputed once per call" in n for n in router.plan(**losses).notes)
    got = router.grads(**losses)
    for p, g in zip(groups["tenc"] + groups["unet"], [*got["tenc"], *got["unet"]], strict=True):
        assert p.grad is None  # grads() leaves .grad alone
        p.grad = g
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_without_interleaving_segments_are_recomputed_per_call_not_piled_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # what the router does for FSDP2's parameters (no cuts inside the segments): shared, every unet segment's
    # recomputation would stay alive from the text-encoder call to the unet call
    no_interleave = gradroute.PlanOptions(interleave=False)
    tenc, unet = make()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(lambda: losses(tenc, unet, None), groups)
    router = gradroute.Router(tenc=tenc, unet=unet, plan_options=no_interleave)
    ls = losses(tenc, unet, gradroute.checkpoint)
    assert any("recomputed once per call" in n for n in router.plan(**ls).notes)
    live = backward_sampling_live(monkeypatch, router, ls)
    assert max(live) == 0, live  # each call's recomputations are gone when it returns
    assert_grads_match(groups["tenc"] + groups["unet"], expected)

    pile_up = gradroute.PlanOptions(interleave=False, held_factor=10**9)  # shared: they pile up
    for p in groups["tenc"] + groups["unet"]:
        p.grad = None
    live = backward_sampling_live(
        monkeypatch,
        gradroute.Router(tenc=tenc, unet=unet, plan_options=pile_up),
        losses(tenc, unet, gradroute.checkpoint),
    )
    assert max(live) >= 3, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected)
