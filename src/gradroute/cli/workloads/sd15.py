"""``sd15``: transformers ``CLIPTextModel`` -> diffusers ``UNet2DConditionModel`` in the Stable Diffusion 1.5
configuration (random init from configs, nothing downloaded), 64x64 latents, 77 tokens.

diffusers and transformers are imported when the workload is built, not with this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .workload import Workload


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


#: Stable Diffusion 1.5's UNet and CLIP ViT-L/14 text encoder
_UNET: dict[str, Any] = {
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
_TEXT: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
#: what the tiny configuration (the same block types) changes
_TINY_UNET: dict[str, Any] = {
    "sample_size": 16,
    "layers_per_block": 1,
    "block_out_channels": (32, 64),
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 32,
}
_TINY_TEXT: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "projection_dim": 32,
}


def sd15_configs(size: str = "full") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(unet_config, text_config)``, fresh dicts: Stable Diffusion 1.5's UNet and CLIP ViT-L/14 text encoder,
    or a tiny configuration of the same block types (``size="tiny"``) for tests."""
    if size == "full":
        return dict(_UNET), dict(_TEXT)
    if size == "tiny":
        return {**_UNET, **_TINY_UNET}, {**_TEXT, **_TINY_TEXT}
    raise ValueError(f"`size` must be 'full' or 'tiny', got {size!r}")


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


def build_sd15(
    bs: int, dev: torch.device, checkpointing: bool, seed: int, size: str, latent_size: int | None
) -> Workload:
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
    batch = _batch(bs, hw, text_cfg, torch.Generator().manual_seed(seed + 1), dev)

    def up(b: dict[str, Any]) -> torch.Tensor:
        return tenc(input_ids=b["tokens"]).last_hidden_state  # type: ignore[no-any-return]

    def down(b: dict[str, Any], h: torch.Tensor, need: Sequence[str]) -> dict[str, torch.Tensor]:
        pred = unet(b["noisy"], b["timesteps"], encoder_hidden_states=h).sample
        loss = F.mse_loss(pred.float(), b["noise"], reduction="none")
        return {"tenc": loss.mean(), "unet": (loss * b["masks"]).mean()}

    info = {"size": size, "latent_size": hw}
    switch = _checkpoint_switch(tenc, unet) if checkpointing else None
    return Workload("sd15", "tenc", "unet", tenc, unet, batch, up, down, info, switch)


def _batch(bs: int, hw: int, text_cfg: dict[str, Any], g: torch.Generator, dev: torch.device) -> dict[str, Any]:
    """Latents noised at random timesteps (SD's "scaled_linear" betas), one random box per sample as the
    region mask, random tokens."""
    latents = torch.randn(bs, 4, hw, hw, generator=g)
    noise = torch.randn(bs, 4, hw, hw, generator=g)
    t = torch.randint(0, 1000, (bs,), generator=g)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2  # "scaled_linear"
    abar = torch.cumprod(1 - betas, 0).float()[t].view(bs, 1, 1, 1)
    noisy = abar.sqrt() * latents + (1 - abar).sqrt() * noise
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
    return {k: v.to(dev) for k, v in batch.items()}


def _checkpoint_switch(tenc: Any, unet: Any) -> Callable[[str], None]:
    """``Workload.set_checkpoint`` for sd15: each call undoes the previous kind's ``checkpoint_modules`` and
    ``cut_points`` before switching both networks to the new kind."""
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

    return set_checkpoint
