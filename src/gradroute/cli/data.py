"""The demo's data: captioned pictures of coloured shapes with their masks and noise, pure torch.

A caption such as "red circle top left" names a colour, a shape and a position; ``make_batch`` draws the
pictures (32x32, in [-1, 1]), the masks of the shapes' regions, and the noise and timesteps of the denoising
loss (``gradroute.cli.noise``).

Example:
    >>> import torch
    >>> batch = make_batch(2, torch.Generator().manual_seed(0))
    >>> batch["images"].shape, batch["masks"].shape, batch["tokens"].shape
    (torch.Size([2, 3, 32, 32]), torch.Size([2, 1, 32, 32]), torch.Size([2, 4]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .noise import SCHEDULE, NoiseSchedule

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
        ``dict(tokens, images, masks, captions, timesteps, noise, noisy)``: ``tokens`` (B, MAX_TOKENS) int64,
        ``images`` (B, 3, 32, 32) in [-1, 1], ``masks`` (B, 1, 32, 32) float 0/1, ``captions`` (list of str),
        ``timesteps`` (B,) int64, ``noise`` (B, 3, 32, 32) and ``noisy`` (the images noised at ``timesteps``).
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
