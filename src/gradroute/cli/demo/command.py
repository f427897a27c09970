"""``gradroute demo``: a text encoder and a conditional UNet trained from one forward, each on its own loss.

The scenario (models and data in ``gradroute.cli.models`` and ``gradroute.cli.data``): a text encoder reads
captions such as "red circle top left"; a UNet, cross-attending to the text, predicts the noise added to 32x32
pictures of that caption.
``loss = mse(pred, noise, reduction="none")``; the text encoder is trained on ``loss.mean()`` and the UNet on
``(loss * mask).mean()`` (the shape's region only), routed by :class:`gradroute.Router` from ONE forward.

Each group has its own AdamW, ``warmup_power`` scheduler and gradient clipping, with the fine-tuning
settings of docs/training_step.md (text encoder lr 1e-7 and weight decay 1e-3, UNet lr 1e-6 and weight decay
1e-2, betas (0.9, 0.99), eps 1e-7, 30 warmup steps, decay exponent 5, clipping at 1.0) except for the learning
rates, scaled up 2000 times (text encoder 2e-4, UNet 2e-3; still ten times apart) because those settings
fine-tune pretrained networks for thousands of steps and the demo trains from scratch in about a minute; the
warmup is 10% of the steps (30 for the default 300). Precision: fp16 autocast with a ``GradScaler`` on CUDA,
fp32 on CPU (``--dtype bf16`` for bf16 autocast).

At step 0 the plan is printed and the routed gradients are compared with an independent reference (a fresh
forward per loss and ``torch.autograd.grad``); the demo fails (exit code 1) if they differ. At the end it
writes ``DIR/demo.json`` (settings, plan, the check, a per-step log, held-out losses before and after) and
``DIR/demo.png`` (loss curves per route, and denoised samples with the mask outlined).

Everything that prints or writes is behind ``is_main`` (rank 0 in a distributed run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gradroute
from gradroute.schedules import warmup_power

from ..common import autocast, has_matplotlib, progress_bar, resolve_device, resolve_dtype
from ..data import make_batch
from ..models import forward_losses, make_models
from ..noise import SCHEDULE
from .check import check, reference
from .distributed import init_distributed, shard, wrap_ddp
from .plot import plot

#: The hyper-parameters of the demo (see the module docstring).
HYPER: dict[str, Any] = {
    "tenc": {"lr": 2e-4, "weight_decay": 1e-3, "max_grad_norm": 1.0},
    "unet": {"lr": 2e-3, "weight_decay": 1e-2, "max_grad_norm": 1.0},
    "betas": (0.9, 0.99),
    "eps": 1e-7,
    "warmup_fraction": 0.1,
    "exponent": 5.0,
}


def run(args: argparse.Namespace, *, is_main: bool = True) -> int:
    """``gradroute demo``; see ``gradroute demo --help``. Returns the exit code."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"`{flag}` must be >= 1, got {value}")
    dev = resolve_device(args.device)
    rank, world, dev = init_distributed(dev, args.batch_size)  # under torchrun: one process per rank
    is_main = is_main and rank == 0
    dtype = resolve_dtype(args.dtype, dev, cuda_default="fp16")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"`--out` must be a directory, got the file {str(out)!r}")

    torch.manual_seed(args.seed)
    tenc, unet = make_models(seed=args.seed, width=args.width)
    tenc.to(dev)
    unet.to(dev)
    where = _Where(dev, dtype, rank, world, is_main)
    train = wrap_ddp(tenc, unet, dev, world)  # the modules themselves unless distributed
    warmup = max(1, round(HYPER["warmup_fraction"] * args.steps))
    router, scaler = _router(tenc, unet, args.steps, warmup, dtype)
    held_out = make_batch(64, torch.Generator().manual_seed(args.seed + 7919), device=dev)
    before = _held_out_losses(tenc, unet, held_out, dev, dtype)
    trained = _train(args, router, scaler, (tenc, unet), train, where)
    if trained is None:
        return 1
    after = _held_out_losses(tenc, unet, held_out, dev, dtype)
    if not is_main:
        return 0
    plan, step0, log = trained
    print(
        f"held-out loss, before -> after: tenc {before['tenc']:.4f} -> {after['tenc']:.4f}, "
        f"unet {before['unet']:.4f} -> {after['unet']:.4f}"
    )
    settings = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "width": args.width,
        "warmup_steps": warmup,
        "world_size": world,
    }
    report = {
        "gradroute": gradroute.__version__,
        "torch": torch.__version__,
        "device": str(dev),
        "dtype": dtype,
        "settings": settings,
        "hyper": HYPER,
        "plan": plan,
        "check": step0,
        "held_out": {"before": before, "after": after},
        "log": log,
    }
    _write(out, report, tenc, unet, args.seed, dev)
    return 0


@dataclass(frozen=True)
class _Where:
    """Where the demo runs: device, precision, and this process's place in a distributed run."""

    dev: torch.device
    dtype: str
    rank: int
    world: int
    is_main: bool


