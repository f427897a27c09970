"""Workloads for ``gradroute bench``: two chained networks, one forward, one loss routed to each.

A workload has an *upstream* group (its output, the *boundary*, feeds the downstream network) and a
*downstream* group. ``up(batch) -> boundary`` and ``down(batch, boundary, need) -> {group: loss}`` are split so
that the strategies that detach the boundary or run the downstream network twice can be written generically
(see ``gradroute.cli.bench.strategies``). ``need`` names the losses to compute (a GAN's generator loss needs
no real-image forward).

One module per workload: ``sd_tiny`` (the demo's text encoder -> UNet), ``gan`` (generator -> discriminator),
``actor_critic`` (TD3-style actor -> twin critic), ``sd15`` (Stable Diffusion 1.5's CLIP text encoder -> UNet,
random init). ``build(name, ...)`` makes any of them; ``WORKLOADS`` in ``gradroute.cli.choices`` names them.
"""

from __future__ import annotations

import torch

from ..choices import CHECKPOINTING, DEFAULT_BATCH, WORKLOADS
from .actor_critic import build_actor_critic
from .gan import build_gan
from .sd15 import build_sd15
from .sd_tiny import build_sd_tiny
from .workload import Workload

__all__ = ["Workload", "build"]


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
        wl = build_sd_tiny(bs, dev, checkpointing, seed, 32 if width is None else width)
    elif name == "gan":
        wl = build_gan(bs, dev, seed, 64 if width is None else width)
    elif name == "actor-critic":
        wl = build_actor_critic(bs, dev, seed, 256 if width is None else width)
    else:
        wl = build_sd15(bs, dev, checkpointing, seed, size, latent_size)
    wl.info.setdefault("params", {n: sum(p.numel() for p in wl.params(n)) for n in wl.groups})
    return wl
