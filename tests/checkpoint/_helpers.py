"""Models, forwards and probes shared by the checkpoint tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import gradroute
from gradroute import _compat
from gradroute._checkpoint import checkpoint_kind
from gradroute._checkpoint._registry import this_thread

CK = Callable[..., Any]


torch_ck: CK = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


CKS = {"gradroute": gradroute.checkpoint, "torch": torch_ck}

#: for tests that route diffusers' switch alone on purpose: the warning that cut points are missing is expected
switch_alone = pytest.mark.filterwarnings("ignore:gradroute.checkpoint. this routed backward:UserWarning")


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
        if _compat.current_graph_task_id() != -1:  # a forward inside an engine call is a recomputation
            self.recomputed += 1
            self.storages += [StorageWeakRef(t.untyped_storage()) for t in (a, h)]  # keep an eye on two
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


def sd_tiny(ck: CK) -> tuple[nn.Module, nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    """diffusers UNet2DConditionModel + transformers CLIPTextModel, tiny, float64, with their own switches."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    from gradroute.cli.workloads.sd15 import sd15_configs

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


def counting(ck: CK, counts: dict[str, list[int]]) -> CK:
    """``ck`` that counts, per checkpointed segment, the recomputations run inside a routed backward."""

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # diffusers passes the module, transformers a partial (of the module, or of its bound __call__)
        owner = fn
        while isinstance(owner, functools.partial):
            owner = owner.args[0] if owner.args else owner.func
        owner = getattr(owner, "__self__", owner)
        side = "unet" if type(owner).__module__.startswith("diffusers") else "tenc"
        slot = len(counts[side])
        counts[side].append(0)

        def counted(*a: Any, **k: Any) -> Any:
            if _compat.current_graph_task_id() != -1:  # inside an engine call: a recomputation
                counts[side][slot] += 1
            return fn(*a, **k)

        return ck(counted, *args, **kwargs)

    return run


def live_recomputations() -> int:
    """How many of this thread's checkpointed segments hold recomputed tensors right now."""
    n = 0
    for frame in this_thread().frames():
        placeholders = [ref() for ref in frame.placeholders]
        if any(p is not None and any(v is not None for v in p.values.values()) for p in placeholders):
            n += 1
    return n


def backward_sampling_live(
    monkeypatch: pytest.MonkeyPatch,
    router: gradroute.Router,
    losses: dict[str, torch.Tensor],
    count: Callable[[], int] = live_recomputations,
) -> list[int]:
    """Run ``router.backward(**losses)``; after each engine call, ``count()`` (by default: the segments holding
    recomputations)."""
    from gradroute import _execute

    live: list[int] = []
    engine = _execute.run_engine

    def sampled(*args: Any, **kwargs: Any) -> Any:
        out = engine(*args, **kwargs)
        live.append(count())
        return out

    monkeypatch.setattr(_execute, "run_engine", sampled)  # every engine call of a routed backward goes there
    router.backward(**losses)
    monkeypatch.undo()
    return live


class GatedFF(nn.Module):
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
            g.mul_(2.0)  # modified after it was made: a remake would be wrong
        prod = h * torch.sigmoid(g) * g
        if _compat.current_graph_task_id() != -1:  # a recomputation
            self.made += [
                (n, StorageWeakRef(t.untyped_storage())) for n, t in (("proj", p), ("gelu", g), ("prod", prod))
            ]
        return x + self.out(prod)


def gated(scale_in_place: bool) -> tuple[nn.Module, nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    tenc = nn.Linear(D, D).double()
    unet = nn.ModuleList(GatedFF(D, scale_in_place) for _ in range(2)).double()

    def forward() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        x, target = torch.randn(3, 4, D, generator=g, dtype=torch.float64), torch.randn(3, 4, D, generator=g)
        h = tenc(x)
        for m in unet:
            h = gradroute.checkpoint(m, h)
        loss = (h - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :2].mean()}

    return tenc, unet, forward


class Counted:
    """``fn`` that counts every call (forward and recomputations)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.fn(*args, **kwargs)


def checkpoint_kinds(t: torch.Tensor) -> set[str | None]:
    """The checkpoint kinds of the nodes of the graph below ``t``."""
    seen, stack, kinds = set(), [t.grad_fn], set()
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        kinds.add(checkpoint_kind(n))
        stack.extend(f for f, _ in n.next_functions)
    return kinds


#: autocast dtypes of the precision tests on CPU (None: plain float32)
PRECISIONS: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sd_stack(
    switch: str, autocast: torch.dtype | None, cuts: bool = False
) -> tuple[nn.Module, nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    """The tiny Stable Diffusion stack in float32: transformers' CLIPTextModel -> diffusers' UNet2DConditionModel.

    Args:
        switch: ``"none"`` (no checkpointing), ``"torch"`` (both libraries' own switches, torch's non-reentrant
            checkpoint) or ``"gradroute"`` (``unet.enable_gradient_checkpointing(gradient_checkpointing_func=
            gradroute.checkpoint)`` and ``gradroute.enable_checkpointing(text_encoder)``) or
            ``"enable_checkpointing"`` (``gradroute.enable_checkpointing`` on both: cut points included).
        autocast: the forward runs under CPU autocast to this dtype (None: none).
        cuts: also ``gradroute.cut_points`` on the UNet's blocks' layers (docs/checkpointing.md).

    Returns:
        ``(text_encoder, unet, forward)``: the same weights for every ``switch``; ``forward()`` gives the
        losses ``{"tenc": mean, "unet": masked mean}`` of one noise prediction, with the same dropout masks
        on every call (the text encoder's attention dropout draws inside its checkpointed layers).
    """
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    tenc = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=99,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=77,
            attention_dropout=0.1,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    unet = diffusers.UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=32,
    )
    tenc.train()
    unet.train()
    if switch == "torch":
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=torch_ck)
        enable = getattr(tenc, "activation_checkpointing_enable", None)  # transformers 5.23+; before: the alias
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            tenc.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif switch == "gradroute":
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=gradroute.checkpoint)
        gradroute.enable_checkpointing(tenc)
    elif switch == "enable_checkpointing":
        gradroute.enable_checkpointing(unet)
        gradroute.enable_checkpointing(tenc)
    if cuts:
        from gradroute.cli.workloads.sd15 import unet_cut_points

        gradroute.cut_points(*unet_cut_points(unet))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 99, (2, 16), generator=g)
    noisy, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    mask = (torch.rand(2, 1, 8, 8, generator=g) > 0.5).float()
    timesteps = torch.tensor([10, 500])

    def forward() -> dict[str, torch.Tensor]:
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            states = tenc(input_ids=tokens).last_hidden_state
            pred = unet(noisy, timesteps, encoder_hidden_states=states).sample
        loss = nn.functional.mse_loss(pred.float(), noise, reduction="none")
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return tenc, unet, forward
