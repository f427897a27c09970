"""DistributedDataParallel with routed losses: 2 gloo processes on the CPU against single-process references.

Each rank gets half of every batch; DDP averages the per-rank gradients, so the routed gradients must equal
the full-batch routed gradients of one process (a fresh forward per loss, ``torch.autograd.grad``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradroute
from tests._reference import reference_grads
from tests.distributed._worker import assert_grads, batch, checkpointed_pair, gather, launch, losses, nets, reference

pytestmark = pytest.mark.distributed

# every test launches 2 processes once (a few seconds each on CI), so a test covers several setups in one launch
LAYOUTS = ("per_network", "one_ddp")
LAYOUTS_X_FIND_UNUSED = tuple((layout, f) for layout in LAYOUTS for f in (False, True))


class Chain(torch.nn.Module):
    """Both networks in one module, for one DDP around both."""

    def __init__(self, tenc: torch.nn.Module, unet: torch.nn.Module) -> None:
        super().__init__()
        self.tenc, self.unet = tenc, unet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(self.tenc(x))


def wrap(layout: str, tenc: torch.nn.Module, unet: torch.nn.Module, **kw) -> tuple[Callable, list[DDP]]:
    """The forward and the DDP modules of ``layout``: one DDP per network, or one around both."""
    if layout == "per_network":
        d_tenc, d_unet = DDP(tenc, **kw), DDP(unet, **kw)
        return (lambda x: d_unet(d_tenc(x))), [d_tenc, d_unet]
    both = DDP(Chain(tenc, unet), **kw)
    return both, [both]


def groups_of(modules: list[DDP], tenc: torch.nn.Module, unet: torch.nn.Module, **kw) -> dict[str, gradroute.Group]:
    """The groups, each naming the DDP that holds it (``Group(ddp=...)``: DDP leaves no mark to be found by)."""
    d_tenc, d_unet = modules if len(modules) == 2 else modules * 2
    return {"tenc": gradroute.Group(tenc, ddp=d_tenc, **kw), "unet": gradroute.Group(unet, ddp=d_unet, **kw)}


def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real (not string) annotations
    """DDP's default all-reduce (average), counted."""
    state["all_reduces"] += 1
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


# ---------------------------------------------------------------------- exactness


def _exact(rank: int, world: int) -> None:
    for layout, find_unused in LAYOUTS_X_FIND_UNUSED:
        tenc, unet = nets()
        forward, modules = wrap(layout, tenc, unet, find_unused_parameters=find_unused)
        router = gradroute.Router(groups_of(modules, tenc, unet))
        for step in range(2):
            router.zero_grad()
            router.backward(losses(forward, *batch(step, world, rank)))
            assert_grads({"tenc": tenc, "unet": unet}, reference(step, world), rtol=1e-10, atol=1e-12)
        # grads() runs no AccumulateGrad, so DDP sees no gradient: each rank gets its own shard's gradients,
        # and the next forward works (the reducer was never started)
        local = reference_local(rank, world, step=2)
        got = router.grads(losses(forward, *batch(2, world, rank)))
        for name in ("tenc", "unet"):
            for g, want in zip(got[name], local[name], strict=True):
                torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
        router.zero_grad()
        router.backward(losses(forward, *batch(3, world, rank)))
        assert_grads({"tenc": tenc, "unet": unet}, reference(3, world), rtol=1e-10, atol=1e-12)


def reference_local(rank: int, world: int, step: int) -> dict[str, list[torch.Tensor]]:
    """The routed gradients of rank ``rank``'s rows alone (what ``Router.grads`` returns under DDP)."""
    from tests._reference import reference_grads

    tenc, unet = nets()
    x, target, mask = batch(step, world, rank)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    got = reference_grads(lambda: losses(lambda v: unet(tenc(v)), x, target, mask), groups)
    return {name: [got[id(p)] for p in params] for name, params in groups.items()}


def test_ddp_routed_backward_matches_full_batch_reference() -> None:
    """One DDP per network and one DDP around both, each with and without ``find_unused_parameters``."""
    launch(_exact)


