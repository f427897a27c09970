"""gradroute._step: Router.step() with AMP and several optimizers, clipping, hooks, accumulation, schedulers,
resume, stats, call order.

The references follow PyTorch's AMP notes ("Working with multiple models, losses, and optimizers") line by line,
with an independent forward per loss; they never call gradroute (``tests/_step_setup.py``).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from gradroute.schedules import warmup_power
from tests._state import assert_same, whole_state
from tests._step_setup import (
    INF,
    PRECISIONS,
    Setup,
    assert_params,
    backward_again,
    loss_dict,
    losses,
    make_batches,
    make_nets,
    make_scaler,
    reference_step,
    trained_once,
)

# ---------------------------------------------------------------------- AMP against the reference


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw-foreach", "adamw-fused", "seed"])
def test_step_matches_amp_reference(precision: str, opt_kind: str) -> None:
    ours, ref = Setup(opt_kind, precision), Setup(opt_kind, precision)
    router = ours.router(max_t=0.05)
    for k, batch in enumerate(make_batches(3)):
        expected = reference_step(ref, batch, 0.05, None)
        loss_tenc, loss_unet = losses(ours.tenc, ours.unet, batch, ours.dtype)
        router.backward(tenc=loss_tenc, unet=loss_unet)
        stats = router.step()
        assert not stats.accumulating and stats.step == k + 1 and stats.micro_step == 1
        assert stats.scale == expected["scale"]
        for i, name in enumerate(("tenc", "unet")):
            s = stats[name]
            assert not s.skipped
            assert s.lr == expected["lr"][i]
            assert s.loss == pytest.approx(expected["loss"][i], rel=1e-6)
            assert s.grad_norm == pytest.approx(expected["grad_norm"][i], rel=1e-5)
        assert_params(ours.params(), ref.params(), rtol=1e-5, atol=1e-7)
        assert all(p.grad is None for m in (ours.tenc, ours.unet) for p in m.parameters())
    assert ours.sched_t.last_epoch == ref.sched_t.last_epoch == 3
    if ours.scaler is not None:
        assert ours.scaler.state_dict() == ref.scaler.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "fp16-scaler"])
def test_clipping_per_group_equals_clip_grad_norm_on_unscaled_grads(precision: str) -> None:
    # SGD with lr 1 and no momentum: the update is exactly minus the clipped gradient.
    dtype, scaler_kwargs = PRECISIONS[precision]
    tenc, unet = make_nets()
    opt_t, opt_u = torch.optim.SGD(tenc.parameters(), lr=1.0), torch.optim.SGD(unet.parameters(), lr=1.0)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opt_t, max_grad_norm=0.01),
        unet=gradroute.Group(unet, optimizer=opt_u, max_grad_norm=0.02),
        scaler=make_scaler(scaler_kwargs),
    )
    batch = make_batches(1)[0]
    ref_t, ref_u = make_nets()
    grads = []
    for params, which in ((list(ref_t.parameters()), 0), (list(ref_u.parameters()), 1)):
        loss = losses(ref_t, ref_u, batch, dtype)[which]  # independent forward per loss, unscaled
        grads.append(torch.autograd.grad(loss, params))
    before = [p.detach().clone() for m in (tenc, unet) for p in m.parameters()]
    loss_tenc, loss_unet = losses(tenc, unet, batch, dtype)
    router.backward(tenc=loss_tenc, unet=loss_unet)
    stats = router.step()
    after = [p.detach() for m in (tenc, unet) for p in m.parameters()]
    expected_updates = []
    for gs, max_norm, name in ((grads[0], 0.01, "tenc"), (grads[1], 0.02, "unet")):
        clipped = [g.clone() for g in gs]
        norm = torch.nn.utils.clip_grad_norm_([_with_grad(g) for g in clipped], max_norm)
        assert float(norm) > max_norm  # clipping is active
        assert stats[name].grad_norm == pytest.approx(float(norm), rel=1e-4)
        expected_updates += clipped
    for b, a, u in zip(before, after, expected_updates, strict=True):
        torch.testing.assert_close(b - a, u, rtol=1e-3, atol=1e-6)


def _with_grad(g: torch.Tensor) -> torch.Tensor:
    """A leaf whose ``.grad`` is ``g`` itself, so ``clip_grad_norm_`` clips ``g`` in place."""
    p = torch.zeros_like(g, requires_grad=True)
    p.grad = g
    return p


def test_grad_hook_sees_unscaled_gradients_before_clipping_and_can_reweight() -> None:
    tenc, unet = make_nets()
    seen: list[torch.Tensor] = []

    def hook(params: list[torch.Tensor]) -> None:
        seen.extend(p.grad.clone() for p in params)
        for p in params:
            p.grad.mul_(2.0)

    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=1.0), grad_hook=hook),
        unet=gradroute.Group(unet, optimizer=torch.optim.SGD(unet.parameters(), lr=1.0)),
        scaler=torch.amp.GradScaler("cpu", init_scale=1024.0),
    )
    batch = make_batches(1)[0]
    ref_t, ref_u = make_nets()
    expected = torch.autograd.grad(losses(ref_t, ref_u, batch, None)[0], list(ref_t.parameters()))
    before = [p.detach().clone() for p in tenc.parameters()]
    router.backward(loss_dict(tenc, unet, batch, None))
    stats = router.step()
    assert len(seen) == len(expected)
    for s, e in zip(seen, expected, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-8)  # unscaled: not 1024 times larger
    for b, p, e in zip(before, tenc.parameters(), expected, strict=True):
        torch.testing.assert_close(b - p.detach(), 2.0 * e, rtol=1e-5, atol=1e-7)  # the hook's weighting applied
    norm_after_hook = torch.linalg.vector_norm(torch.stack([2.0 * e.norm() for e in expected]))
    assert stats["tenc"].grad_norm == pytest.approx(float(norm_after_hook), rel=1e-5)


# ---------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("scaler_kwargs", [None, {"init_scale": 2.0**12}])
@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulation_equals_one_big_batch(accumulate: int, scaler_kwargs: dict | None) -> None:
    tenc, unet = make_nets(dtype=torch.float64)
    opt_t = torch.optim.SGD(tenc.parameters(), lr=0.1, momentum=0.9)
    opt_u = torch.optim.SGD(unet.parameters(), lr=0.2, momentum=0.9)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opt_t),
        unet=gradroute.Group(unet, optimizer=opt_u),
        scaler=make_scaler(scaler_kwargs),
        accumulate=accumulate,
    )
    ref_t, ref_u = make_nets(dtype=torch.float64)
    ref_opt_t = torch.optim.SGD(ref_t.parameters(), lr=0.1, momentum=0.9)
    ref_opt_u = torch.optim.SGD(ref_u.parameters(), lr=0.2, momentum=0.9)
    for big in make_batches(2, size=8, dtype=torch.float64):
        # Reference: one step on the whole batch, each loss with its own forward.
        big_losses = []
        for params, which in ((list(ref_t.parameters()), 0), (list(ref_u.parameters()), 1)):
            loss = losses(ref_t, ref_u, big, None)[which]
            big_losses.append(loss.item())
            for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                p.grad = g
        ref_opt_t.step()
        ref_opt_u.step()
        # Ours: the same batch in `accumulate` micro-batches, one forward each.
        size = 8 // accumulate
        for k in range(accumulate):
            micro = tuple(t[k * size : (k + 1) * size] for t in big)
            before = [p.detach().clone() for m in (tenc, unet) for p in m.parameters()]
            router.backward(loss_dict(tenc, unet, micro, None))
            stats = router.step()
            assert stats.micro_step == k + 1
            assert stats.accumulating is (k + 1 < accumulate)
            if stats.accumulating:
                assert_params([p.detach() for m in (tenc, unet) for p in m.parameters()], before, rtol=0, atol=0)
        for i, name in enumerate(("tenc", "unet")):
            assert stats[name].loss == pytest.approx(big_losses[i], rel=1e-6)
        assert_params(
            [p.detach() for m in (tenc, unet) for p in m.parameters()],
            [p.detach() for m in (ref_t, ref_u) for p in m.parameters()],
            rtol=1e-10,
            atol=1e-12,
        )


def test_zero_grad_inside_a_window_restarts_it() -> None:
    s = Setup("sgd", "fp32")
    router = s.router(accumulate=3)
    batches = make_batches(4)
    router.backward(loss_dict(s.tenc, s.unet, batches[0], None))
    assert router.step().micro_step == 1
    router.zero_grad()
    assert all(p.grad is None for m in (s.tenc, s.unet) for p in m.parameters())
    with pytest.raises(RuntimeError, match="no `backward"):
        router.step()
    for k, batch in enumerate(batches[1:]):
        router.backward(loss_dict(s.tenc, s.unet, batch, None))
        stats = router.step()
        assert stats.micro_step == k + 1
    assert stats.accumulating is False and stats.step == 1


def test_group_without_gradient_is_skipped_and_its_schedule_waits() -> None:
    s = Setup("adamw-foreach", "fp16-scaler")
    router = s.router()
    unet_before = [p.detach().clone() for p in s.unet.parameters()]
    loss_tenc, _ = losses(s.tenc, s.unet, make_batches(1)[0], s.dtype)
    router.backward(tenc=loss_tenc)
    stats = router.step()
    assert stats["unet"].skipped and stats["unet"].loss is None and stats["unet"].grad_norm is None
    assert not stats["tenc"].skipped and stats["tenc"].loss == pytest.approx(loss_tenc.item())
    assert all(torch.equal(b, p) for b, p in zip(unet_before, s.unet.parameters(), strict=True))
    assert s.opt_u.state_dict()["state"] == {}
    assert (s.sched_t.last_epoch, s.sched_u.last_epoch) == (1, 0)


# ---------------------------------------------------------------------- resume


def _resume_run(seed: int) -> tuple[nn.Module, nn.Module, gradroute.Router, torch.amp.GradScaler]:
    tenc, unet = make_nets(seed)
    opt_t = torch.optim.AdamW(tenc.parameters(), lr=1e-2, weight_decay=1e-2, betas=(0.9, 0.99), fused=True)
    opt_u = torch.optim.AdamW(unet.parameters(), lr=2e-2, weight_decay=1e-3, betas=(0.9, 0.99), fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    router = gradroute.Router(
        tenc=gradroute.Group(
            tenc, optimizer=opt_t, scheduler=warmup_power(opt_t, 3, 2.0, 10, random=True, seed=7), max_grad_norm=0.5
        ),
        unet=gradroute.Group(unet, optimizer=opt_u, scheduler=warmup_power(opt_u, 3, 5.0, 10, min_lr_ratio=0.1)),
        scaler=scaler,
        accumulate=2,
    )
    return tenc, unet, router, scaler


def _micro_batch(tenc: nn.Module, unet: nn.Module, router: gradroute.Router, batch: tuple) -> None:
    loss_tenc, loss_unet = losses(tenc, unet, batch, torch.float16)
    router.backward(tenc=loss_tenc, unet=loss_unet)


@pytest.mark.parametrize("save_at", ["after_step", "inside_window", "after_backward"])
def test_resume_is_bit_identical(save_at: str, tmp_path: Path) -> None:
    batches = make_batches(20, size=4)  # 10 real steps of 2 micro-batches
    cut = {"after_step": 10, "inside_window": 11, "after_backward": 10}[save_at]

    tenc_a, unet_a, router_a, scaler_a = _resume_run(0)
    for batch in batches:
        _micro_batch(tenc_a, unet_a, router_a, batch)
        last_a = router_a.step()

    tenc_b, unet_b, router_b, _ = _resume_run(0)
    for batch in batches[:cut]:
        _micro_batch(tenc_b, unet_b, router_b, batch)
        router_b.step()
    if save_at == "after_backward":
        _micro_batch(tenc_b, unet_b, router_b, batches[cut])
    path = tmp_path / "ckpt.pt"
    torch.save({"tenc": tenc_b.state_dict(), "unet": unet_b.state_dict(), "router": router_b.state_dict()}, path)
    del tenc_b, unet_b, router_b

    tenc_c, unet_c, router_c, scaler_c = _resume_run(123)  # other weights: everything must come from the file
    ckpt = torch.load(path, weights_only=True)
    tenc_c.load_state_dict(ckpt["tenc"])
    unet_c.load_state_dict(ckpt["unet"])
    router_c.load_state_dict(ckpt["router"])
    if save_at == "after_backward":
        router_c.step()
        cut += 1
    for batch in batches[cut:]:
        _micro_batch(tenc_c, unet_c, router_c, batch)
        last_c = router_c.step()

    for a, c in zip(
        [*tenc_a.parameters(), *unet_a.parameters()], [*tenc_c.parameters(), *unet_c.parameters()], strict=True
    ):
        assert torch.equal(a, c)
    assert scaler_c.state_dict() == scaler_a.state_dict()
    assert scaler_a.get_scale() > 2.0**10  # the scale grew during the run, so its state mattered
    assert last_c == last_a and last_c.step == last_a.step == 10
    for name in ("tenc", "unet"):
        assert router_c.groups[name].scheduler.state_dict() == router_a.groups[name].scheduler.state_dict()


# ---------------------------------------------------------------------- resume from any point of a window


def _window_run(seed: int, scaler: bool) -> tuple[nn.Module, nn.Module, gradroute.Router]:
    tenc, unet = make_nets(seed)
    opt_t = torch.optim.AdamW(tenc.parameters(), lr=1e-2, weight_decay=1e-2)
    opt_u = torch.optim.AdamW(unet.parameters(), lr=2e-2)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opt_t, scheduler=warmup_power(opt_t, 2, 2.0, 10), max_grad_norm=0.5),
        unet=gradroute.Group(unet, optimizer=opt_u, scheduler=warmup_power(opt_u, 2, 3.0, 10)),
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1) if scaler else None,
        accumulate=3,
    )
    return tenc, unet, router


def _events(n_batches: int) -> list[tuple[str, int]]:
    return [(what, k) for k in range(n_batches) for what in ("backward", "step")]


def _play(tenc: nn.Module, unet: nn.Module, router: gradroute.Router, events: list, dtype: Any) -> list:
    batches = make_batches(9, size=4)
    out = []
    for what, k in events:
        if what == "backward":
            router.backward(loss_dict(tenc, unet, batches[k], dtype))
        else:
            out.append(router.step())
    return out


@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("cut", range(6, 12))  # after each backward and each step() of the second window
def test_resume_anywhere_in_a_window_is_bit_identical(cut: int, scaler: bool) -> None:
    dtype = torch.float16 if scaler else None
    events = _events(9)  # 3 real steps of 3 micro-batches
    tenc_a, unet_a, router_a = _window_run(0, scaler)
    stats_a = _play(tenc_a, unet_a, router_a, events, dtype)

    tenc_b, unet_b, router_b = _window_run(0, scaler)
    _play(tenc_b, unet_b, router_b, events[:cut], dtype)
    buffer = io.BytesIO()
    torch.save({"tenc": tenc_b.state_dict(), "unet": unet_b.state_dict(), "router": router_b.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)

    tenc_c, unet_c, router_c = _window_run(123, scaler)  # other weights: everything must come from the file
    tenc_c.load_state_dict(ckpt["tenc"])
    unet_c.load_state_dict(ckpt["unet"])
    router_c.load_state_dict(ckpt["router"])
    stats_c = _play(tenc_c, unet_c, router_c, events[cut:], dtype)

    assert stats_c == stats_a[-len(stats_c) :]  # reported losses and norms included, to the last bit
    assert [s.step for s in stats_c] == [s.step for s in stats_a[-len(stats_c) :]]
    assert_same(whole_state(router_a), whole_state(router_c))


# ---------------------------------------------------------------------- the seed's setup, the stats and the docs


def test_seed_setup_steps_with_the_scheduled_learning_rates() -> None:
    s = Setup("seed", "fp16-scaler", schedule=(30, 5, 100))
    router = s.router(max_t=1.0, max_u=1.0)
    for k, batch in enumerate(make_batches(4)):
        router.backward(loss_dict(s.tenc, s.unet, batch, s.dtype))
        stats = router.step()
        assert stats["tenc"].lr == pytest.approx(1e-07 * (k + 1) / 30, rel=1e-12)
        assert stats["unet"].lr == pytest.approx(1e-06 * (k + 1) / 30, rel=1e-12)
        assert not stats["tenc"].skipped and not stats["unet"].skipped
    for opt in (s.opt_t, s.opt_u):
        assert opt.defaults["fused"] is True
        assert all(float(st["step"]) == 4 for st in opt.state.values())


def test_stats_are_a_dict_of_group_stats() -> None:
    s, router = trained_once()
    backward_again(s, router)
    stats = router.step()
    assert isinstance(stats, dict) and set(stats) == {"tenc", "unet"}
    assert isinstance(stats["tenc"], gradroute.GroupStats)
    assert "StepStats(accumulating=False, micro_step=1/1, step=2" in repr(stats)


def test_skip_reason_tells_nonfinite_from_no_gradient():
    a, b, c = (torch.nn.Linear(3, 3) for _ in range(3))
    router = gradroute.Router(
        a=gradroute.Group(a, optimizer=torch.optim.SGD(a.parameters(), lr=0.1)),
        b=gradroute.Group(b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1)),
        c=gradroute.Group(c, optimizer=torch.optim.SGD(c.parameters(), lr=0.1)),
        scaler=torch.amp.GradScaler("cpu"),
    )
    x = torch.randn(2, 3)
    router.backward(a=a(x).sum() * float("inf"), b=b(x).sum())
    stats = router.step()
    assert (stats["a"].skipped, stats["a"].skip_reason) == (True, "nonfinite")
    assert (stats["b"].skipped, stats["b"].skip_reason) == (False, None)
    assert (stats["c"].skipped, stats["c"].skip_reason) == (True, "no_grad")


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_recorded_loss_is_a_copy_in_float32_at_least(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tenc, unet = make_nets()
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)),
        unet=gradroute.Group(unet, optimizer=torch.optim.SGD(unet.parameters(), lr=0.1)),
    )
    x, target, mask = make_batches(1)[0]
    loss = (unet(tenc(x)) - target).pow(2)
    loss_tenc, loss_unet = loss.mean().to(dtype).reshape(shape), (loss * mask).mean().to(dtype).reshape(shape)
    expected = {"tenc": loss_tenc.item(), "unet": loss_unet.item()}
    router.backward(tenc=loss_tenc, unet=loss_unet)
    with torch.no_grad():  # the caller reuses its loss tensors: what was recorded is a copy
        loss_tenc.add_(100.0)
        loss_unet.add_(100.0)
    stats = router.step()
    for name, value in expected.items():
        assert stats[name].loss == value  # exact: a low-precision value is exactly representable in float32


def test_docstring_examples_run() -> None:
    import doctest

    import gradroute._step

    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [
        *doctest.DocTestFinder().find(gradroute._step, "gradroute._step", globs={}),
        *doctest.DocTestFinder().find(gradroute.Router.step, "Router.step", globs={}),
    ]
    assert sum(len(t.examples) for t in tests) >= 8
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0


# ---------------------------------------------------------------------- call order


def test_step_without_backward_fails() -> None:
    s = Setup("sgd", "fp32")
    router = s.router()
    with pytest.raises(RuntimeError, match=r"no `backward\(\)` since the last `step\(\)`"):
        router.step()


def test_step_twice_after_one_backward_fails() -> None:
    _, router = trained_once()
    before = whole_state(router)
    with pytest.raises(RuntimeError, match=r"no `backward\(\)` since the last `step\(\)` \(state: ready\)"):
        router.step()
    assert_same(before, whole_state(router))


# ---------------------------------------------------------------------- non-finite gradients without a scaler


def _nonfinite_run(skip: bool | None, max_norm: float | None) -> tuple[gradroute.Router, list[nn.Module]]:
    """``skip`` None: the router's default."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b)]
    router = gradroute.Router(
        a=gradroute.Group(a, optimizer=opts[0], scheduler=warmup_power(opts[0], 2, 2.0, 10), max_grad_norm=max_norm),
        b=gradroute.Group(b, optimizer=opts[1], scheduler=warmup_power(opts[1], 2, 2.0, 10), max_grad_norm=max_norm),
        **({} if skip is None else {"skip_nonfinite": skip}),
    )
    x = torch.randn(2, 3)
    router.backward(a=a(x).sum(), b=b(x).sum())
    router.step()  # momentum buffers exist
    router.backward(a=a(torch.tensor([[INF, 1.0, 1.0]])).sum(), b=b(x).sum())
    return router, [a, b]


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_nonfinite_gradient_without_scaler_skips_only_that_group(max_norm: float | None) -> None:
    router, _ = _nonfinite_run(True, max_norm)
    ref, _ = _nonfinite_run(True, max_norm)
    before = whole_state(router)
    stats = router.step()
    assert (stats["a"].skipped, stats["a"].skip_reason) == (True, "nonfinite")
    assert not math.isfinite(stats["a"].grad_norm)
    assert (stats["b"].skipped, stats["b"].skip_reason) == (False, None)
    after = whole_state(router)
    for key in ("params", "optimizer", "scheduler"):
        assert_same(before["a"][key], after["a"][key])
    # group b stepped as it would alone
    g = ref.groups["b"]
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(g.params, max_norm)
    g.optimizer.step()
    g.scheduler.step()
    assert_same([p.detach() for p in g.params], after["b"]["params"])
    assert all(p.grad is None for grp in router.groups.values() for p in grp.params)


