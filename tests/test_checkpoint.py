"""gradroute.checkpoint: one recomputation per routed backward, exact, freed; torch's behaviour outside."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointError

import gradroute
from gradroute import _checkpoint, _session
from gradroute._checkpoint import checkpoint_kind

from ._reference import assert_grads_match, reference_grads

CK = Callable[..., Any]
torch_ck: CK = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
CKS = {"gradroute": gradroute.checkpoint, "torch": torch_ck}


class Block(nn.Module):
    """A residual MLP block with dropout; counts its calls made during a routed backward (recomputations)."""

    def __init__(self, d: int, p: float = 0.25) -> None:
        super().__init__()
        self.lin1 = nn.Linear(d, 2 * d)
        self.lin2 = nn.Linear(2 * d, d)
        self.p = p
        self.recomputed = 0
        self.storages: list[StorageWeakRef] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.lin1(x))
        h = nn.functional.dropout(a, self.p, training=True)
        if _session.current() is not None:  # only recomputations run inside a routed backward
            self.recomputed += 1
        if torch._C._current_graph_task_id() != -1:  # a recomputation: keep an eye on two saved tensors
            self.storages += [StorageWeakRef(t.untyped_storage()) for t in (a, h)]
        return x + self.lin2(h)


class Net(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor, ck: CK | None) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if ck is None else ck(b, x)
        return x


D = 6


def make() -> tuple[Net, Net]:
    return Net(D, 2).double(), Net(D, 3).double()


def losses(tenc: Net, unet: Net, ck: CK | None, seed: int = 7) -> dict[str, torch.Tensor]:
    """The tenc -> unet chain with a masked loss; reseeds so dropout draws the same masks every call."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    target = torch.randn(5, D, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, D, generator=g) > 0.5).double()
    torch.manual_seed(seed)
    loss = (unet(tenc(x, ck), ck) - target) ** 2
    return {"tenc": loss.mean(), "unet": (loss * mask).mean()}


def recomputed(net: Net) -> list[int]:
    return [b.recomputed for b in net.blocks]


