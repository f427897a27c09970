"""The demo's tiny text encoder and conditional UNet, and the two routed losses; pure torch, nothing downloaded.

A text encoder feeds a conditional denoising UNet; the unmasked loss trains the text encoder, the masked loss
(the shape's region) trains the UNet. Used by ``gradroute demo``, ``gradroute bench --workload sd-tiny`` and the
tests. The data is in ``gradroute.cli.data``, the noise schedule in ``gradroute.cli.noise``.

* ``make_models(seed=0, width=32) -> (tenc, unet)``: a :class:`TinyTextEncoder` and a :class:`TinyUNet`,
  initialised from ``seed`` without touching the global RNG. ``width`` (a multiple of 8) is the UNet's base
  channel count; the text width is ``2 * width``.
* ``forward_losses(tenc, unet, batch) -> (loss_tenc, loss_unet)``: one forward; ``loss_tenc`` is the
  unmasked mean squared error of the predicted noise, ``loss_unet`` the same error times the mask, averaged.
  ``route_losses(pred, batch)`` is the second half (from the UNet's prediction).

Example:
    >>> import torch
    >>> from gradroute.cli.data import make_batch
    >>> from gradroute.cli.models import make_models, forward_losses
    >>> tenc, unet = make_models(seed=0, width=8)
    >>> batch = make_batch(2, torch.Generator().manual_seed(0))
    >>> loss_tenc, loss_unet = forward_losses(tenc, unet, batch)
    >>> tenc(batch["tokens"]).shape
    torch.Size([2, 4, 16])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import MAX_TOKENS, VOCAB


def _maybe_checkpoint(owner: nn.Module, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``, checkpointed when ``owner.gradient_checkpointing`` (with ``owner.checkpoint_fn``, or
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` when that is None)."""
    if owner.gradient_checkpointing and torch.is_grad_enabled():
        if owner.checkpoint_fn is not None:
            return owner.checkpoint_fn(fn, *args)  # type: ignore[no-any-return, operator]
        return checkpoint(fn, *args, use_reentrant=False)  # type: ignore[no-any-return]
    return fn(*args)


