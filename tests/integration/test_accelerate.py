"""``Router(accelerator=...)``: what ``accelerator.backward`` does, prepared optimizers and schedulers, refusals.

References are fresh forwards per loss and ``torch.autograd.grad``; optimizers are SGD where a gradient scale
must show in the weights (AdamW's update is nearly scale-invariant).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import gradroute
from tests._reference import reference_grads

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def nets() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    tenc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    unet = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    return tenc, unet


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=gen), (torch.rand(6, 4, generator=gen) > 0.5).float()) for _ in range(n)]


def losses(tenc: torch.nn.Module, unet: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    loss = (unet(tenc(x)) - x).pow(2)
    return {"tenc": loss.mean(), "unet": (loss * mask).mean()}


def window_reference(tenc: torch.nn.Module, unet: torch.nn.Module, window: list[Any]) -> dict[int, torch.Tensor]:
    """``id(p) -> sum over the window's micro-batches of d loss_g / d p / len(window)`` (fresh forwards)."""
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    out: dict[int, torch.Tensor] = {}
    for x, mask in window:
        for pid, g in reference_grads(lambda x=x, mask=mask: losses(tenc, unet, x, mask), groups).items():
            out[pid] = out.get(pid, 0) + g / len(window)
    return out


def accelerator(accumulation: int, *, scaler: bool = False) -> Any:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    if scaler:  # Accelerate makes a GradScaler for fp16 on GPUs only; the same code path on the CPU
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    return acc


# ---------------------------------------------------------------------- one optimizer, stepped by the script


@pytest.mark.parametrize("scaler", [False, True], ids=["no-scaler", "scaler"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_router_backward_does_what_accelerator_backward_does(accumulation: int, scaler: bool) -> None:
    acc = accelerator(accumulation, scaler=scaler)
    tenc, unet = nets()
    ref_t, ref_u = copy.deepcopy(tenc), copy.deepcopy(unet)
    optimizer = torch.optim.SGD([*tenc.parameters(), *unet.parameters()], lr=0.1)
    tenc, unet, optimizer = acc.prepare(tenc, unet, optimizer)
    router = gradroute.Router(tenc=tenc, unet=unet, accelerator=acc)
    data = batches(2 * accumulation)
    for step in range(2):
        window = data[step * accumulation : (step + 1) * accumulation]
        expected = window_reference(ref_t, ref_u, window)
        for x, mask in window:
            with acc.accumulate(tenc, unet):
                router.backward(losses(tenc, unet, x, mask))
                if acc.sync_gradients:
                    if scaler:  # what acc.clip_grad_norm_ does under fp16 on a GPU (on the CPU it skips it)
                        acc.scaler.unscale_(optimizer.optimizer)
                    params = [*tenc.parameters(), *unet.parameters()]
                    for p, q in zip(params, [*ref_t.parameters(), *ref_u.parameters()], strict=True):
                        torch.testing.assert_close(p.grad, expected[id(q)], rtol=1e-6, atol=1e-8)
                optimizer.step()
                optimizer.zero_grad()
        with torch.no_grad():  # the reference takes the same SGD step
            for q in [*ref_t.parameters(), *ref_u.parameters()]:
                q -= 0.1 * expected[id(q)]
    if scaler:
        assert acc.scaler.get_scale() == 2.0**10  # one update per real step (growth_interval=1)


def test_unannounced_accelerate_accumulation_fails() -> None:
    acc = accelerator(2)
    tenc, unet = nets()
    router = gradroute.Router(tenc=tenc, unet=unet)
    (x, mask) = batches(1)[0]
    with acc.accumulate(tenc, unet), pytest.raises(ValueError, match=r"gradient_accumulation_steps=2.*accelerator="):
        router.backward(losses(tenc, unet, x, mask))
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])