def _checkpointed(rank: int, world: int) -> None:
    # small chunks: several interleaved calls through the segment, each delivering some of the UNet's grads
    options = gradroute.PlanOptions(chunk=6)
    for layout in LAYOUTS:
        tenc, unet, ref_tenc, ref_unet = checkpointed_pair()
        forward, modules = wrap(layout, tenc, unet)
        router = gradroute.Router(groups_of(modules, tenc, unet), plan_options=options)
        plan = router.plan(losses(forward, *batch(0, world, rank)))
        assert sum(c.groups == ("unet",) for c in plan.calls) >= 3, plan
        groups = {"tenc": list(ref_tenc.parameters()), "unet": list(ref_unet.parameters())}
        for step in range(2):
            router.zero_grad()
            router.backward(losses(forward, *batch(step, world, rank)))
            ref = torch.nn.Sequential(ref_tenc, ref_unet)
            want = reference_grads(lambda s=step, ref=ref: losses(ref, *batch(s, world)), groups)
            expected = {name: [want[id(p)] for p in params] for name, params in groups.items()}
            assert_grads({"tenc": tenc, "unet": unet}, expected, rtol=1e-10, atol=1e-12)


def test_ddp_checkpointed_segment_interleaved_in_chunks_matches_full_batch_reference() -> None:
    """The UNet's parameters reach ``.grad`` over several engine calls (one per chunk): DDP still averages
    every one exactly once, with one DDP per network and one around both."""
    launch(_checkpointed)