def _router(
    tenc: torch.nn.Module, unet: torch.nn.Module, steps: int, warmup: int, dtype: str
) -> tuple[gradroute.Router, torch.amp.GradScaler | None]:
    """The two groups, each with its AdamW, ``warmup_power`` scheduler and clipping (``HYPER``), and a
    ``GradScaler`` for fp16."""

    def group(name: str, module: torch.nn.Module) -> gradroute.Group:
        h = HYPER[name]
        opt = torch.optim.AdamW(
            module.parameters(), lr=h["lr"], weight_decay=h["weight_decay"], betas=HYPER["betas"], eps=HYPER["eps"]
        )
        sched = warmup_power(opt, warmup, HYPER["exponent"], max(steps, warmup))
        return gradroute.Group(module, optimizer=opt, scheduler=sched, max_grad_norm=h["max_grad_norm"])

    scaler = torch.amp.GradScaler("cuda") if dtype == "fp16" else None
    return gradroute.Router(tenc=group("tenc", tenc), unet=group("unet", unet), scaler=scaler), scaler


@contextlib.contextmanager
def _no_mha_fastpath() -> Iterator[None]:
    """``nn.TransformerEncoderLayer``'s fused inference path off: torch 2.5's ignores CPU autocast (it fails with
    "mat1 and mat2 must have the same dtype")."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _held_out_losses(
    tenc: torch.nn.Module, unet: torch.nn.Module, batch: dict[str, Any], dev: torch.device, dtype: str
) -> dict[str, float]:
    """Both losses on the held-out batch, in eval mode, without grad."""
    tenc.eval()
    unet.eval()
    with torch.no_grad(), autocast(dev, dtype), _no_mha_fastpath():
        lt, lu = forward_losses(tenc, unet, batch)
    tenc.train()
    unet.train()
    return {"tenc": float(lt), "unet": float(lu)}


def _train(
    args: argparse.Namespace,
    router: gradroute.Router,
    scaler: torch.amp.GradScaler | None,
    models: tuple[torch.nn.Module, torch.nn.Module],
    train: tuple[Any, Any],
    where: _Where,
) -> tuple[str, dict[str, Any], list[dict[str, Any]]] | None:
    """The training loop: ``(plan, step-0 check, per-step log)``, or None when the step-0 check fails.

    ``train`` are the modules the forward runs through (``models`` themselves, or their DDP wrappers).
    """
    (tenc, unet), dev, dtype = models, where.dev, where.dtype
    gen = torch.Generator().manual_seed(args.seed)
    log: list[dict[str, Any]] = []
    plan, step0 = "", {}
    progress = progress_bar(args.steps, "demo", enabled=where.is_main)
    for k in range(args.steps):
        batch = make_batch(args.batch_size, gen, device=dev)
        t0 = time.perf_counter()
        with autocast(dev, dtype):
            loss_tenc, loss_unet = forward_losses(*train, shard(batch, where.rank, where.world))
        if k == 0:
            plan = str(router.plan(tenc=loss_tenc, unet=loss_unet))
            if where.is_main:
                print(plan, end="\n\n", flush=True)
            ref = reference(tenc, unet, batch, dev, dtype, scaler)
        router.backward(tenc=loss_tenc, unet=loss_unet)
        if k == 0:
            step0 = check(router, ref, scaler, dtype)
            del ref
            if not _report_check(step0, where.is_main):
                progress.close()
                return None
        stats = router.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        row = _log_row(k, (time.perf_counter() - t0) * 1000, stats)
        log.append(row)
        progress.set_postfix_str(
            f"loss tenc {row['loss_tenc']:.4f} unet {row['loss_unet']:.4f} | "
            f"lr {row['lr_tenc']:.1e}/{row['lr_unet']:.1e} | {row['ms']:.0f} ms/step",
            refresh=False,
        )
        progress.update()
    progress.close()
    return plan, step0, log


def _report_check(step0: dict[str, Any], is_main: bool) -> bool:
    """Print the step-0 check (on the main rank); whether it passed."""
    if is_main:
        verdict = "ok" if step0["passed"] else "FAILED"
        print(
            f"step 0 check against independent forwards: max relative error "
            f"{step0['max_rel_err']:.2e} (tenc {step0['tenc']:.2e}, unet {step0['unet']:.2e}; "
            f"tolerance {step0['tolerance']:.0e}) {verdict}",
            flush=True,
        )
        if not step0["passed"]:
            print("gradroute demo: routed gradients differ from the reference", file=sys.stderr)
    return bool(step0["passed"])


def _log_row(k: int, ms: float, stats: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"step": k, "ms": ms}
    for name in ("tenc", "unet"):
        for key in ("loss", "grad_norm", "lr", "skipped"):
            row[f"{key}_{name}"] = _stat(stats, name, key)
    return row


def _stat(stats: Any, name: str, key: str) -> Any:
    s = stats.get(name) if hasattr(stats, "get") else None
    if s is None:
        return None
    return s.get(key) if isinstance(s, dict) else getattr(s, key, None)


def _write(out: Path, report: dict[str, Any], tenc: Any, unet: Any, seed: int, dev: torch.device) -> None:
    """DIR/demo.json, and DIR/demo.png when matplotlib is installed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    written = [str(out / "demo.json")]
    if has_matplotlib():
        plot(out / "demo.png", report["log"], tenc, unet, SCHEDULE, seed, dev)
        written.append(str(out / "demo.png"))
    else:
        print("gradroute demo: matplotlib is not installed: demo.png skipped", file=sys.stderr)
    print(f"wrote {', '.join(written)}")