@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize("ck", ["gradroute", "torch"])
def test_router_matches_reference_with_dropout(ck: str, method: str) -> None:
    tenc, unet = make()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(lambda: losses(tenc, unet, None), groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    ls = losses(tenc, unet, CKS[ck])
    params = groups["tenc"] + groups["unet"]
    if method == "backward":
        router.backward(**ls)
    else:
        got = router.grads(**ls)
        for p, g in zip(params, [*got["tenc"], *got["unet"]], strict=True):
            p.grad = g
    assert_grads_match(params, expected)


@pytest.mark.parametrize(("ck", "unet_recomputes"), [("gradroute", 1), ("torch", 2)])
def test_each_segment_recomputed_once_per_routed_backward(ck: str, unet_recomputes: int) -> None:
    # both passes go through every unet block; only the text-encoder pass goes through tenc's blocks
    tenc, unet = make()
    router = gradroute.Router(tenc=tenc, unet=unet)
    for step in range(1, 3):
        router.backward(**losses(tenc, unet, CKS[ck]))
        assert recomputed(unet) == [step * unet_recomputes] * 3
        assert recomputed(tenc) == [step] * 2


def test_recomputed_tensors_freed_after_backward() -> None:
    tenc, unet = make()
    ls = losses(tenc, unet, gradroute.checkpoint)
    gradroute.Router(tenc=tenc, unet=unet).backward(**ls)
    made = [s for b in [*tenc.blocks, *unet.blocks] for s in b.storages]
    assert len(made) == 2 * 5
    assert all(s.expired() for s in made)  # while ``ls`` still holds the (freed) graph


@pytest.mark.parametrize("routed", [True, False])
def test_graph_and_segment_inputs_freed_without_the_cycle_collector(routed: bool) -> None:
    # the segment inputs (kept for the recomputation) must go with the graph by reference counting alone: a
    # reference cycle would keep a step's boundaries alive into the next steps until the collector runs
    # (torch's own non-reentrant checkpoint does not pass this with a plain backward, torch 2.13)
    tenc, unet = make()
    router = gradroute.Router(tenc=tenc, unet=unet)
    x = torch.randn(5, D, dtype=torch.float64)
    gc.disable()
    try:
        h = tenc(x, gradroute.checkpoint)
        inputs = StorageWeakRef(h.untyped_storage())
        loss = unet(h, gradroute.checkpoint) ** 2
        if routed:
            router.backward(tenc=loss.mean(), unet=loss.sum())
        else:
            (loss.mean() + loss.sum()).backward()
        del h, loss
        assert inputs.expired()
    finally:
        gc.enable()


class _Reuses(nn.Module):
    """Hands one tensor to several ops, to one call twice (``query is key`` fast paths), and writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True).double()
        self.lin = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a, _ = self.attn(h, h, h, need_weights=False)  # self-attention: the fused projection path
        y = h * 2
        y.add_(a)
        return torch.tanh(y) + h


@pytest.mark.parametrize("chunk", [None, 3])
def test_segment_ops_see_the_same_tensors_and_route_exactly(chunk: int | None) -> None:
    # a segment that hands one tensor to several ops and to one call three times (nn.MultiheadAttention takes
    # its fused path only when ``query is key is value``: the forward and the recomputation must agree) and
    # writes in place; with tiny chunks the planner tries to cut it everywhere
    options = gradroute.PlanOptions() if chunk is None else gradroute.PlanOptions(chunk=chunk)
    tenc, unet = nn.Linear(D, D).double(), _Reuses()
    x = torch.randn(2, 3, D, dtype=torch.float64)

    def forward() -> dict[str, torch.Tensor]:
        out = gradroute.checkpoint(unet, tenc(x)) ** 2
        return {"tenc": out.mean(), "unet": out[..., :2].sum()}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    gradroute.Router(tenc=tenc, unet=unet, plan_options=options).backward(**forward())
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_routed_backward_exit_drops_what_a_retained_graph_keeps() -> None:
    tenc, unet = make()
    ls = losses(tenc, unet, gradroute.checkpoint)
    params = list(unet.parameters())
    with _session.routed_backward():
        first = torch.autograd.grad(ls["unet"], params, retain_graph=True)
        again = torch.autograd.grad(ls["unet"], params, retain_graph=True)
        assert recomputed(unet) == [1, 1, 1]  # the second call is served the same recomputation
        alive = [b.storages[0] for b in unet.blocks]  # tanh's outputs (dropout's are made again: a recipe)
        assert not any(s.expired() for s in alive)
    assert all(s.expired() for s in alive)  # graph still alive, recomputed tensors gone
    later = torch.autograd.grad(ls["unet"], params)  # a plain backward recomputes afresh
    for a, b, c in zip(first, again, later, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


class Counted:
    """``fn`` that counts every call (forward and recomputations)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.fn(*args, **kwargs)


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


@pytest.mark.parametrize(("ck", "passes"), [("gradroute", 1), ("torch", 2)])
def test_nested_checkpoint_exact_under_router(ck: str, passes: int) -> None:
    tenc, unet = make()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(lambda: losses(tenc, unet, None), groups)

    def outer(t: torch.Tensor) -> torch.Tensor:
        for b in unet.blocks:
            t = CKS[ck](b, t)
        return t

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    target = torch.randn(5, D, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, D, generator=g) > 0.5).double()
    torch.manual_seed(7)
    loss = (CKS[ck](outer, tenc(x, None)) - target) ** 2
    gradroute.Router(tenc=tenc, unet=unet).backward(tenc=loss.mean(), unet=(loss * mask).mean())
    assert_grads_match(groups["tenc"] + groups["unet"], expected)
    # per pass: the outer recomputation runs the inner blocks' forwards and stops (early stop) once it has
    # saved the last block's input; each inner recomputation adds one
    assert recomputed(unet) == [2 * passes, 2 * passes, passes]


