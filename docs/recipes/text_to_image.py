"""diffusers' text-to-image fine-tuning with ``--train_text_encoder``, routed: lines marked ``# gradroute`` changed.

The structure is that of diffusers' ``examples/text_to_image`` scripts that train the text encoder too (one
optimizer, the text encoder's parameters in a parameter group of their own with ``--text_encoder_lr``,
``accelerator.accumulate``, ``accelerator.clip_grad_norm_`` over both networks, a prepared scheduler); the
models and data are the stand-ins of ``tiny.py``. Each example carries a 0/1 mask: the UNet learns the masked
region only, the text encoder the whole image.

Run::

    python docs/recipes/text_to_image.py --train_text_encoder --gradient_accumulation_steps 2 --mixed_precision bf16
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import tiny
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers.optimization import get_scheduler

import gradroute  # gradroute


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train_text_encoder", action="store_true")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default=None)
    p.add_argument("--train_batch_size", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--text_encoder_lr", type=float, default=1e-4)
    p.add_argument("--lr_scheduler", default="cosine")
    p.add_argument("--lr_warmup_steps", type=int, default=1)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def compute_losses(
    text_encoder: Any, unet: Any, noise_scheduler: Any, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_tenc, loss_unet)`` from one forward."""
    latents, noise, timesteps = batch["model_input"], batch["noise"], batch["timesteps"]
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
    loss = F.mse_loss(model_pred.float(), noise.float(), reduction="none")  # gradroute: was reduction="mean"
    return loss.mean(), (loss * batch["mask"]).mean()  # gradroute: the loss of each network


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision
    )
    set_seed(args.seed)
    text_encoder, unet, noise_scheduler = tiny.models(args.seed)  # from_pretrained(...) in the real script
    text_encoder.requires_grad_(args.train_text_encoder)
    if args.gradient_checkpointing:
        gradroute.enable_checkpointing(unet)  # gradroute: was unet.enable_gradient_checkpointing()
        if args.train_text_encoder:
            gradroute.enable_checkpointing(text_encoder)  # gradroute: was text_encoder.gradient_checkpointing_enable()
    params_to_optimize = [{"params": list(unet.parameters()), "lr": args.learning_rate}]
    if args.train_text_encoder:
        params_to_optimize.append({"params": list(text_encoder.parameters()), "lr": args.text_encoder_lr})
    optimizer = torch.optim.AdamW(params_to_optimize)
    train_dataloader = torch.utils.data.DataLoader(tiny.dataset(), batch_size=args.train_batch_size, shuffle=False)
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    unet, text_encoder, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        unet, text_encoder, optimizer, train_dataloader, lr_scheduler
    )
    if args.train_text_encoder:
        router = gradroute.Router(tenc=text_encoder, unet=unet, accelerator=accelerator)  # gradroute
    models = [unet, text_encoder] if args.train_text_encoder else [unet]

    global_step = 0
    while global_step < args.max_train_steps:
        for batch in train_dataloader:
            with accelerator.accumulate(*models):
                loss_tenc, loss_unet = compute_losses(text_encoder, unet, noise_scheduler, batch)
                if args.train_text_encoder:
                    router.backward(tenc=loss_tenc, unet=loss_unet)  # gradroute: was accelerator.backward(loss)
                else:
                    accelerator.backward(loss_unet)
                if accelerator.sync_gradients:
                    params_to_clip = itertools.chain(*(m.parameters() for m in models))
                    accelerator.clip_grad_norm_(params_to_clip, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                global_step += 1
                accelerator.print(f"step {global_step}: unet loss {loss_unet.item():.4f}")
            if global_step >= args.max_train_steps:
                break
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
