"""demo.png: the loss curve of each route, and denoised samples with the mask outlined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..common import pyplot
from ..data import make_batch
from ..noise import NoiseSchedule

N_SAMPLES = 4
_LABELS = {"tenc": "loss_tenc = loss.mean() -> text encoder", "unet": "loss_unet = (loss*mask).mean() -> UNet"}


@torch.no_grad()
def plot(
    path: Path, log: list[dict[str, Any]], tenc: Any, unet: Any, schedule: NoiseSchedule, seed: int, dev: Any
) -> None:
    """Write demo.png: the per-step losses of both routes (log scale, smoothed) above four held-out samples:
    clean with the mask, noised, denoised in one step, and sampled with DDIM from noise."""
    plt = pyplot()
    rows = _sample_rows(tenc, unet, schedule, seed, dev)
    fig = plt.figure(figsize=(8, 10.5))
    grid = fig.add_gridspec(5, N_SAMPLES, height_ratios=[1.6, 1, 1, 1, 1])
    _loss_curves(fig.add_subplot(grid[0, :]), log)
    masks, captions = rows.pop("masks"), rows.pop("captions")
    for i, (title, imgs) in enumerate(rows.items()):
        for j in range(N_SAMPLES):
            a = fig.add_subplot(grid[i + 1, j])
            a.imshow(_show(imgs[j]), interpolation="nearest")
            if i != 1:
                a.contour(masks[j, 0].cpu().numpy(), levels=[0.5], colors="white", linewidths=0.8)
            a.set_xticks([])
            a.set_yticks([])
            if j == 0:
                a.set_ylabel(title, fontsize=8)
            if i == 0:
                a.set_title(captions[j], fontsize=9)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.text(
        0.5,
        0.005,
        "The UNet is trained on the masked loss only: it learns to denoise the shapes (outlined), not the background.",
        ha="center",
        fontsize=8,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sample_rows(tenc: Any, unet: Any, schedule: NoiseSchedule, seed: int, dev: Any) -> dict[str, Any]:
    """Held-out pictures, noised at 60% of the schedule, denoised in one step, and sampled (eval mode)."""
    tenc.eval()
    unet.eval()
    batch = make_batch(N_SAMPLES, torch.Generator().manual_seed(seed + 104729), device=dev)
    t_mid = torch.full((N_SAMPLES,), int(schedule.num_steps * 0.6), dtype=torch.long, device=dev)
    noisy = schedule.add_noise(batch["images"], batch["noise"], t_mid)
    ctx = tenc(batch["tokens"])
    one_step = schedule.predict_x0(noisy, unet(noisy, t_mid, ctx).float(), t_mid)
    sampled = schedule.sample(
        lambda x, t: unet(x, t, ctx), batch["images"].shape, torch.Generator().manual_seed(seed), device=dev
    )
    tenc.train()
    unet.train()
    return {
        "clean + mask": batch["images"],
        f"noised t={int(t_mid[0])}": noisy,
        "denoised, 1 step": one_step,
        "sampled, DDIM 20": sampled,
        "masks": batch["masks"],
        "captions": batch["captions"],
    }


def _loss_curves(ax: Any, log: list[dict[str, Any]]) -> None:
    steps = [r["step"] for r in log]
    for name, colour in (("tenc", "tab:blue"), ("unet", "tab:orange")):
        ys = [r[f"loss_{name}"] for r in log]
        ax.plot(steps, ys, color=colour, alpha=0.3, lw=0.8)
        window = max(1, len(ys) // 20)
        smooth = [
            sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))
        ]
        ax.plot(steps, smooth, color=colour, lw=1.8, label=_LABELS[name])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log)")
    ax.legend(loc="upper right")
    ax.set_title("routed losses from one forward (gradroute.Router)")


def _show(img: torch.Tensor) -> Any:
    return ((img.float().cpu().clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()