def _fused_nonfinite_run(bad: float, dtype: torch.dtype) -> gradroute.Router:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3).to(dtype), nn.Linear(3, 3).to(dtype)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (a, b)]
    groups = {"a": gradroute.Group(a, optimizer=opts[0]), "b": gradroute.Group(b, optimizer=opts[1])}
    router = gradroute.Router(groups, skip_nonfinite=True)
    x = torch.randn(2, 3, dtype=dtype)
    router.backward(a=a(x).sum(), b=b(x).sum())
    router.step()  # AdamW state exists
    router.backward(a=a(torch.tensor([[bad, 1.0, 1.0]], dtype=dtype)).sum(), b=b(x).sum())
    return router


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_gradient_skips_a_fused_optimizer_on_the_device(bad: float, dtype: torch.dtype) -> None:
    """The skip that fused optimizers take from ``found_inf``, without a host sync: the group with inf/NaN
    gradients keeps its parameters and its whole AdamW state (step counts too); the other steps as alone."""
    router, ref = _fused_nonfinite_run(bad, dtype), _fused_nonfinite_run(bad, dtype)
    before = whole_state(router)
    stats = router.step()
    assert (stats["a"].skipped, stats["a"].skip_reason) == (True, "nonfinite")
    assert (stats["b"].skipped, stats["b"].skip_reason) == (False, None)
    after = whole_state(router)
    for key in ("params", "optimizer"):
        assert_same(before["a"][key], after["a"][key])
    ref.groups["b"].optimizer.step()
    for p, q in zip(router.groups["b"].params, ref.groups["b"].params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("skip", [False, None])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_skip_nonfinite_false_and_the_default_keep_torchs_behaviour(max_norm: float | None, skip: bool | None) -> None:
    router, _ = _nonfinite_run(skip, max_norm)
    ref, _ = _nonfinite_run(skip, max_norm)
    stats = router.step()
    assert not stats["a"].skipped and stats["a"].skip_reason is None
    for g in ref.groups.values():
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(g.params, max_norm)
        g.optimizer.step()
    for name in ("a", "b"):
        for p, q in zip(router.groups[name].params, ref.groups[name].params, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
    assert not all(torch.isfinite(p).all() for p in router.groups["a"].params)