def test_kwargs_and_non_tensor_args() -> None:
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64)

    def f(t: torch.Tensor, k: int, *, scale: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return torch.sin(t @ w) * scale * k + shift

    scale = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
    y = gradroute.checkpoint(f, x, 3, scale=scale, shift=1.5)
    torch.testing.assert_close(y, f(x, 3, scale=scale, shift=1.5), rtol=0, atol=0)
    gw, gs = torch.autograd.grad(y.sum(), [w, scale])
    rw, rs = torch.autograd.grad(f(x, 3, scale=scale, shift=1.5).sum(), [w, scale])
    torch.testing.assert_close(gw, rw, rtol=0, atol=0)
    torch.testing.assert_close(gs, rs, rtol=0, atol=0)


def test_no_grad_runs_plainly() -> None:
    f = Counted(lambda t: t * 2)
    with torch.no_grad():
        y = gradroute.checkpoint(f, torch.ones(2, requires_grad=True))
    assert f.calls == 1 and y.grad_fn is None


def test_autocast_state_replayed() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    grads = {}
    for name, ck in CKS.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ck(lambda t: torch.relu(lin(t)) @ lin.weight, x)
        assert y.dtype == torch.bfloat16
        grads[name] = torch.autograd.grad(y.float().sum(), [lin.weight, lin.bias])
    for a, b in zip(grads["gradroute"], grads["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_kind_names_the_checkpoint() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    ours = gradroute.checkpoint(torch.sin, x)
    theirs = torch_ck(torch.sin, x)
    reentrant = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=True)
    # the output is an alias of the segment's last node (every consumer gets a view of its own)
    assert checkpoint_kind(ours.grad_fn.next_functions[0][0]) == "gradroute"
    assert checkpoint_kind(theirs.grad_fn) == "torch"
    assert checkpoint_kind(reentrant.grad_fn) == "reentrant"
    assert checkpoint_kind(torch.sin(x).grad_fn) is None
    assert checkpoint_kind((x + 1).grad_fn) is None  # saves nothing
    ours.sum().backward()
    assert checkpoint_kind(ours.grad_fn.next_functions[0][0]) is None  # freed


def test_nondeterministic_segment_fails() -> None:
    calls = []

    def f(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.sin(t) if len(calls) == 1 else t * 2  # saves one tensor, then none when recomputed

    y = gradroute.checkpoint(f, torch.randn(3, requires_grad=True))
    with pytest.raises(CheckpointError, match="different number of tensors"):
        y.sum().backward()


def test_use_reentrant_true_fails() -> None:
    with pytest.raises(ValueError, match="`use_reentrant` must be False or None, got True"):
        gradroute.checkpoint(torch.sin, torch.ones(1, requires_grad=True), use_reentrant=True)


def test_debug_fails() -> None:
    with pytest.raises(ValueError, match="`debug=True` is not supported"):
        gradroute.checkpoint(torch.sin, torch.ones(1, requires_grad=True), debug=True)


def test_determinism_check_fails() -> None:
    with pytest.raises(ValueError, match=r"`determinism_check` must be one of .* got 'strict'"):
        gradroute.checkpoint(torch.sin, torch.ones(1, requires_grad=True), determinism_check="strict")


def test_recomputed_tensors_freed_with_their_node() -> None:
    tenc, unet = make()
    ls = losses(tenc, unet, gradroute.checkpoint)
    with _session.routed_backward():
        torch.autograd.grad(ls["unet"], list(unet.parameters()), retain_graph=False)
        made = [s for b in unet.blocks for s in b.storages]
        assert made and all(s.expired() for s in made)  # before the routed backward returns


def _sd_tiny(ck: CK) -> tuple[nn.Module, nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    """diffusers UNet2DConditionModel + transformers CLIPTextModel, tiny, float64, with their own switches."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    from gradroute._workloads import sd15_configs

    unet_config, text_config = sd15_configs("tiny")  # the bench's tiny SD-1.5 block types
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(**unet_config).double()
    config = transformers.CLIPTextConfig(
        **{
            **text_config,
            "vocab_size": 100,
            "max_position_embeddings": 16,
            "attention_dropout": 0.1,  # RNG inside the text encoder's checkpointed layers
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 1,
        }
    )
    tenc = transformers.CLIPTextModel(config).double()
    unet.train()
    tenc.train()
    unet.enable_gradient_checkpointing(gradient_checkpointing_func=ck)
    tenc._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=ck)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 100, (2, 16), generator=g)
    noisy = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([10, 500])
    mask = (torch.rand(2, 1, 8, 8, generator=g) > 0.5).double()

    def forward() -> dict[str, torch.Tensor]:
        torch.manual_seed(5)
        h = tenc(input_ids=tokens).last_hidden_state
        pred = unet(noisy, t, encoder_hidden_states=h).sample
        loss = nn.functional.mse_loss(pred, noise, reduction="none")
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return tenc, unet, forward


def _kinds(t: torch.Tensor) -> set[str | None]:
    seen, stack, kinds = set(), [t.grad_fn], set()
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        kinds.add(checkpoint_kind(n))
        stack.extend(f for f, _ in n.next_functions)
    return kinds


def test_diffusers_and_transformers_switches_accept_gradroute_checkpoint() -> None:
    tenc, unet, forward = _sd_tiny(gradroute.checkpoint)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    ls = forward()
    assert _kinds(ls["tenc"]) == {None, "gradroute"}
    gradroute.Router(tenc=tenc, unet=unet).backward(**ls)
    unet.disable_gradient_checkpointing()
    tenc._set_gradient_checkpointing(enable=False)
    expected = reference_grads(forward, groups)  # fresh forward per loss, no checkpointing
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def _counting(ck: CK, counts: dict[str, list[int]]) -> CK:
    """``ck`` that counts, per checkpointed segment, the recomputations run inside a routed backward."""

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        owner = getattr(fn, "__self__", fn)  # diffusers passes the module, transformers a partial
        owner = getattr(owner, "args", [owner])[0] if isinstance(owner, functools.partial) else owner
        side = "unet" if type(owner).__module__.startswith("diffusers") else "tenc"
        slot = len(counts[side])
        counts[side].append(0)

        def counted(*a: Any, **k: Any) -> Any:
            if _session.current() is not None:
                counts[side][slot] += 1
            return fn(*a, **k)

        return ck(counted, *args, **kwargs)

    return run


@pytest.mark.parametrize("ck", ["gradroute", "torch"])
def test_diffusers_and_transformers_recompute_at_most_once_per_pass(ck: str) -> None:
    counts: dict[str, list[int]] = {"tenc": [], "unet": []}
    tenc, unet, forward = _sd_tiny(_counting(CKS[ck], counts))
    gradroute.Router(tenc=tenc, unet=unet).backward(**forward())
    # the first down-block resnet runs before the first cross-attention: only the unet pass enters it;
    # both passes enter every later segment (the text-encoder pass to reach encoder_hidden_states)
    n = len(counts["unet"])
    assert n >= 5 and counts["tenc"] == [1, 1]
    if ck == "torch":
        assert counts["unet"] == [1] + [2] * (n - 1), counts
    else:  # shared where the passes interleave; per call where shared ones would pile up (next test)
        assert counts["unet"][0] == 1 and set(counts["unet"]) == {1, 2}, counts


def test_segments_the_passes_cannot_interleave_are_recomputed_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # diffusers' per-layer switch: its skip connections leave from un-checkpointed ops, so one text-encoder
    # call runs through a whole run of segments; shared, their recomputations would all stay alive until the
    # unet pass came through (at 512 px: several times a plain backward's peak)
    tenc, unet, forward = _sd_tiny(gradroute.checkpoint)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    notes = router.plan(**losses).notes
    assert any("recomputed once per call instead of shared" in n for n in notes), notes  # printed
    live = _backward_sampling_live(monkeypatch, router, losses)
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)

    share_all = gradroute.PlanOptions(held_factor=10**9)  # share every segment
    for p in groups["tenc"] + groups["unet"]:
        p.grad = None
    shared = _backward_sampling_live(
        monkeypatch, gradroute.Router(tenc=tenc, unet=unet, plan_options=share_all), forward()
    )
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)
    assert max(live) < max(shared) and live[-1] == shared[-1] == 0, (live, shared)


def test_checkpoint_modules_recomputes_diffusers_blocks_once_per_routed_backward() -> None:
    tenc, unet, forward = _sd_tiny(gradroute.checkpoint)
    unet.disable_gradient_checkpointing()
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    counts = [0] * len(blocks)
    for k, b in enumerate(blocks):
        gradroute.checkpoint_modules(b)
        inner = b.forward.args[0]  # what the segment runs, in the forward and in the recomputation

        def counted(*a: Any, _k: int = k, _inner: Any = inner, **kw: Any) -> Any:
            if _session.current() is not None:
                counts[_k] += 1
            return _inner(*a, **kw)

        b.forward = functools.partial(gradroute.checkpoint, counted)
    gradroute.Router(tenc=tenc, unet=unet).backward(**forward())
    assert counts == [1] * len(blocks)


def _live_recomputations() -> int:
    """How many checkpointed segments hold recomputed tensors right now."""
    from gradroute._checkpoint import _SEGMENTS

    n = 0
    for _, _, ref in _SEGMENTS:
        frame = ref()
        if frame is None:
            continue
        holders = [h() for h in frame.holders]
        if any(h is not None and any(v is not None for v in h.values.values()) for h in holders):
            n += 1
    return n


def _backward_sampling_live(
    monkeypatch: pytest.MonkeyPatch,
    router: gradroute.Router,
    losses: dict[str, torch.Tensor],
    count: Callable[[], int] = _live_recomputations,
) -> list[int]:
    """Run ``router.backward(**losses)``; after each engine call, ``count()`` (by default: the segments holding
    recomputations)."""
    live: list[int] = []
    for name in ("grad", "backward"):
        engine = getattr(torch.autograd, name)

        def sampled(*args: Any, _engine: Any = engine, **kwargs: Any) -> Any:
            out = _engine(*args, **kwargs)
            live.append(count())
            return out

        monkeypatch.setattr(torch.autograd, name, sampled)
    router.backward(**losses)
    monkeypatch.undo()
    return live


def test_routed_calls_interleave_per_segment_and_free_each_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradroute._demo_models import make_batch, make_models, route_losses

    f64 = torch.float64
    tenc, unet = (m.to(f64) for m in make_models(seed=0, width=8))
    for m in (tenc, unet):
        m.gradient_checkpointing = True
        m.checkpoint_fn = gradroute.checkpoint
    batch = {
        k: v.to(f64) if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in make_batch(3, torch.Generator().manual_seed(0)).items()
    }

    def forward() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        loss_tenc, loss_unet = route_losses(unet(batch["noisy"], batch["timesteps"], tenc(batch["tokens"])), batch)
        return {"tenc": loss_tenc, "unet": loss_unet}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    plan = router.plan(**losses)
    unet_calls = [c for c in plan.calls if c.groups == ("unet",)]
    assert plan.kept_nodes == 0 and len(unet_calls) >= 4  # one per shared segment, not one for the whole UNet

    live = _backward_sampling_live(monkeypatch, router, losses)
    # each segment's shared recomputation is freed by the UNet call that follows the text-encoder call that
    # made it, before the segment after the next is recomputed (all 6 would stay alive without interleaving)
    assert max(live) <= 2, live
    assert live[-1] == 0
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_routed_calls_interleave_inside_one_segment_and_free_it_chunk_by_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the whole unet is one segment: the passes through it are cut every few nodes (the second consumer of
    # each residual stream gets a view of its own), so the recomputation is freed as the unet pass goes down
    tenc, unet = Net(D, 1).double(), Net(D, 12).double()

    def forward() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        x, target = torch.randn(5, D, generator=g, dtype=torch.float64), torch.randn(5, D, generator=g)
        torch.manual_seed(3)
        loss = (gradroute.checkpoint(unet, tenc(x, None), None) - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :3].mean()}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    plan = router.plan(**losses)
    assert plan.kept_nodes == 0 and sum(c.groups == ("unet",) for c in plan.calls) >= 3
    assert any("chunk(s) of gradroute.checkpoint segments" in n for n in plan.notes), plan.notes  # printed

    for b in unet.blocks:
        b.storages.clear()  # (the reference's backwards recomputed too)
    made = [b.storages for b in unet.blocks]
    live = _backward_sampling_live(monkeypatch, router, losses, lambda: sum(not s.expired() for st in made for s in st))
    assert sum(map(len, made)) == 2 * 12  # one recomputation
    after_first = [n for n in live if n]
    # all 24 made at once, then freed in several steps (without chunks: all until one unet call frees them;
    # dropout's outputs are dropped as soon as a call has used them and made again for the next: recipes)
    assert 12 <= after_first[0] <= 24 and len(set(after_first)) >= 3 and live[-1] == 0, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_checkpoint_modules_lets_the_router_interleave_diffusers_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    tenc, unet, forward = _sd_tiny(gradroute.checkpoint)
    ls = forward()
    collapsed = len(gradroute.Router(tenc=tenc, unet=unet).plan(**ls).calls)
    del ls
    unet.disable_gradient_checkpointing()
    gradroute.checkpoint_modules(*unet.down_blocks, unet.mid_block, *unet.up_blocks)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    plan = router.plan(**losses)
    # diffusers' skip connections leave from un-checkpointed ops, which merges the per-layer segments;
    # whole blocks as segments separate again
    assert plan.kept_nodes == 0 and len(plan.calls) > collapsed + 3
    live = _backward_sampling_live(monkeypatch, router, losses)
    assert max(live) <= 2 and live[-1] == 0, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [3, "unet", torch.zeros(2)])
def test_checkpoint_modules_non_module_fails(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`modules` item 1 must be an nn.Module"):
        gradroute.checkpoint_modules(nn.Linear(2, 2), bad)


def test_segment_record_does_not_grow_without_a_router() -> None:

    lin = nn.Linear(3, 3)
    for _ in range(500):
        gradroute.checkpoint(lin, torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert len(_checkpoint._SEGMENTS) <= 128


def test_parameter_passed_into_a_segment_routes_exactly() -> None:
    # segment inputs hand each consuming op a view (like outputs); a leaf parameter among them still gets
    # its gradient, routed or not
    w = nn.Parameter(torch.randn(D, D, dtype=torch.float64))
    v = nn.Parameter(torch.randn(D, D, dtype=torch.float64))
    x = torch.randn(4, D, dtype=torch.float64)

    def f(weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ weight) + h * weight.sum()

    def forward(ck: CK | None = None) -> dict[str, torch.Tensor]:
        h = x @ v
        out = ck(f, w, h) if ck is not None else f(w, h)
        return {"v": out.pow(2).mean(), "w": out.sin().sum()}

    expected = reference_grads(forward, {"v": [v], "w": [w]})
    gradroute.Router(v=[v], w=[w]).backward(**forward(gradroute.checkpoint))
    assert_grads_match([v, w], expected, rtol=1e-9, atol=1e-12)
    w.grad = None
    forward(gradroute.checkpoint)["w"].backward()
    torch.testing.assert_close(w.grad, torch.autograd.grad(forward()["w"], w)[0], rtol=1e-9, atol=1e-12)


def test_segment_inputs_freed_with_their_segment_not_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    # a segment keeps its inputs for the recomputation; they must go once the segment's nodes are freed by
    # their last call, not when the router call returns (they are most of a checkpointed forward's memory)
    tenc, unet = make()
    inputs: list[StorageWeakRef] = []

    def recording(fn: Callable[..., Any], x: torch.Tensor) -> Any:
        inputs.append(StorageWeakRef(x.untyped_storage()))
        return gradroute.checkpoint(fn, x)

    ls = losses(tenc, unet, recording)
    n = len(inputs)
    live = _backward_sampling_live(
        monkeypatch, gradroute.Router(tenc=tenc, unet=unet), ls, lambda: sum(not s.expired() for s in inputs)
    )
    del ls
    # freed one by one as the passes go down (after each of the three unet blocks' last call, ...)
    assert n == 5 and live == sorted(live, reverse=True) and live[-2] <= 2 and live[-1] == 0, live


def test_cut_points_let_diffusers_per_layer_segments_share_one_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    counts: dict[str, list[int]] = {"tenc": [], "unet": []}
    tenc, unet, forward = _sd_tiny(_counting(gradroute.checkpoint, counts))
    from gradroute._workloads import unet_cut_points

    handles = gradroute.cut_points(*unet_cut_points(unet))
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    counts["tenc"].clear()
    counts["unet"].clear()
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    notes = router.plan(**losses).notes
    assert not any("recomputed once per call" in n for n in notes), notes  # interleaved, not torch's plan
    live = _backward_sampling_live(monkeypatch, router, losses)
    assert counts["unet"] == [1] * len(counts["unet"]) and counts["tenc"] == [1, 1], counts  # once each
    assert max(live) <= 2 and live[-1] == 0, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)

    for h in handles:
        h.remove()
    notes = gradroute.Router(tenc=tenc, unet=unet).plan(**forward()).notes
    assert any("recomputed once per call" in n for n in notes), notes  # without them: torch's plan


@pytest.mark.parametrize("bad", [3, "unet", torch.zeros(2)])
def test_cut_points_non_module_fails(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`modules` item 1 must be an nn.Module, got"):
        gradroute.cut_points(nn.Linear(2, 2), bad)


def test_grads_exact_where_segments_are_recomputed_per_call() -> None:
    tenc, unet, forward = _sd_tiny(gradroute.checkpoint)
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
    live = _backward_sampling_live(monkeypatch, router, ls)
    assert max(live) == 0, live  # each call's recomputations are gone when it returns
    assert_grads_match(groups["tenc"] + groups["unet"], expected)

    pile_up = gradroute.PlanOptions(interleave=False, held_factor=10**9)  # shared: they pile up
    for p in groups["tenc"] + groups["unet"]:
        p.grad = None
    live = _backward_sampling_live(
        monkeypatch,
        gradroute.Router(tenc=tenc, unet=unet, plan_options=pile_up),
        losses(tenc, unet, gradroute.checkpoint),
    )
    assert max(live) >= 3, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected)


class _GatedFF(nn.Module):
    """A diffusers-style gated feed-forward: what a pointwise op makes here from saved tensors is cheap to redo."""

    def __init__(self, d: int, scale_in_place: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 8 * d)
        self.out = nn.Linear(4 * d, d)
        self.scale_in_place = scale_in_place
        self.made: list[tuple[str, StorageWeakRef]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj(x)
        h, gate = p.chunk(2, dim=-1)
        g = nn.functional.gelu(gate)
        if self.scale_in_place:
            g.mul_(2.0)  # modified after it was made: its recipe would be wrong
        prod = h * torch.sigmoid(g) * g
        if torch._C._current_graph_task_id() != -1:  # a recomputation
            self.made += [
                (n, StorageWeakRef(t.untyped_storage())) for n, t in (("proj", p), ("gelu", g), ("prod", prod))
            ]
        return x + self.out(prod)


def _gated(scale_in_place: bool) -> tuple[nn.Module, nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    tenc = nn.Linear(D, D).double()
    unet = nn.ModuleList(_GatedFF(D, scale_in_place) for _ in range(2)).double()

    def forward() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(3, 4, D, generator=g, dtype=torch.float64), torch.randn(3, 4, D, generator=g)
        h = tenc(x)
        for m in unet:
            h = gradroute.checkpoint(m, h)
        loss = (h - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :2].mean()}

    return tenc, unet, forward


def _gated_losses(scale_in_place: bool) -> tuple[nn.Module, Callable[[], dict[str, torch.Tensor]], Any, Any, Any]:
    """The gated model, its groups, the reference gradients and one forward's losses (recomputations unseen)."""
    tenc, unet, forward = _gated(scale_in_place)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    ls = forward()
    for m in unet:
        m.made.clear()
    return unet, forward, groups, expected, ls


@pytest.mark.parametrize("scale_in_place", [False, True])
def test_shared_recomputation_drops_what_pointwise_ops_make_and_makes_it_again(scale_in_place: bool) -> None:
    # two engine calls through the same segments: the GELU and the gated product (pointwise ops and a view of
    # saved tensors) are dropped once the first call has used them and made again for the second; the
    # projection's output (a matrix product) is kept between them. A GELU modified in place has no recipe.
    unet, _, groups, expected, ls = _gated_losses(scale_in_place)
    with _session.routed_backward(recipes_min_bytes=0):
        first = torch.autograd.grad(ls["unet"], groups["unet"], retain_graph=True)
        made = {n: [s for m in unet for k, s in m.made if k == n] for n in ("proj", "gelu", "prod")}
        assert [len(v) for v in made.values()] == [2, 2, 2]  # one recomputation
        assert not any(s.expired() for s in made["proj"])
        assert all(s.expired() for s in made["prod"])
        assert [s.expired() for s in made["gelu"]] == [not scale_in_place] * 2
        second = torch.autograd.grad(ls["unet"], groups["unet"], retain_graph=True)
        tenc_grads = torch.autograd.grad(ls["tenc"], groups["tenc"])
        assert len(made["prod"]) == 2
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, g in zip(groups["unet"] + groups["tenc"], [*second, *tenc_grads], strict=True):
        p.grad = g
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_shared_recomputation_under_autocast_makes_the_same_tensors_again() -> None:
    # the recipes record the ops after autocast's casts (bf16 here) and run them again outside autocast, even
    # when the routed backward itself is called under autocast: the gradients are those of torch's checkpoint
    tenc, unet = nn.Linear(D, D), nn.ModuleList(_GatedFF(D) for _ in range(2))
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}

    def forward(ck: CK) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(3, 4, D, generator=g), torch.randn(3, 4, D, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = tenc(x)
            for m in unet:
                h = ck(m, h)
        loss = (h.float() - target) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :2].mean()}

    router = gradroute.Router(**groups, plan_options=gradroute.PlanOptions(recipes_min_bytes=0))
    expected = router.grads(**forward(torch_ck))
    for m in unet:
        m.made.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router.grads(**forward(gradroute.checkpoint))
    prods = [s for m in unet for k, s in m.made if k == "prod"]
    assert len(prods) == 2 and all(s.expired() for s in prods)  # made again, not kept
    for name in groups:
        for a, b in zip(got[name], expected[name], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("min_bytes", [0, 10**9])
def test_small_segments_keep_their_recomputation_between_calls(min_bytes: int) -> None:
    # recipes cost host time on every op of the recomputation: segments saving less than the threshold keep
    # everything between calls, like before; exact either way
    unet, forward, groups, expected, ls = _gated_losses(False)
    with _session.routed_backward(recipes_min_bytes=min_bytes):
        torch.autograd.grad(ls["unet"], groups["unet"], retain_graph=True)
        prods = [s for m in unet for k, s in m.made if k == "prod"]
        assert len(prods) == 2 and [s.expired() for s in prods] == [min_bytes == 0] * 2
    router = gradroute.Router(**groups, plan_options=gradroute.PlanOptions(recipes_min_bytes=min_bytes))
    router.backward(**forward())
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


class _Two(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.a, self.b = inner if inner is not None else _GatedFF(D), _GatedFF(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(gradroute.checkpoint(self.a, x))


def _compile(m: nn.Module) -> Any:
    return torch.compile(m, backend="aot_eager", dynamic=False)


@pytest.fixture
def no_donated_buffers() -> Iterator[None]:
    import torch._functorch.config as functorch_config

    with functorch_config.patch(donated_buffer=False):  # routed calls retain (examples/README.md)
        yield


@pytest.mark.usefixtures("no_donated_buffers")
@pytest.mark.parametrize("where", ["whole model", "segment", "inside a segment"])
def test_torch_compile_with_segments_routes_exactly(where: str) -> None:
    # torch.compile around the model (it traces torch's checkpoint instead), a compiled module as the
    # segment (plain tensors in, no recipes), a compiled module inside a segment (no recipes): all exact
    torch._dynamo.reset()
    tenc = nn.Linear(D, D).double()
    unet = _Two(_compile(_GatedFF(D)) if where == "inside a segment" else None).double()
    run = _compile(unet) if where == "whole model" else unet
    if where == "segment":
        unet.a = _compile(unet.a)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}

    def forward(model: Any) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(3, 4, D, generator=g, dtype=torch.float64), torch.randn(3, 4, D, generator=g)
        loss = (model(tenc(x)) - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :2].mean()}

    expected = reference_grads(lambda: forward(run), groups)
    router = gradroute.Router(**groups, plan_options=gradroute.PlanOptions(recipes_min_bytes=0))
    for _ in range(2):  # the second step runs the cached compiled code
        got = router.grads(**forward(run))
        for name, params in groups.items():
            for p, gr in zip(params, got[name], strict=True):
                torch.testing.assert_close(gr, expected[id(p)], rtol=1e-9, atol=1e-12)