def test_accelerate_accumulation_told_through_accumulate_is_allowed() -> None:
    accelerator(2)
    tenc, unet = nets()
    router = gradroute.Router(tenc=tenc, unet=unet, accumulate=2)
    (x, mask) = batches(1)[0]
    router.backward(losses(tenc, unet, x, mask))
    assert all(p.grad is not None for p in tenc.parameters())


# ---------------------------------------------------------------------- prepared optimizers and schedulers in Groups


def test_groups_with_prepared_optimizers_and_schedulers_step_as_accelerate() -> None:
    acc = accelerator(2, scaler=True)
    tenc, unet = nets()
    ref_t, ref_u = copy.deepcopy(tenc), copy.deepcopy(unet)
    opt_t, opt_u = torch.optim.SGD(tenc.parameters(), lr=0.1), torch.optim.SGD(unet.parameters(), lr=0.2)
    sched_t = torch.optim.lr_scheduler.LambdaLR(opt_t, lambda s: 0.5**s)
    sched_u = torch.optim.lr_scheduler.LambdaLR(opt_u, lambda s: 0.5**s)
    tenc, unet, opt_t, opt_u, sched_t, sched_u = acc.prepare(tenc, unet, opt_t, opt_u, sched_t, sched_u)
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=opt_t, scheduler=sched_t),
        unet=gradroute.Group(unet, optimizer=opt_u, scheduler=sched_u),
        accelerator=acc,
    )
    updates: list[int] = []
    update = acc.scaler.update
    acc.scaler.update = lambda *a: (updates.append(1), update(*a))[1]
    data = batches(4)
    accumulating = []
    for k, (x, mask) in enumerate(data):
        if k % 2 == 0:
            expected = window_reference(ref_t, ref_u, data[k : k + 2])
            lrs = {"tenc": 0.1 * 0.5 ** (k // 2), "unet": 0.2 * 0.5 ** (k // 2)}
        with acc.accumulate(tenc, unet):
            router.backward(losses(tenc, unet, x, mask))
            stats = router.step()
        accumulating.append(stats.accumulating)
        if not stats.accumulating:
            with torch.no_grad():
                for net, name in ((ref_t, "tenc"), (ref_u, "unet")):
                    for q in net.parameters():
                        q -= lrs[name] * expected[id(q)]
    assert accumulating == [True, False, True, False]
    assert len(updates) == 2  # ONE scaler update per real step, not one per optimizer
    assert sched_t.scheduler.last_epoch == sched_u.scheduler.last_epoch == 2  # stepped once per real step
    for net, ref in ((tenc, ref_t), (unet, ref_u)):
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_prepared_optimizer_without_accelerator_fails() -> None:
    acc = accelerator(1)
    tenc, unet = nets()
    opt = acc.prepare(torch.optim.SGD(tenc.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"prepared by Accelerate \(AcceleratedOptimizer\).*accelerator=accelerator"):
        gradroute.Router(tenc=gradroute.Group(tenc, optimizer=opt), unet=unet)


def test_prepared_scheduler_without_accelerator_fails() -> None:
    acc = accelerator(1)
    tenc, unet = nets()
    opt = torch.optim.SGD(tenc.parameters(), lr=0.1)
    sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.raises(ValueError, match=r"`scheduler` of group `tenc` was prepared.*scheduler\.scheduler"):
        gradroute.Router(tenc=gradroute.Group(tenc, optimizer=opt, scheduler=sched), unet=unet)


def test_scheduler_of_an_optimizer_in_no_group_fails() -> None:
    tenc, unet = nets()
    opt = torch.optim.SGD(tenc.parameters(), lr=0.1)
    other = torch.optim.SGD(tenc.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0)
    with pytest.raises(ValueError, match=r"scheduler of group `tenc` \(LambdaLR\) is bound to a SGD that is not group"):
        gradroute.Router(tenc=gradroute.Group(tenc, optimizer=opt, scheduler=sched), unet=unet)


# ---------------------------------------------------------------------- refusals


def test_accelerator_with_scaler_fails() -> None:
    acc = accelerator(1)
    tenc, unet = nets()
    with pytest.raises(ValueError, match="`scaler` comes from the accelerator"):
        gradroute.Router(tenc=tenc, unet=unet, accelerator=acc, scaler=torch.amp.GradScaler("cpu"))


def test_accelerator_with_accumulate_fails() -> None:
    acc = accelerator(2)
    tenc, unet = nets()
    with pytest.raises(ValueError, match="`accumulate` comes from the accelerator"):
        gradroute.Router(tenc=tenc, unet=unet, accelerator=acc, accumulate=2)


def test_not_an_accelerator_fails() -> None:
    tenc, unet = nets()
    with pytest.raises(TypeError, match=r"`accelerator` must be an accelerate\.Accelerator, got dict"):
        gradroute.Router(tenc=tenc, unet=unet, accelerator={})


def stub_accelerator(kind: str, **kw: Any) -> SimpleNamespace:
    """An object with Accelerator's attributes (DeepSpeed, FSDP, Megatron or XLA cannot be set up on this CPU)."""
    from accelerate.utils import DistributedType

    fields = {
        "backward": lambda loss: None,
        "gradient_accumulation_steps": 1,
        "sync_gradients": True,
        "distributed_type": DistributedType(kind),
        "scaler": None,
    }
    return SimpleNamespace(**{**fields, **kw})


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("DEEPSPEED", "DeepSpeed's engine runs the backward"),
        ("FSDP", "Accelerate's FSDP plugin"),
        ("MEGATRON_LM", "Megatron"),
    ],
)
def test_accelerator_setup_the_router_cannot_stand_in_for_fails(kind: str, why: str) -> None:
    tenc, unet = nets()
    with pytest.raises(ValueError, match=f"distributed_type {kind}: {why}"):
        gradroute.Router(tenc=tenc, unet=unet, accelerator=stub_accelerator(kind))


def test_accelerator_with_lomo_optimizer_fails() -> None:
    tenc, unet = nets()
    acc = stub_accelerator("NO", has_lomo_optimizer=False)
    router = gradroute.Router(tenc=tenc, unet=unet, accelerator=acc)
    acc.has_lomo_optimizer = True  # prepared after the router was built
    (x, mask) = batches(1)[0]
    with pytest.raises(ValueError, match="LOMO optimizer"):
        router.backward(losses(tenc, unet, x, mask))
    assert all(p.grad is None for p in tenc.parameters())


# ---------------------------------------------------------------------- examples/accelerate_train.py


def example_parts(accumulation: int, *, scaler: bool, lr: float = 0.05) -> tuple[Any, ...]:
    """The example's pieces with SGD (a gradient scale shows in the weights) and constant schedules."""
    import accelerate_train as at

    acc = accelerator(accumulation, scaler=scaler)
    torch.manual_seed(0)
    encoder, head = at.make_models(dim=8, hidden=16)
    ref = copy.deepcopy(encoder), copy.deepcopy(head)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (encoder, head)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in opts]
    loader = torch.utils.data.DataLoader(at.make_dataset(n=64, dim=8), batch_size=8, shuffle=False)
    encoder, head, *prepared, loader = acc.prepare(encoder, head, *opts, *scheds, loader)
    router = at.build_router(encoder, head, prepared[:2], prepared[2:], acc, max_grad_norm=None)
    return acc, router, encoder, head, loader, ref


