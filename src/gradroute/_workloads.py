"""Workloads for ``gradroute bench``: two chained networks, one forward, one loss routed to each.

A workload has an *upstream* group (its output, the *boundary*, feeds the downstream network) and a
*downstream* group. ``up(batch) -> boundary`` and ``down(batch, boundary, need) -> {group: loss}`` are split so
that the strategies that detach the boundary or run the downstream network twice can be written generically
(see ``_bench.py``). ``need`` names the losses to compute (a GAN's generator loss needs no real-image forward).

* ``sd-tiny``: the demo's text encoder -> conditional UNet (``_demo_models``); ``tenc`` gets the unmasked
  denoising loss, ``unet`` the masked one.
* ``gan``: generator -> discriminator, one discriminator forward on the fakes shared by both losses
  (non-saturating): ``D`` gets ``softplus(-D(real)) + softplus(D(fake))``, ``G`` gets ``softplus(-D(fake))``.
* ``actor-critic``: TD3-style. ``critic`` (twin Q) gets the TD error against a target made without grad
  (target actor with clipped noise, min of target critics); ``actor`` gets ``-Q1(s, actor(s))``, through the
  critic.
* ``sd15``: transformers ``CLIPTextModel`` -> diffusers ``UNet2DConditionModel`` in the Stable Diffusion 1.5
  configuration (random init from configs, nothing downloaded), 64x64 latents, 77 tokens.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WORKLOADS = ("sd-tiny", "gan", "actor-critic", "sd15")
DEFAULT_BATCH = {"sd-tiny": 16, "gan": 64, "actor-critic": 256, "sd15": 8}
CHECKPOINTING = ("sd-tiny", "sd15")


@dataclass(eq=False)
class Workload:
    """Two chained networks and a fixed batch.

    Attributes:
        name: the workload's name.
        up_name, down_name: group names of the upstream and downstream networks.
        up_module, down_module: the networks (all their trainable parameters form the group).
        batch: the fixed batch, already on the device.
        up: ``batch -> boundary`` (the upstream network's output).
        down: ``(batch, boundary, need) -> {group name: scalar loss}`` for the names in ``need``.
        info: sizes, for the report.
        set_checkpoint: with activation checkpointing, switches the checkpoint function of both networks:
            ``"torch"`` (``torch.utils.checkpoint``, non-reentrant), ``"gradroute"`` (``gradroute.checkpoint``) or
            ``"blocks"`` (``gradroute.checkpoint_modules`` on whole UNet blocks) or ``"cuts"`` (``"gradroute"`` with
            ``gradroute.cut_points`` on the UNet blocks' submodules; ``sd-tiny``: as ``"gradroute"``).
    """

    name: str
    up_name: str
    down_name: str
    up_module: nn.Module
    down_module: nn.Module
    batch: Any
    up: Callable[[Any], torch.Tensor]
    down: Callable[[Any, torch.Tensor, Sequence[str]], dict[str, torch.Tensor]]
    info: dict[str, Any] = field(default_factory=dict)
    set_checkpoint: Callable[[str], None] | None = None

    @property
    def groups(self) -> dict[str, nn.Module]:
        return {self.up_name: self.up_module, self.down_name: self.down_module}

    def params(self, name: str) -> list[torch.Tensor]:
        return [p for p in self.groups[name].parameters() if p.requires_grad]

    def forward(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One forward of both networks: the boundary and both losses."""
        h = self.up(self.batch)
        return h, self.down(self.batch, h, (self.up_name, self.down_name))


def build(
    name: str,
    *,
    batch_size: int | None = None,
    device: torch.device | str = "cpu",
    checkpointing: bool = False,
    seed: int = 0,
    width: int | None = None,
    size: str = "full",
    latent_size: int | None = None,
) -> Workload:
    """Build a workload with its models and a fixed batch on ``device`` (fp32 weights).

    Args:
        name: one of ``WORKLOADS``.
        batch_size: samples per batch (``DEFAULT_BATCH[name]`` if None).
        device: where models and batch live.
        checkpointing: activation checkpointing in both networks (``sd-tiny`` and ``sd15`` only).
        seed: initialisation and data seed.
        width: model width (``sd-tiny``: the UNet's base channels, default 32; ``gan``: default 64;
            ``actor-critic``: hidden units, default 256).
        size: ``"full"``, or ``"tiny"`` for a miniature ``sd15`` configuration (tests).
        latent_size: ``sd15`` only: the latents' height and width (default: the configuration's, 64 for the
            full model, i.e. 512-pixel images); smaller makes the full architecture affordable on a CPU.

    Raises:
        ValueError: an unknown workload or a bad size.
        ImportError: ``sd15`` without diffusers/transformers installed.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if checkpointing and name not in CHECKPOINTING:
        raise ValueError(f"`--checkpointing` applies to {' and '.join(CHECKPOINTING)}, not {name!r}")
    if latent_size is not None:
        if name != "sd15":
            raise ValueError(f"`--latent-size` applies to sd15, not {name!r}")
        if isinstance(latent_size, bool) or not isinstance(latent_size, int) or latent_size < 8 or latent_size % 8:
            raise ValueError(f"`--latent-size` must be a positive multiple of 8, got {latent_size!r}")
    bs = DEFAULT_BATCH[name] if batch_size is None else batch_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {bs!r}")
    dev = torch.device(device)
    if name == "sd-tiny":
        wl = _sd_tiny(bs, dev, checkpointing, seed, 32 if width is None else width)
    elif name == "gan":
        wl = _gan(bs, dev, seed, 64 if width is None else width)
    elif name == "actor-critic":
        wl = _actor_critic(bs, dev, seed, 256 if width is None else width)
    else:
        wl = _sd15(bs, dev, checkpointing, seed, size, latent_size)
    wl.info.setdefault("params", {n: sum(p.numel() for p in wl.params(n)) for n in wl.groups})
    return wl


# ---------------------------------------------------------------------------------------------- sd-tiny


def _sd_tiny(bs: int, dev: torch.device, checkpointing: bool, seed: int, width: int) -> Workload:
    from ._demo_models import make_batch, make_models, route_losses

    tenc, unet = make_models(seed=seed, width=width)
    tenc.gradient_checkpointing = unet.gradient_checkpointing = checkpointing
    tenc.to(dev)
    unet.to(dev)
    batch = make_batch(bs, torch.Generator().manual_seed(seed + 1), device=dev)

    def up(b: dict[str, Any]) -> torch.Tensor:
        return tenc(b["tokens"])  # type: ignore[no-any-return]

    def down(b: dict[str, Any], h: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        loss_tenc, loss_unet = route_losses(unet(b["noisy"], b["timesteps"], h), b)
        return {"tenc": loss_tenc, "unet": loss_unet}

    def set_checkpoint(kind: str) -> None:
        import gradroute

        shared = kind in ("gradroute", "blocks", "cuts")
        tenc.checkpoint_fn = unet.checkpoint_fn = gradroute.checkpoint if shared else None

    return Workload(
        "sd-tiny",
        "tenc",
        "unet",
        tenc,
        unet,
        batch,
        up,
        down,
        {"width": width},
        set_checkpoint if checkpointing else None,
    )


# ---------------------------------------------------------------------------------------------- gan


class _Generator(nn.Module):
    def __init__(self, z_dim: int, w: int) -> None:
        super().__init__()
        self.w = w
        self.fc = nn.Linear(z_dim, 4 * w * 4 * 4)
        chans = [4 * w, 2 * w, w, w]
        blocks: list[nn.Module] = []
        for cin, cout in itertools.pairwise(chans):
            blocks += [
                nn.Upsample(scale_factor=2.0, mode="nearest"),
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.GroupNorm(8, cout),
                nn.SiLU(),
            ]
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Conv2d(w, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.fc(z).view(z.shape[0], 4 * self.w, 4, 4)
        return torch.tanh(self.out(self.blocks(h)))


class _Discriminator(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, w, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(w, 2 * w, 4, stride=2, padding=1),
            nn.GroupNorm(8, 2 * w),
            nn.LeakyReLU(0.2),
            nn.Conv2d(2 * w, 4 * w, 4, stride=2, padding=1),
            nn.GroupNorm(8, 4 * w),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(4 * w * 4 * 4, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)  # type: ignore[no-any-return]


def _gan(bs: int, dev: torch.device, seed: int, width: int) -> Workload:
    from ._demo_models import make_batch

    if width < 8 or width % 8:
        raise ValueError(f"`width` must be a positive multiple of 8 for `gan`, got {width!r}")
    z_dim = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gen, disc = _Generator(z_dim, width), _Discriminator(width)
    gen.to(dev)
    disc.to(dev)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {"z": torch.randn(bs, z_dim, generator=g).to(dev), "real": make_batch(bs, g, device=dev)["images"]}

    def up(b: dict[str, Any]) -> torch.Tensor:
        return gen(b["z"])  # type: ignore[no-any-return]

    def down(b: dict[str, Any], fake: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        d_fake = disc(fake).float()  # the one discriminator forward on the fakes, shared by both losses
        out = {}
        if "G" in need:
            out["G"] = F.softplus(-d_fake).mean()
        if "D" in need:
            out["D"] = F.softplus(-disc(b["real"]).float()).mean() + F.softplus(d_fake).mean()
        return out

    return Workload("gan", "G", "D", gen, disc, batch, up, down, {"width": width, "z_dim": z_dim})


# ---------------------------------------------------------------------------------------------- actor-critic


def _mlp(sizes: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if k + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Actor(nn.Module):
    def __init__(self, obs: int, act: int, hidden: int) -> None:
        super().__init__()
        self.net = _mlp([obs, hidden, hidden, act])

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(s))


class _TwinCritic(nn.Module):
    def __init__(self, obs: int, act: int, hidden: int) -> None:
        super().__init__()
        self.q1 = _mlp([obs + act, hidden, hidden, 1])
        self.q2 = _mlp([obs + act, hidden, hidden, 1])

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sa = torch.cat([s, a], 1)
        return self.q1(sa).squeeze(1), self.q2(sa).squeeze(1)

    def q1_only(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.q1(torch.cat([s, a], 1)).squeeze(1)  # type: ignore[no-any-return]


def _actor_critic(bs: int, dev: torch.device, seed: int, hidden: int) -> Workload:
    if hidden < 1:
        raise ValueError(f"`width` must be positive for `actor-critic`, got {hidden!r}")
    obs, act, gamma = 24, 6, 0.99
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        actor, critic = _Actor(obs, act, hidden), _TwinCritic(obs, act, hidden)
    actor_t, critic_t = copy.deepcopy(actor), copy.deepcopy(critic)
    for m in (actor, critic, actor_t, critic_t):
        m.to(dev)
    for p in (*actor_t.parameters(), *critic_t.parameters()):
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    batch = {
        "s": torch.randn(bs, obs, generator=g),
        "a": torch.rand(bs, act, generator=g) * 2 - 1,
        "r": torch.randn(bs, generator=g),
        "s2": torch.randn(bs, obs, generator=g),
        "done": (torch.rand(bs, generator=g) < 0.05).float(),
        "noise": (0.2 * torch.randn(bs, act, generator=g)).clamp(-0.5, 0.5),
    }
    batch = {k: v.to(dev) for k, v in batch.items()}

    def up(b: dict[str, Any]) -> torch.Tensor:
        return actor(b["s"])  # type: ignore[no-any-return]

    def down(b: dict[str, Any], a_pi: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        out = {}
        if "critic" in need:
            with torch.no_grad():
                a2 = (actor_t(b["s2"]) + b["noise"]).clamp(-1, 1)
                y = b["r"] + gamma * (1 - b["done"]) * torch.minimum(*critic_t(b["s2"], a2)).float()
            q1, q2 = critic(b["s"], b["a"])
            out["critic"] = F.mse_loss(q1.float(), y) + F.mse_loss(q2.float(), y)
        if "actor" in need:
            out["actor"] = -critic.q1_only(b["s"], a_pi).float().mean()
        return out

    return Workload("actor-critic", "actor", "critic", actor, critic, batch, up, down, {"hidden": hidden})


# ---------------------------------------------------------------------------------------------- sd15


def _require_sd15() -> tuple[Any, Any, Any]:
    try:
        from diffusers import UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel
    except ImportError as e:
        raise ImportError(
            "the `sd15` workload needs diffusers and transformers "
            f"(pip install 'gradroute[diffusers]'); importing them failed: {e}"
        ) from None
    return UNet2DConditionModel, CLIPTextConfig, CLIPTextModel


def sd15_configs(size: str = "full") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(unet_config, text_config)``: Stable Diffusion 1.5's UNet and CLIP ViT-L/14 text encoder, or a tiny
    configuration of the same block types (``size="tiny"``) for tests."""
    if size == "full":
        unet = {
            "sample_size": 64,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": (320, 640, 1280, 1280),
            "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            "cross_attention_dim": 768,
            "attention_head_dim": 8,
            "norm_num_groups": 32,
        }
        text = {
            "vocab_size": 49408,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 77,
            "hidden_act": "quick_gelu",
            "projection_dim": 768,
        }
    elif size == "tiny":
        unet = {
            "sample_size": 16,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 1,
            "block_out_channels": (32, 64),
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "cross_attention_dim": 32,
            "attention_head_dim": 8,
            "norm_num_groups": 32,
        }
        text = {
            "vocab_size": 1000,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 77,
            "hidden_act": "quick_gelu",
            "projection_dim": 32,
        }
    else:
        raise ValueError(f"`size` must be 'full' or 'tiny', got {size!r}")
    return unet, text


def unet_cut_points(unet: Any) -> list[torch.nn.Module]:
    """The submodules of a diffusers ``UNet2DConditionModel`` whose outputs feed skip connections or several
    layers (``conv_in``, ``time_embedding``, and every resnet, transformer model, down- and upsampler of its
    blocks): with ``gradroute.cut_points`` on them, the router interleaves its passes layer by layer."""
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    subs = [
        m
        for b in blocks
        for name in ("resnets", "attentions", "downsamplers", "upsamplers")
        for m in (getattr(b, name, None) or [])
    ]
    return [unet.conv_in, unet.time_embedding, *subs]


def _sd15(bs: int, dev: torch.device, checkpointing: bool, seed: int, size: str, latent_size: int | None) -> Workload:
    unet_cls, text_config_cls, text_cls = _require_sd15()
    unet_cfg, text_cfg = sd15_configs(size)
    if latent_size is not None:
        unet_cfg["sample_size"] = latent_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = unet_cls(**unet_cfg)
        tenc = text_cls(text_config_cls(**text_cfg))
    tenc.train()
    unet.train()
    if checkpointing:
        unet.enable_gradient_checkpointing()
        tenc.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tenc.to(dev)
    unet.to(dev)
    hw = unet_cfg["sample_size"]
    g = torch.Generator().manual_seed(seed + 1)
    latents = torch.randn(bs, 4, hw, hw, generator=g)
    noise = torch.randn(bs, 4, hw, hw, generator=g)
    t = torch.randint(0, 1000, (bs,), generator=g)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2  # "scaled_linear"
    abar = torch.cumprod(1 - betas, 0).float()[t].view(bs, 1, 1, 1)
    noisy = abar.sqrt() * latents + (1 - abar).sqrt() * noise
    # one random box per sample as the "region" mask
    lo = torch.randint(0, hw // 2, (bs, 2), generator=g)
    ext = torch.randint(hw // 4, hw // 2 + 1, (bs, 2), generator=g)
    ys = torch.arange(hw).view(1, hw, 1)
    xs = torch.arange(hw).view(1, 1, hw)
    mask = (
        (ys >= lo[:, 0, None, None])
        & (ys < (lo[:, 0] + ext[:, 0])[:, None, None])
        & (xs >= lo[:, 1, None, None])
        & (xs < (lo[:, 1] + ext[:, 1])[:, None, None])
    )
    tokens = torch.randint(0, text_cfg["vocab_size"], (bs, text_cfg["max_position_embeddings"]), generator=g)
    batch = {
        "tokens": tokens,
        "noisy": noisy,
        "noise": noise,
        "timesteps": t,
        "masks": mask.unsqueeze(1).float(),
    }
    batch = {k: v.to(dev) for k, v in batch.items()}

    def up(b: dict[str, Any]) -> torch.Tensor:
        return tenc(input_ids=b["tokens"]).last_hidden_state  # type: ignore[no-any-return]

    def down(b: dict[str, Any], h: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        pred = unet(b["noisy"], b["timesteps"], encoder_hidden_states=h).sample
        loss = F.mse_loss(pred.float(), b["noise"], reduction="none")
        return {"tenc": loss.mean(), "unet": (loss * b["masks"]).mean()}

    current = ["torch"]
    cut_handles: list[Any] = []

    def set_checkpoint(kind: str) -> None:
        if kind == current[0]:
            return
        import gradroute

        blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
        for m in blocks:  # undo checkpoint_modules
            m.__dict__.pop("forward", None)
        while cut_handles:  # and cut_points
            cut_handles.pop().remove()
        if kind == "blocks":
            unet.disable_gradient_checkpointing()
            gradroute.checkpoint_modules(*blocks)
        elif kind in ("gradroute", "cuts"):
            unet.enable_gradient_checkpointing(gradient_checkpointing_func=gradroute.checkpoint)
            if kind == "cuts":
                cut_handles.extend(gradroute.cut_points(*unet_cut_points(unet)))
        else:
            unet.enable_gradient_checkpointing()
        if kind == "torch":
            tenc.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            tenc._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=gradroute.checkpoint)
        current[0] = kind

    info = {"size": size, "latent_size": hw}
    return Workload(
        "sd15", "tenc", "unet", tenc, unet, batch, up, down, info, set_checkpoint if checkpointing else None
    )
