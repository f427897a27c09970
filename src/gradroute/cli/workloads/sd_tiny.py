"""``sd-tiny``: the demo's text encoder -> conditional UNet; ``tenc`` gets the unmasked denoising loss, ``unet``
the masked one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..choices import CKPT_STRATEGIES
from ..data import make_batch
from ..models import make_models, route_losses
from .workload import Workload


def build_sd_tiny(bs: int, dev: torch.device, checkpointing: bool, seed: int, width: int) -> Workload:
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

        shared = kind in CKPT_STRATEGIES.values()  # every kind but "torch"
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