@pytest.mark.parametrize("accumulation", [1, 2])
def test_accelerate_example_updates_the_scale_once_per_iteration(accumulation: int) -> None:
    import accelerate_train as at

    acc, router, encoder, head, loader, _ = example_parts(accumulation, scaler=True)
    updates: list[int] = []
    update = acc.scaler.update
    acc.scaler.update = lambda *a: (updates.append(1), update(*a))[1]
    history = at.train(acc, router, encoder, head, loader, max_steps=3, log=False)
    assert [s.step for s in history] == [1, 2, 3]
    assert len(updates) == 3  # one per iteration (real step), whatever the accumulation
    assert [s.scale for s in history] == [2.0**8, 2.0**9, 2.0**10]  # changed once per iteration
    assert not any(s[g].skipped for s in history for g in ("encoder", "head"))


def test_accelerate_own_optimizer_wrapper_updates_per_optimizer() -> None:
    """Why the router steps the optimizers inside Accelerate's wrappers: ``AcceleratedOptimizer.step`` updates the
    scale once per optimizer."""
    import accelerate_train as at
    from accelerate.optimizer import AcceleratedOptimizer

    accelerator(1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    updates: list[int] = []
    update = scaler.update
    scaler.update = lambda *a: (updates.append(1), update(*a))[1]
    encoder, head = at.make_models(dim=8, hidden=16)
    opts = [AcceleratedOptimizer(torch.optim.AdamW(m.parameters()), scaler=scaler) for m in (encoder, head)]
    x, y, mask = at.make_dataset(n=8, dim=8)[:]
    loss_e, loss_h = at.losses(encoder, head, (x, y, mask))
    gradroute.Router(encoder=encoder, head=head).backward(encoder=scaler.scale(loss_e), head=scaler.scale(loss_h))
    for opt in opts:
        opt.step()
    assert len(updates) == 2
    assert scaler.get_scale() == 2.0**12  # two growth steps in one iteration


def test_accelerate_example_matches_reference_loop() -> None:
    import accelerate_train as at

    accumulation, lr = 2, 0.05
    acc, router, encoder, head, loader, (ref_e, ref_h) = example_parts(accumulation, scaler=True, lr=lr)
    at.train(acc, router, encoder, head, loader, max_steps=3, log=False)
    batches = list(torch.utils.data.DataLoader(at.make_dataset(n=64, dim=8), batch_size=8, shuffle=False))
    groups = {"encoder": list(ref_e.parameters()), "head": list(ref_h.parameters())}
    for step in range(3):
        expected: dict[int, torch.Tensor] = {}
        for batch in batches[step * accumulation : (step + 1) * accumulation]:
            forward = lambda batch=batch: dict(zip(("encoder", "head"), at.losses(ref_e, ref_h, batch), strict=True))  # noqa: E731
            for pid, g in reference_grads(forward, groups).items():
                expected[pid] = expected.get(pid, 0) + g / accumulation
        with torch.no_grad():
            for q in [*ref_e.parameters(), *ref_h.parameters()]:
                q -= lr * expected[id(q)]
    for net, ref in ((encoder, ref_e), (head, ref_h)):
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra", [["--grad-scaler"], ["--mixed-precision", "bf16"]], ids=["scaler", "bf16"])
def test_accelerate_example_main_runs(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    import accelerate_train as at

    assert at.main(["--cpu", "--max-steps", "3", "--batch-size", "16", *extra]) == 0
    text = capsys.readouterr().out
    assert "step    3" in text and "3 steps on cpu" in text


def test_router_with_accelerator_resumes_inside_an_accumulation_window() -> None:
    acc = accelerator(2)
    tenc, unet = nets()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tenc, unet)]
    tenc, unet, *opts = acc.prepare(tenc, unet, *opts)

    def router() -> gradroute.Router:
        groups = {"tenc": gradroute.Group(tenc, optimizer=opts[0]), "unet": gradroute.Group(unet, optimizer=opts[1])}
        return gradroute.Router(groups, accelerator=acc)

    first = router()
    (x, mask) = batches(1)[0]
    with acc.accumulate(tenc, unet):
        first.backward(losses(tenc, unet, x, mask))
        assert first.step().accumulating
    state = first.state_dict()
    grads = [p.grad.clone() for p in tenc.parameters()]
    first.zero_grad()
    second = router()
    second.load_state_dict(state)  # saved at micro-batch 1 of Accelerate's window of 2
    for p, g in zip(tenc.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
