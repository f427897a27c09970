"""Tiny embedded models and data for ``gradroute demo``, ``gradroute bench --workload sd-tiny`` and the tests.

Pure torch, nothing downloaded. The scenario: a text encoder feeds a conditional denoising UNet; the
unmasked loss trains the text encoder, the masked loss (the shape's region) trains the UNet.

Stable API (the tests import these names):

* ``make_models(seed=0, width=32) -> (tenc, unet)``: a :class:`TinyTextEncoder` and a :class:`TinyUNet`,
  initialised from ``seed`` without touching the global RNG. ``width`` (a multiple of 8) is the UNet's base
  channel count; the text width is ``2 * width``.
* ``make_batch(batch_size, generator, *, device=None, schedule=None) -> dict``: a deterministic batch from a
  CPU ``torch.Generator``, with keys ``tokens`` (B, T) int64, ``images`` (B, 3, 32, 32) in [-1, 1],
  ``masks`` (B, 1, 32, 32) float 0/1, ``captions`` (list of str), and, for the denoising loss,
  ``timesteps`` (B,) int64, ``noise`` (B, 3, 32, 32) and ``noisy`` (the images noised at ``timesteps``).
* ``forward_losses(tenc, unet, batch) -> (loss_tenc, loss_unet)``: one forward; ``loss_tenc`` is the
  unmasked mean squared error of the predicted noise, ``loss_unet`` the same error times the mask, averaged.
  ``route_losses(pred, batch)`` is the second half (from the UNet's prediction).
* ``NoiseSchedule`` (``SCHEDULE`` is the default one): cosine DDPM schedule, ``add_noise``, ``predict_x0``,
  ``sample`` (deterministic DDIM).
* ``tokenize(captions)``, ``VOCAB``, ``COLOURS``, ``SHAPES``, ``POSITIONS``, ``IMAGE_SIZE``, ``MAX_TOKENS``.

Example:
    >>> import torch
    >>> from gradroute._demo_models import make_models, make_batch, forward_losses
    >>> tenc, unet = make_models(seed=0, width=8)
    >>> batch = make_batch(2, torch.Generator().manual_seed(0))
    >>> loss_tenc, loss_unet = forward_losses(tenc, unet, batch)
    >>> tenc(batch["tokens"]).shape
    torch.Size([2, 4, 16])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IMAGE_SIZE = 32
#: name -> RGB in [0, 1]
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.3, 0.95),
    "yellow": (0.95, 0.9, 0.1),
    "magenta": (0.9, 0.2, 0.9),
    "cyan": (0.1, 0.9, 0.9),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
#: name -> (x, y) centre in pixels
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (9.0, 9.0),
    "top right": (23.0, 9.0),
    "bottom left": (9.0, 23.0),
    "bottom right": (23.0, 23.0),
    "center": (16.0, 16.0),
}
PAD = "<pad>"
VOCAB: tuple[str, ...] = (
    PAD,
    *COLOURS,
    *SHAPES,
    *dict.fromkeys(w for pos in POSITIONS for w in pos.split()),
)
MAX_TOKENS = 4
_WORD_ID = {w: i for i, w in enumerate(VOCAB)}


def tokenize(captions: Sequence[str]) -> torch.Tensor:
    """Word ids of ``captions``, padded to ``MAX_TOKENS``: a (B, MAX_TOKENS) int64 tensor.

    Raises:
        ValueError: a word outside ``VOCAB`` or a caption longer than ``MAX_TOKENS`` words.
    """
    rows = []
    for c in captions:
        words = c.split()
        if len(words) > MAX_TOKENS:
            raise ValueError(f"caption {c!r} has {len(words)} words; at most {MAX_TOKENS}")
        ids = []
        for w in words:
            if w not in _WORD_ID:
                raise ValueError(f"word {w!r} of caption {c!r} is not in the vocabulary")
            ids.append(_WORD_ID[w])
        rows.append(ids + [0] * (MAX_TOKENS - len(ids)))
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), MAX_TOKENS)


# ---------------------------------------------------------------------------------------------- data


def render(
    colour: torch.Tensor, shape: torch.Tensor, position: torch.Tensor, jitter: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw shapes: indices into ``COLOURS``/``SHAPES``/``POSITIONS`` and ``jitter`` (B, 4) in [0, 1).

    ``jitter`` columns: x offset, y offset, size, background brightness. Returns ``(images, masks)``,
    images (B, 3, 32, 32) in [-1, 1] and masks (B, 1, 32, 32) with 1 inside the shape.
    """
    b = colour.shape[0]
    centres = torch.tensor(list(POSITIONS.values()))[position]  # (B, 2)
    cx = centres[:, 0] + (jitter[:, 0] - 0.5) * 4.0
    cy = centres[:, 1] + (jitter[:, 1] - 0.5) * 4.0
    r = 5.0 + 2.0 * jitter[:, 2]
    coords = torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5
    dy = coords.view(1, -1, 1) - cy.view(-1, 1, 1)
    dx = coords.view(1, 1, -1) - cx.view(-1, 1, 1)
    rr = r.view(-1, 1, 1)
    masks = torch.stack(
        [
            dx**2 + dy**2 <= rr**2,  # circle
            torch.maximum(dx.abs(), dy.abs()) <= 0.85 * rr,  # square
            (dy.abs() <= rr) & (dx.abs() <= (dy + rr) / 2),  # triangle, apex up
            dx.abs() + dy.abs() <= 1.2 * rr,  # diamond
        ],
        dim=1,
    )  # (B, 4, H, W)
    mask = masks[torch.arange(b), shape].unsqueeze(1).float()
    rgb = torch.tensor(list(COLOURS.values()))[colour].view(b, 3, 1, 1) * 2 - 1
    background = (-0.7 + 0.3 * jitter[:, 3]).view(b, 1, 1, 1)
    images = background * (1 - mask) + rgb * mask
    return images, mask


