"""HF Accelerate: two networks with an optimizer and a scheduler each, all prepared; ``Router(accelerator=)``.

The job is the seed's in miniature: an encoder feeds a head, ``loss = mse(head(encoder(x)), y,
reduction="none")``, the encoder is trained on ``loss.mean()`` and the head on ``(loss * mask).mean()``.

Everything goes through ``accelerator.prepare`` as usual (models, optimizers, schedulers, data loader), and the
groups take the prepared optimizers and schedulers. ``Router(..., accelerator=accelerator)`` then follows
Accelerate's rules: ``router.backward`` divides each loss by ``gradient_accumulation_steps`` and scales it with
``accelerator.scaler`` (fp16), as ``accelerator.backward`` would; ``accelerator.accumulate(...)`` decides when DDP
all-reduces and when ``router.step()`` really steps (``sync_gradients``); each scheduler steps as Accelerate's
wrapper steps it (once per process and real step: size schedules ``* accelerator.num_processes``, as diffusers
does). What the router does differently: ``AcceleratedOptimizer.step`` would call ``scaler.update()`` once per
optimizer (twice per iteration here; PyTorch's AMP notes: once per iteration, after every optimizer stepped),
so ``router.step()`` steps the torch optimizers inside, unscales each once, clips per network
(``Group(max_grad_norm=...)``) and updates the scale once.

Checkpoints: ``accelerator.save_state`` saves the optimizers, schedulers and scaler; save
``router.state_dict()`` too if you resume inside an accumulation window.

Accelerate makes a GradScaler for fp16 on GPUs only; ``--grad-scaler`` gives the accelerator a CPU one before
``prepare`` so the AMP path runs on the CPU as well (the tests use it). A script with ONE optimizer over both
networks needs only ``router.backward`` in place of ``accelerator.backward``: see docs/integrations.md.

Run::

    python examples/accelerate_train.py                           # CPU or one GPU
    python examples/accelerate_train.py --mixed-precision fp16    # CUDA: accelerator.scaler scales the losses
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradroute
from gradroute.schedules import warmup_power


def make_models(dim: int = 16, hidden: int = 64) -> tuple[nn.Module, nn.Module]:
    """``(encoder, head)``, small MLPs."""
    encoder = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
    head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, dim))
    return encoder, head


def make_dataset(n: int = 256, dim: int = 16, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Inputs, targets (a fixed nonlinear map of the inputs) and a random 0/1 mask per element."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    w = torch.randn(dim, dim, generator=gen) / dim**0.5
    y = torch.sin(x @ w)
    mask = (torch.rand(n, dim, generator=gen) > 0.5).float()
    return torch.utils.data.TensorDataset(x, y, mask)


def losses(encoder: nn.Module, head: nn.Module, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_encoder, loss_head)`` from one forward: unmasked and masked mean squared error."""
    x, y, mask = batch
    loss = F.mse_loss(head(encoder(x)).float(), y.float(), reduction="none")
    return loss.mean(), (loss * mask).mean()


def build_router(
    encoder: nn.Module,
    head: nn.Module,
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    accelerator: Any,
    *,
    max_grad_norm: float | None = None,
) -> gradroute.Router:
    """The router over the prepared optimizers and schedulers; scaling and accumulation come from ``accelerator``."""
    (opt_encoder, opt_head), (sched_encoder, sched_head) = optimizers, schedulers
    return gradroute.Router(
        encoder=gradroute.Group(encoder, optimizer=opt_encoder, scheduler=sched_encoder, max_grad_norm=max_grad_norm),
        head=gradroute.Group(head, optimizer=opt_head, scheduler=sched_head, max_grad_norm=max_grad_norm),
        accelerator=accelerator,
    )


def train(
    accelerator: Any,
    router: gradroute.Router,
    encoder: nn.Module,
    head: nn.Module,
    loader: Any,
    *,
    max_steps: int,
    log: bool = True,
) -> list[gradroute.StepStats]:
    """Up to ``max_steps`` optimizer steps (each of ``gradient_accumulation_steps`` micro-batches).

    Returns the stats of every real step.
    """
    history: list[gradroute.StepStats] = []
    while True:
        for batch in loader:
            with accelerator.accumulate(encoder, head):
                loss_encoder, loss_head = losses(encoder, head, batch)
                router.backward(encoder=loss_encoder, head=loss_head)
                stats = router.step()
            if stats.accumulating:
                continue
            history.append(stats)
            if log and accelerator.is_main_process:
                scale = f"  scale {stats.scale:g}" if stats.scale is not None else ""
                print(
                    f"step {stats.step:4d}  encoder loss {stats['encoder'].loss:.4f}  "
                    f"head loss {stats['head'].loss:.4f}{scale}",
                    flush=True,
                )
            if len(history) == max_steps:
                return history


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps of the Accelerator")
    p.add_argument("--lr-encoder", type=float, default=1e-3)
    p.add_argument("--lr-head", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default="no")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is there")
    p.add_argument(
        "--grad-scaler",
        action="store_true",
        help="give the accelerator a torch.amp.GradScaler when it makes none (e.g. on the CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("max_steps", "batch_size", "accumulate"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    args = parse_args(argv)
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision, cpu=args.cpu, gradient_accumulation_steps=args.accumulate
    )
    if accelerator.scaler is None and args.grad_scaler:
        accelerator.scaler = torch.amp.GradScaler(accelerator.device.type)  # before prepare: the optimizers take it
    set_seed(args.seed)
    encoder, head = make_models()
    optimizers = [
        torch.optim.AdamW(encoder.parameters(), lr=args.lr_encoder),
        torch.optim.AdamW(head.parameters(), lr=args.lr_head),
    ]
    total = args.max_steps * accelerator.num_processes  # Accelerate steps a prepared scheduler once per process
    schedulers = [warmup_power(opt, total // 4, 2, total_steps=total) for opt in optimizers]
    loader = torch.utils.data.DataLoader(make_dataset(seed=args.seed), batch_size=args.batch_size, shuffle=True)
    encoder, head, *prepared, loader = accelerator.prepare(encoder, head, *optimizers, *schedulers, loader)
    router = build_router(encoder, head, prepared[:2], prepared[2:], accelerator, max_grad_norm=args.max_grad_norm)
    history = train(accelerator, router, encoder, head, loader, max_steps=args.max_steps)
    accelerator.print(
        f"{len(history)} steps on {accelerator.device} (mixed precision {accelerator.mixed_precision}, "
        f"scaler {'yes' if accelerator.scaler is not None else 'no'}, accumulate {args.accumulate}, "
        f"{accelerator.num_processes} process(es))"
    )
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