class TinyTextEncoder(nn.Module):
    """Token embedding + learned positions + transformer layers (pre-norm, batch-first) + final LayerNorm.

    Args:
        dim: hidden size.
        layers: number of ``nn.TransformerEncoderLayer``.
        heads: attention heads.
        vocab_size: vocabulary size (``len(VOCAB)``).
        max_tokens: sequence length.

    ``forward(tokens (B, T)) -> (B, T, dim)``. Set ``gradient_checkpointing = True`` to checkpoint each layer
    (``torch.utils.checkpoint``, non-reentrant; or ``checkpoint_fn(layer, *args)`` if set, e.g.
    ``gradroute.checkpoint``).

    Example:
        >>> TinyTextEncoder(dim=16)(torch.zeros(2, 4, dtype=torch.long)).shape
        torch.Size([2, 4, 16])
    """

    def __init__(
        self, dim: int = 64, layers: int = 2, heads: int = 4, vocab_size: int = len(VOCAB), max_tokens: int = MAX_TOKENS
    ) -> None:
        super().__init__()
        self.dim = dim
        self.gradient_checkpointing = False
        self.checkpoint_fn: Callable[..., Any] | None = None
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(max_tokens, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=2 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            h = _maybe_checkpoint(self, layer, h)
        return self.norm(h)  # type: ignore[no-any-return]


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of (integer) timesteps: (B,) -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


class ResBlock(nn.Module):
    """GroupNorm + SiLU + conv, twice, with the time embedding added in between, and a skip connection."""

    def __init__(self, cin: int, cout: int, tdim: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(8, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(tdim, cout)
        self.norm2 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(temb)[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h  # type: ignore[no-any-return]


class CrossAttention(nn.Module):
    """Pixels attend to the text hidden states (multi-head, ``scaled_dot_product_attention``), residual."""

    def __init__(self, ch: int, ctx_dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(8, ch)
        self.q = nn.Linear(ch, ch)
        self.kv = nn.Linear(ctx_dim, 2 * ch)
        self.out = nn.Linear(ch, ch)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        q = self.q(self.norm(x).flatten(2).transpose(1, 2))  # (B, HW, C)
        k, v = self.kv(ctx).chunk(2, dim=-1)  # (B, T, C)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, t.shape[1], self.heads, c // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(q), split(k), split(v))  # (B, heads, HW, C/heads)
        a = self.out(a.transpose(1, 2).reshape(b, hh * ww, c))
        return x + a.transpose(1, 2).reshape(b, c, hh, ww)


class _Stage(nn.Module):
    """A ResBlock followed by cross-attention: the unit that is checkpointed."""

    def __init__(self, cin: int, cout: int, tdim: int, ctx_dim: int, heads: int) -> None:
        super().__init__()
        self.res = ResBlock(cin, cout, tdim)
        self.attn = CrossAttention(cout, ctx_dim, heads)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return self.attn(self.res(x, temb), ctx)  # type: ignore[no-any-return]


class TinyUNet(nn.Module):
    """A conditional denoising UNet for 3x32x32 images: two resolutions down, a middle, two up, skips.

    Args:
        width: base channels (a multiple of 8); the 16x16 and 8x8 levels have ``2 * width``.
        ctx_dim: size of the text hidden states it cross-attends to.
        heads: cross-attention heads (must divide ``width``).

    ``forward(x (B, 3, 32, 32), t (B,) int, ctx (B, T, ctx_dim)) -> (B, 3, 32, 32)``, the predicted noise.
    Set ``gradient_checkpointing = True`` to checkpoint each stage (non-reentrant; ``checkpoint_fn`` as in
    :class:`TinyTextEncoder`).

    Example:
        >>> unet = TinyUNet(width=8, ctx_dim=16)
        >>> unet(torch.randn(2, 3, 32, 32), torch.tensor([1, 5]), torch.randn(2, 4, 16)).shape
        torch.Size([2, 3, 32, 32])
    """

    def __init__(self, width: int = 32, ctx_dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, int) or width < 8 or width % 8:
            raise ValueError(f"`width` must be a positive multiple of 8, got {width!r}")
        if width % heads:
            raise ValueError(f"`heads` must divide `width`, got heads={heads!r}, width={width!r}")
        w, w2, tdim = width, 2 * width, 4 * width
        self.width = width
        self.gradient_checkpointing = False
        self.checkpoint_fn: Callable[..., Any] | None = None
        self.time_mlp = nn.Sequential(nn.Linear(w, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(3, w, 3, padding=1)
        self.down0 = _Stage(w, w, tdim, ctx_dim, heads)  # 32x32
        self.pool0 = nn.Conv2d(w, w, 3, stride=2, padding=1)
        self.down1 = _Stage(w, w2, tdim, ctx_dim, heads)  # 16x16
        self.pool1 = nn.Conv2d(w2, w2, 3, stride=2, padding=1)
        self.mid = _Stage(w2, w2, tdim, ctx_dim, heads)  # 8x8
        self.mid2 = ResBlock(w2, w2, tdim)
        self.unpool1 = nn.Conv2d(w2, w2, 3, padding=1)
        self.up1 = _Stage(2 * w2, w2, tdim, ctx_dim, heads)  # 16x16
        self.unpool0 = nn.Conv2d(w2, w, 3, padding=1)
        self.up0 = _Stage(2 * w, w, tdim, ctx_dim, heads)  # 32x32
        self.norm_out = nn.GroupNorm(8, w)
        self.conv_out = nn.Conv2d(w, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        temb = self.time_mlp(timestep_embedding(t, self.width).to(x.dtype))
        h0 = _maybe_checkpoint(self, self.down0, self.conv_in(x), temb, ctx)
        h1 = _maybe_checkpoint(self, self.down1, self.pool0(h0), temb, ctx)
        h = _maybe_checkpoint(self, self.mid, self.pool1(h1), temb, ctx)
        h = _maybe_checkpoint(self, self.mid2, h, temb)
        h = self.unpool1(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = _maybe_checkpoint(self, self.up1, torch.cat([h, h1], 1), temb, ctx)
        h = self.unpool0(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = _maybe_checkpoint(self, self.up0, torch.cat([h, h0], 1), temb, ctx)
        return self.conv_out(F.silu(self.norm_out(h)))  # type: ignore[no-any-return]


def make_models(seed: int = 0, width: int = 32) -> tuple[TinyTextEncoder, TinyUNet]:
    """The demo's text encoder (``dim = 2 * width``) and UNet, initialised from ``seed``.

    The global RNG is left as it was.

    Example:
        >>> tenc, unet = make_models(seed=0, width=8)
        >>> sum(p.numel() for p in unet.parameters()) > 0
        True
    """
    if isinstance(width, bool) or not isinstance(width, int) or width < 8 or width % 8:
        raise ValueError(f"`width` must be a positive multiple of 8, got {width!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tenc = TinyTextEncoder(dim=2 * width)
        unet = TinyUNet(width=width, ctx_dim=2 * width)
    return tenc, unet


def route_losses(pred: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_tenc, loss_unet)`` from the UNet's noise prediction: unmasked and masked mean squared error."""
    noise = batch["noise"]
    # the prediction in float32 (half precision under autocast), promoted with the noise explicitly: torch
    # 2.5's mse_loss backward fails on a float32 prediction against float64 noise
    dtype = torch.promote_types(torch.float32, noise.dtype)
    loss = F.mse_loss(pred.float().to(dtype), noise.to(dtype), reduction="none")
    return loss.mean(), (loss * batch["masks"]).mean()


def forward_losses(tenc: nn.Module, unet: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of both models: ``(loss_tenc, loss_unet)``, see :func:`route_losses`."""
    hidden = tenc(batch["tokens"])
    return route_losses(unet(batch["noisy"], batch["timesteps"], hidden), batch)