class NoiseSchedule:
    """A DDPM-style noise schedule (cosine ``alpha_bar``) with ``num_steps`` timesteps.

    Args:
        num_steps: number of diffusion timesteps.

    Example:
        >>> s = NoiseSchedule(100)
        >>> x0, noise = torch.zeros(2, 3, 4, 4), torch.ones(2, 3, 4, 4)
        >>> s.add_noise(x0, noise, torch.tensor([0, 99])).shape
        torch.Size([2, 3, 4, 4])
    """

    def __init__(self, num_steps: int = 100) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
            raise ValueError(f"`num_steps` must be an int >= 2, got {num_steps!r}")
        self.num_steps = num_steps
        s = 0.008
        t = torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
        f = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
        betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        self.alphas_cumprod = torch.cumprod(1 - betas, 0).float()

    def _abar(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.alphas_cumprod.to(like.device)[t.to(like.device)].view(-1, 1, 1, 1).to(like.dtype)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``sqrt(abar_t) * x0 + sqrt(1 - abar_t) * noise``."""
        a = self._abar(t, x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def predict_x0(self, x_t: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean image implied by a noise prediction ``eps`` at timestep ``t``, clamped to [-1, 1]."""
        a = self._abar(t, x_t)
        return ((x_t - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)

    @torch.no_grad()
    def sample(
        self,
        eps_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shape: Sequence[int],
        generator: torch.Generator,
        steps: int = 20,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Deterministic DDIM sampling from noise: ``eps_fn(x_t, t)`` predicts the noise."""
        x = torch.randn(*shape, generator=generator).to(device)
        ts = torch.linspace(self.num_steps - 1, 0, steps).round().long().tolist()
        for k, t in enumerate(ts):
            tt = torch.full((shape[0],), t, dtype=torch.long, device=x.device)
            eps = eps_fn(x, tt).float()
            x0 = self.predict_x0(x, eps, tt)
            if k + 1 == len(ts):
                return x0
            a_prev = float(self.alphas_cumprod[ts[k + 1]])
            x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
        return x


SCHEDULE = NoiseSchedule(100)


def make_batch(
    batch_size: int,
    generator: torch.Generator,
    *,
    device: torch.device | str | None = None,
    schedule: NoiseSchedule | None = None,
) -> dict[str, Any]:
    """A batch of captioned shape images with masks and noise, deterministic for the generator's state.

    Args:
        batch_size: number of samples.
        generator: a CPU ``torch.Generator`` (all sampling happens on CPU; tensors are then moved).
        device: where the tensors go.
        schedule: the noise schedule (``SCHEDULE`` by default).

    Returns:
        ``dict(tokens, images, masks, captions, timesteps, noise, noisy)``; see the module docstring.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
    schedule = schedule or SCHEDULE
    colour = torch.randint(len(COLOURS), (batch_size,), generator=generator)
    shape = torch.randint(len(SHAPES), (batch_size,), generator=generator)
    position = torch.randint(len(POSITIONS), (batch_size,), generator=generator)
    jitter = torch.rand(batch_size, 4, generator=generator)
    images, masks = render(colour, shape, position, jitter)
    colours, positions = list(COLOURS), list(POSITIONS)
    captions = [
        f"{colours[c]} {SHAPES[s]} {positions[p]}"
        for c, s, p in zip(colour.tolist(), shape.tolist(), position.tolist())
    ]
    timesteps = torch.randint(schedule.num_steps, (batch_size,), generator=generator)
    noise = torch.randn(images.shape, generator=generator)
    noisy = schedule.add_noise(images, noise, timesteps)
    out: dict[str, Any] = {
        "tokens": tokenize(captions),
        "images": images,
        "masks": masks,
        "timesteps": timesteps,
        "noise": noise,
        "noisy": noisy,
    }
    out = {k: v.to(device) for k, v in out.items()}
    out["captions"] = captions
    return out


# ---------------------------------------------------------------------------------------------- models


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
        self, dim: int = 64, layers: int = 2, heads: int = 4, vocab_size: int = len(VOCAB), max_tokens: int = 4
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
    loss = F.mse_loss(pred.float(), batch["noise"], reduction="none")
    return loss.mean(), (loss * batch["masks"]).mean()


def forward_losses(tenc: nn.Module, unet: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of both models: ``(loss_tenc, loss_unet)``, see :func:`route_losses`."""
    hidden = tenc(batch["tokens"])
    return route_losses(unet(batch["noisy"], batch["timesteps"], hidden), batch)