class Scaled(torch.nn.Module):
    """A text encoder with a learned loss weight used only in its own loss (a parameter at the loss head)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.weight = torch.nn.Parameter(torch.tensor([1.5], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _head_param(rank: int, world: int) -> None:
    def routed(tenc: Scaled, unet: torch.nn.Module, fwd: Callable, step: int, r: int | None) -> dict:
        x, target, mask = batch(step, world, r)
        loss = torch.nn.functional.mse_loss(fwd(x), target, reduction="none")
        return {"tenc": (loss * tenc.weight).mean(), "unet": (loss * mask).mean()}

    tenc, unet = Scaled(nets()[0]), nets()[1]
    d_tenc, d_unet = DDP(tenc), DDP(unet)
    router = gradroute.Router(tenc=d_tenc, unet=d_unet)  # groups built from the wrappers: found there
    ref_tenc, ref_unet = Scaled(nets()[0]), nets()[1]
    for step in range(2):
        router.zero_grad()
        router.backward(routed(tenc, unet, lambda x: d_unet(d_tenc(x)), step, rank))
        for name, mod, ref_mod in (("tenc", tenc, ref_tenc), ("unet", unet, ref_unet)):
            params = list(ref_mod.parameters())
            want = torch.autograd.grad(
                routed(ref_tenc, ref_unet, lambda x: ref_unet(ref_tenc(x)), step, None)[name], params
            )
            for p, w in zip(mod.parameters(), want, strict=True):
                torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-12)


def test_ddp_parameter_at_the_loss_head_matches_reference() -> None:
    launch(_head_param, timeout=60)


# ---------------------------------------------------------------------- accumulation


def _accumulate(rank: int, world: int) -> None:
    for layout in LAYOUTS:
        _accumulate_one(rank, world, layout)


def _accumulate_one(rank: int, world: int, layout: str) -> None:
    lr, steps, micro = 0.1, 2, 2
    tenc, unet = nets()
    forward, modules = wrap(layout, tenc, unet)
    counts = [{"all_reduces": 0} for _ in modules]
    for m, c in zip(modules, counts):
        m.register_comm_hook(c, counting_hook)
    d_tenc, d_unet = modules if len(modules) == 2 else modules * 2
    router = gradroute.Router(
        tenc=gradroute.Group(tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=lr), ddp=d_tenc),
        unet=gradroute.Group(unet, optimizer=torch.optim.SGD(unet.parameters(), lr=lr), ddp=d_unet),
        accumulate=micro,
    )
    ref_tenc, ref_unet = nets()
    for step in range(steps):
        for k in range(micro):
            router.backward(losses(forward, *batch(step * micro + k, world, rank)))
            router.step()
        # reference: the mean of the micro-batches' full-batch routed gradients, one SGD step
        total: dict[str, list[torch.Tensor]] = {}
        for k in range(micro):
            for name, grads in _ref_at(ref_tenc, ref_unet, step * micro + k, world).items():
                total[name] = grads if name not in total else [a + b for a, b in zip(total[name], grads)]
        with torch.no_grad():
            for name, mod in (("tenc", ref_tenc), ("unet", ref_unet)):
                for p, g in zip(mod.parameters(), total[name], strict=True):
                    p -= lr * g / micro
        for mod, ref_mod in ((tenc, ref_tenc), (unet, ref_unet)):
            for p, q in zip(mod.parameters(), ref_mod.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        # one all-reduce per DDP module (one bucket each) per real step, none on the first micro-batch
        assert [c["all_reduces"] for c in counts] == [step + 1] * len(modules), counts


def _ref_at(tenc: torch.nn.Module, unet: torch.nn.Module, step: int, world: int) -> dict[str, list[torch.Tensor]]:
    from tests._reference import reference_grads

    x, target, mask = batch(step, world)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    got = reference_grads(lambda: losses(lambda v: unet(tenc(v)), x, target, mask), groups)
    return {name: [got[id(p)] for p in params] for name, params in groups.items()}


def test_ddp_accumulation_all_reduces_once_per_step() -> None:
    """Both layouts; the SGD-stepped parameters equal the reference and each DDP all-reduces once per step."""
    launch(_accumulate)


# ---------------------------------------------------------------------- AMP


def _amp(rank: int, world: int) -> None:
    tenc, unet = nets(torch.float32)
    d_tenc, d_unet = DDP(tenc), DDP(unet)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    router = gradroute.Router(
        tenc=gradroute.Group(d_tenc, optimizer=torch.optim.SGD(tenc.parameters(), lr=0.1)),
        unet=gradroute.Group(d_unet, optimizer=torch.optim.SGD(unet.parameters(), lr=0.1)),
        scaler=scaler,
    )
    before = {n: [p.detach().clone() for p in m.parameters()] for n, m in (("tenc", tenc), ("unet", unet))}
    x, target, mask = batch(0, world, rank, dtype=torch.float32)
    routed = losses(lambda v: d_unet(d_tenc(v)), x, target, mask)
    if rank == 0:  # an inf in rank 0's UNet loss only: DDP all-reduces it into rank 1's UNet gradients too
        routed["unet"] = routed["unet"] * float("inf")
    router.backward(routed)
    stats = router.step()
    assert gather((stats["tenc"].skipped, stats["unet"].skipped, stats.scale)) == [(False, True, 2.0**8)] * world
    assert gather(float(scaler.get_scale())) == [2.0**7] * world  # one backoff on every rank
    for p, q in zip(unet.parameters(), before["unet"], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # the UNet step was skipped on every rank
    tenc_now = [p.detach().clone() for p in tenc.parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(tenc_now, before["tenc"]))
    for theirs in gather(tenc_now):  # the text encoder stepped identically everywhere
        for p, q in zip(tenc_now, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    # the next step is finite everywhere and steps both groups
    router.backward(losses(lambda v: d_unet(d_tenc(v)), *batch(1, world, rank, dtype=torch.float32)))
    stats = router.step()
    assert gather((stats["tenc"].skipped, stats["unet"].skipped)) == [(False, False)] * world


def test_ddp_amp_inf_on_one_rank_skips_that_group_on_every_rank() -> None:
    launch(_amp)


# ---------------------------------------------------------------------- refused up front (one process)


@pytest.fixture
def one_process_group(tmp_path) -> Iterator[None]:
    """A gloo process group of this process alone (DDP runs with world size 1)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_static_graph_fails(one_process_group: None) -> None:
    tenc, unet = nets()
    forward, modules = wrap("per_network", tenc, unet, static_graph=True)
    router = gradroute.Router(tenc=modules[0], unet=modules[1])  # groups built from the wrappers
    with pytest.raises(ValueError, match=r"static_graph=True.*static_graph=False"):
        router.backward(losses(forward, *batch(0, 1)))
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])


def test_ddp_one_module_routing_part_of_its_groups_fails(one_process_group: None) -> None:
    tenc, unet = nets()
    forward, modules = wrap("one_ddp", tenc, unet)
    router = gradroute.Router(groups_of(modules, tenc, unet))
    routed = losses(forward, *batch(0, 1))
    with pytest.raises(ValueError, match=r"4 of its trainable parameters \(e\.g\. `tenc\.0\.weight`\)"):
        router.backward(unet=routed["unet"])
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])


def test_ddp_one_module_under_no_sync_may_route_part_of_its_groups(one_process_group: None) -> None:
    tenc, unet = nets()
    forward, (ddp,) = wrap("one_ddp", tenc, unet)
    router = gradroute.Router(groups_of([ddp], tenc, unet))
    with ddp.no_sync():
        routed = losses(forward, *batch(0, 1))
        router.backward(unet=routed["unet"])
    assert all(p.grad is None for p in tenc.parameters())
    assert all(p.grad is not None for p in unet.parameters())


