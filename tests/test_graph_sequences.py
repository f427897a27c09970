"""The default ``Router`` over generated sequences of graphs: every step against fresh per-loss references.

Hypothesis draws two or three variants of one training step (token batches through a tied embedding or
feature batches, an adapter that joins late, a branch, ``gradroute.checkpoint`` toggled, another second loss)
taking turns with a period of 1-5 (from the start, or after the first ran alone for a while), parameters
frozen and unfrozen for a while, some steps accumulating onto the previous gradients, some steps from empty
gradients failing in a hook; optionally the UNet through ``gradroute.compile``. Each step's ``.grad`` is
compared with ``torch.autograd.grad`` of each loss on its own fresh forward, in float64; after a failure every
``.grad`` is as it was before the step.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradroute
from tests._reference import assert_grads_match, reference_grads

D = torch.float64
STEPS = 60


@st.composite
def variants(draw):
    return {
        "tokens": draw(st.booleans()),  # through the embedding (tied between the groups when `tied`)
        "adapter_from": draw(st.sampled_from([None, 0, 10, 25, 45])),  # the adapter joins the path at this step
        "branch": draw(st.sampled_from(["none", "scale", "sin"])),
        "ckpt": draw(st.sampled_from(["none", "gradroute", "torch"])),
        "second": draw(st.sampled_from(["half", "masked", "sin"])),
    }


@st.composite
def sequences(draw):
    n = draw(st.integers(2, 3))
    frozen = draw(st.sampled_from([None, "adapter", "tenc0", "unet2"]))
    start = draw(st.integers(0, STEPS - 1))
    return {
        "variants": [draw(variants()) for _ in range(n)],
        "period": draw(st.integers(1, 5)),
        "turns_from": draw(st.sampled_from([0, 14, 30])),  # the first variant alone until this step
        "tied": draw(st.booleans()),  # the embedding in both groups
        "shared": draw(st.booleans()),  # one Linear in both networks (and both groups)
        "frozen": (frozen, start, draw(st.integers(start, STEPS))) if frozen else None,
        "accumulate_every": draw(st.sampled_from([0, 3, 7])),  # 0: every step from empty gradients
        "fail_every": draw(st.sampled_from([0, 5, 11])),
        "compiled": False,
    }


class _Nets:
    def __init__(self, shared: bool) -> None:
        self.emb, self.adapter = nn.Embedding(20, 8).to(D), nn.Linear(8, 8).to(D)
        self.tenc = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8)).to(D)
        self.unet = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 6)).to(D)
        if shared:
            self.unet[0] = self.tenc[0] = nn.Linear(8, 12).to(D)  # one module in both networks
        self.unet_run = self.unet

    def frozen(self, which: str | None) -> list[torch.Tensor]:
        return {
            None: [],
            "adapter": list(self.adapter.parameters()),
            "tenc0": list(self.tenc[0].parameters()),
            "unet2": list(self.unet[2].parameters()),
        }[which]


def _unet(nets: _Nets, h: torch.Tensor, ckpt: str) -> torch.Tensor:
    if ckpt == "gradroute":
        return gradroute.checkpoint(nets.unet_run, h)
    if ckpt == "torch":
        return torch.utils.checkpoint.checkpoint(nets.unet_run, h, use_reentrant=False)
    return nets.unet_run(h)


def _forward(nets: _Nets, v: dict, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    target = torch.randn(4, 6, generator=g, dtype=D)
    if v["tokens"]:
        h = nets.emb(torch.randint(0, 20, (4, 3), generator=g)).mean(1)
    else:
        h = torch.randn(4, 8, generator=g, dtype=D)
    if v["adapter_from"] is not None and step >= v["adapter_from"]:
        h = h + torch.tanh(nets.adapter(h))
    hidden = nets.tenc(h)
    if v["tokens"]:
        hidden = hidden + 0.1 * h
    pred = _unet(nets, hidden, v["ckpt"])
    if v["branch"] == "scale":
        pred = pred * 1.5
    elif v["branch"] == "sin":
        pred = torch.sin(pred)
    err = (pred - target).pow(2)
    second = {"half": err[:2].mean(), "masked": (err * (target > 0)).mean(), "sin": torch.sin(err).mean()}
    return {"tenc": err.mean(), "unet": second[v["second"]]}


def _groups(nets: _Nets, tied: bool) -> dict[str, list[torch.Tensor]]:
    tenc = [*nets.emb.parameters(), *nets.adapter.parameters(), *nets.tenc.parameters()]
    unet = [*(nets.emb.parameters() if tied else ()), *nets.unet.parameters()]
    return {"tenc": list({id(p): p for p in tenc}.values()), "unet": list({id(p): p for p in unet}.values())}


class _Failed(Exception):
    pass


def _step(router, nets, groups, params, v, step, *, accumulate: bool, fail: bool) -> None:
    """One routed backward of step ``step``, against the references (or, failing, everything as before)."""
    forward = functools.partial(_forward, nets, v, step)
    trainable = {n: [p for p in ps if p.requires_grad] for n, ps in groups.items()}
    expected = reference_grads(forward, trainable)
    if not accumulate:
        for p in params:
            p.grad = None
    before = {id(p): None if p.grad is None else p.grad.clone() for p in params}
    losses = forward()
    if fail:
        calls = []

        def hook(grad: torch.Tensor) -> None:
            calls.append(1)
            if len(calls) == 2:
                raise _Failed

        losses["tenc"].grad_fn.register_prehook(lambda g: hook(g[0]))
        losses["unet"].grad_fn.register_prehook(lambda g: hook(g[0]))
    try:
        router.backward(**losses)
    except _Failed:
        for p in params:  # everything as it was before the step
            b = before[id(p)]
            assert (p.grad is None) if b is None else torch.equal(p.grad, b)
        return
    assert_grads_match(params, expected, base=before, rtol=1e-9, atol=1e-12)


def _run(seq: dict) -> None:
    torch.manual_seed(0)
    nets = _Nets(seq["shared"])
    if seq["compiled"]:
        nets.unet_run = gradroute.compile(nets.unet, backend="aot_eager")
    groups = _groups(nets, seq["tied"])
    params = list({id(p): p for ps in groups.values() for p in ps}.values())
    router = gradroute.Router(groups, allow_unreached=True)
    which, start, end = seq["frozen"] or (None, 0, 0)
    for step in range(STEPS):
        turn = 0 if step < seq["turns_from"] else (step // seq["period"]) % len(seq["variants"])
        v = seq["variants"][turn]
        frozen = nets.frozen(which) if start <= step < end else []
        for p in frozen:
            p.requires_grad_(False)
        try:
            every, fail_every = seq["accumulate_every"], seq["fail_every"]
            accumulate = bool(every) and step % every != 0
            # a failure is undone where every .grad was None (NOTE [Undoing a failed routed backward])
            fail = bool(fail_every) and step % fail_every == fail_every - 1 and not accumulate
            _step(router, nets, groups, params, v, step, accumulate=accumulate, fail=fail)
        finally:
            for p in frozen:
                p.requires_grad_(True)


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@settings(max_examples=20, derandomize=True, **_SETTINGS)
@given(sequences())
def test_default_router_exact_on_generated_sequences_of_graphs(seq):
    _run(seq)


@pytest.mark.parametrize("period", [1, 2, 3])
def test_default_router_exact_on_sequences_through_a_compiled_unet(period):
    variant = {"tokens": True, "adapter_from": 10, "branch": "none", "ckpt": "none", "second": "half"}
    other = {**variant, "tokens": False, "branch": "scale", "adapter_from": None}
    seq = {
        "variants": [variant, other],
        "period": period,
        "turns_from": 14,
        "tied": True,
        "shared": False,
        "frozen": ("adapter", 20, 30),
        "accumulate_every": 3,
        "fail_every": 0,
        "compiled": True,
    }
    _run(seq)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=500, **_SETTINGS)
@given(sequences())
def test_default_router_exact_on_generated_sequences_of_graphs_many(seq):
    _run(seq)
