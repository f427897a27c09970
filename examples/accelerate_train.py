"""HF Accelerate: ``accelerator.prepare`` both networks and optimizers; the router does backward and step.

The job is the seed's in miniature: an encoder feeds a head, ``loss = mse(head(encoder(x)), y,
reduction="none")``, the encoder is trained on ``loss.mean()`` and the head on ``(loss * mask).mean()``.

Accelerate's optimizer wrapper (``AcceleratedOptimizer.step``) calls ``scaler.step(opt)`` *and*
``scaler.update()`` for every optimizer, so with two optimizers the loss scale is updated twice per iteration
(PyTorch's AMP notes: once per iteration, after every optimizer has stepped), and the second optimizer's
inf check runs against a scale the first one already changed. So:

* the models, optimizers and data loader go through ``accelerator.prepare`` as usual (device placement,
  autocast of the forward for ``--mixed-precision``, the ``GradScaler`` for fp16 in ``accelerator.scaler``);
* the router's groups get the *underlying* optimizers (``prepared_opt.optimizer``) and the router gets
  ``accelerator.scaler``: ``router.step()`` unscales each optimizer once, clips per network, ``scaler.step``
  per optimizer and ONE ``scaler.update()``;
* ``router.backward`` replaces ``accelerator.backward`` (it scales the losses itself), ``Router(accumulate=N)``
  replaces ``accelerator.accumulate`` and ``gradient_accumulation_steps``, ``Group(max_grad_norm=...)``
  replaces ``accelerator.clip_grad_norm_`` (which unscales every optimizer, not just the clipped one).

Checkpoints keep working: ``accelerator.save_state`` saves the same optimizers and scaler; save
``router.state_dict()`` too for the accumulation counter.

Accelerate makes no GradScaler on CPU (fp16 autocast is a CUDA feature there); ``--grad-scaler`` gives the
router a ``torch.amp.GradScaler`` anyway, so the AMP step path runs on CPU as well (the tests use it). This
example is tested in a single process only; with several processes Accelerate wraps the networks in DDP, and
what the router does under DDP (``tests/distributed``) applies, untested here through Accelerate.

Run::

    python examples/accelerate_train.py                           # CPU or one GPU
    python examples/accelerate_train.py --mixed-precision fp16    # CUDA: accelerator.scaler drives the router
    accelerate launch examples/accelerate_train.py --mixed-precision bf16
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
    opt_encoder: Any,
    opt_head: Any,
    scaler: Any,
    *,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
) -> gradroute.Router:
    """The router over Accelerate-prepared optimizers: their underlying optimizers, one scaler.

    ``AcceleratedOptimizer.step`` would ``scaler.update()`` per optimizer; the router steps the optimizers it
    wraps (``.optimizer``) itself and updates the scaler once.
    """

    def plain(opt: Any) -> torch.optim.Optimizer:
        return getattr(opt, "optimizer", opt)  # AcceleratedOptimizer -> the torch optimizer inside

    return gradroute.Router(
        encoder=gradroute.Group(encoder, optimizer=plain(opt_encoder), max_grad_norm=max_grad_norm),
        head=gradroute.Group(head, optimizer=plain(opt_head), max_grad_norm=max_grad_norm),
        scaler=scaler,
        accumulate=accumulate,
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
    """Up to ``max_steps`` optimizer steps (each of ``router``'s ``accumulate`` micro-batches).

    Returns the stats of every real step.
    """
    history: list[gradroute.StepStats] = []
    while True:
        for batch in loader:
            with accelerator.autocast():
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
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step (router)")
    p.add_argument("--lr-encoder", type=float, default=1e-3)
    p.add_argument("--lr-head", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default="no")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is there")
    p.add_argument(
        "--grad-scaler",
        action="store_true",
        help="give the router a torch.amp.GradScaler when Accelerate makes none (e.g. on CPU)",
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
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=args.cpu)
    set_seed(args.seed)
    encoder, head = make_models()
    opt_encoder = torch.optim.AdamW(encoder.parameters(), lr=args.lr_encoder)
    opt_head = torch.optim.AdamW(head.parameters(), lr=args.lr_head)
    loader = torch.utils.data.DataLoader(make_dataset(seed=args.seed), batch_size=args.batch_size, shuffle=True)
    encoder, head, opt_encoder, opt_head, loader = accelerator.prepare(encoder, head, opt_encoder, opt_head, loader)

    scaler = accelerator.scaler  # a GradScaler for fp16 on CUDA, else None
    if scaler is None and args.grad_scaler:
        scaler = torch.amp.GradScaler(accelerator.device.type)
    router = build_router(
        encoder,
        head,
        opt_encoder,
        opt_head,
        scaler,
        accumulate=args.accumulate,
        max_grad_norm=args.max_grad_norm,
    )
    history = train(accelerator, router, encoder, head, loader, max_steps=args.max_steps)
    accelerator.print(
        f"{len(history)} steps on {accelerator.device} (mixed precision {accelerator.mixed_precision}, "
        f"scaler {'yes' if scaler is not None else 'no'}, accumulate {args.accumulate})"
    )
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