def test_ddp_without_process_group_finds_nothing() -> None:
    from gradroute._distributed import GradSync

    tenc, _ = nets()
    sync = GradSync({"tenc": gradroute.Group(tenc)})
    assert sync.ddp() == []


class Trainer(torch.nn.Module):
    """Both networks and a router whose backward runs inside the module's forward (as in Lightning's
    training_step, which runs inside DDP's forward)."""

    def __init__(self, tenc: torch.nn.Module, unet: torch.nn.Module) -> None:
        super().__init__()
        self.tenc, self.unet = tenc, unet
        self.router = gradroute.Router(tenc=tenc, unet=unet)

    def forward(self, x: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.router.backward(losses(lambda v: self.unet(self.tenc(v)), x, target, mask))
        return torch.zeros(())


def test_ddp_whose_forward_routes_is_found_without_being_named(one_process_group: None) -> None:
    tenc, unet = nets()
    trainer = Trainer(tenc, unet)
    ddp = DDP(trainer, static_graph=True)  # found: refused as when named
    with pytest.raises(ValueError, match=r"static_graph=True"):
        ddp(*batch(0, 1))
    assert all(p.grad is None for p in [*tenc.parameters(), *unet.parameters()])


def test_ddp_not_named_and_not_reachable_is_said_once(one_process_group: None) -> None:
    """What naming the wrapper is for: with one DDP around both networks and the groups built from the
    networks, nothing in the process points from them to it (the static_graph check cannot see it)."""
    tenc, unet = nets()
    forward, _ = wrap("one_ddp", tenc, unet, static_graph=True)
    router = gradroute.Router(tenc=tenc, unet=unet)
    with pytest.warns(UserWarning, match=r"no DistributedDataParallel wrapper.*Group\(module, ddp=wrapper\)"):
        router.backward(losses(forward, *batch(0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        router.backward(losses(forward, *batch(1, 1)))  # once


def test_ddp_not_named_is_said_at_the_first_backward_with_a_process_group(tmp_path) -> None:
    """A router whose backwards began before the process group did looks for the wrappers once it exists."""
    tenc, unet = nets()
    router = gradroute.Router(tenc=tenc, unet=unet)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        router.backward(losses(lambda v: unet(tenc(v)), *batch(0, 1)))  # no process group: nothing to say
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        forward, _ = wrap("one_ddp", tenc, unet, static_graph=True)
        with pytest.warns(UserWarning, match=r"no DistributedDataParallel wrapper"):
            router.backward(losses(forward, *batch(1, 1)))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the demo under torchrun


def test_demo_runs_under_torchrun(tmp_path) -> None:
    """``torchrun --nproc-per-node 2 -m gradroute demo``: DDP per network, gloo; rank 0 prints and writes."""
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "gradroute", "demo", "--steps", "2", "--batch-size", "4", "--width", "8", "--device", "cpu"),
        *("--out", str(tmp_path)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun demo did not finish within {e.timeout} s:\n{e.stdout}\n{e.stderr}", pytrace=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # the step-0 check compares the DDP-averaged routed gradients with a full-batch reference
    assert done.stdout.count("step 0 check against independent forwards") == 1, done.stdout
    assert "ok" in done.stdout.split("step 0 check")[1].splitlines()[0]
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["settings"]["world_size"] == 2
    assert report["check"]["passed"]
    assert len(report["log"]) == 2


def test_finding_ddp_scans_no_objects(one_process_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrappers are found from the groups, not by going through every object the collector tracks."""
    import gc

    def scan() -> list:
        raise AssertionError("gc.get_objects() was called")

    monkeypatch.setattr(gc, "get_objects", scan)
    tenc, unet = nets()
    forward, modules = wrap("per_network", tenc, unet, static_graph=True)
    router = gradroute.Router(tenc=modules[0], unet=modules[1])
    with pytest.raises(ValueError, match=r"static_graph=True"):
        router.backward(losses(forward, *batch(0, 1)))


@pytest.mark.parametrize("value", ["ddp", torch.nn.Linear(2, 2)])
def test_group_ddp_not_a_ddp_fails(value: object) -> None:
    with pytest.raises(
        TypeError,
        match=rf"`ddp` must be a torch.nn.parallel.DistributedDataParallel or None, got {type(value).__name__}",
    ):
        gradroute.Group(torch.nn.Linear(2, 2), ddp=value)
