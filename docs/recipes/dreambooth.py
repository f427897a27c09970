"""diffusers' DreamBooth with ``--train_text_encoder``, routed: the lines marked ``# gradroute`` are the change.

The structure is that of diffusers' ``examples/dreambooth/train_dreambooth.py`` (one optimizer over both
networks, a prepared scheduler sized ``* accelerator.num_processes``, ``accelerator.accumulate(unet)``,
``accelerator.clip_grad_norm_`` when ``sync_gradients``); the models and data are the stand-ins of ``tiny.py``.
With ``--with_prior_preservation`` the text encoder learns from the instance images only and the UNet from the
instance and class (prior) images: ``loss_tenc`` and ``loss_unet`` below. The script's own ``loss`` is that
sum, as in diffusers; ``accelerator.backward(loss)`` would train the text encoder on the prior loss too.

Run (CPU, or as ``accelerate launch`` allots)::

    python docs/recipes/dreambooth.py --train_text_encoder --with_prior_preservation --gradient_accumulation_steps 2
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 docs/recipes/dreambooth.py \
        --train_text_encoder --with_prior_preservation --gradient_checkpointing
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
    p.add_argument("--with_prior_preservation", action="store_true")
    p.add_argument("--prior_loss_weight", type=float, default=1.0)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--mixed_precision", choices=("no", "fp16", "bf16"), default=None)
    p.add_argument("--train_batch_size", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--lr_scheduler", default="constant")
    p.add_argument("--lr_warmup_steps", type=int, default=0)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def encode_prompt(text_encoder: Any, input_ids: torch.Tensor) -> torch.Tensor:
    return text_encoder(input_ids, return_dict=False)[0]


def compute_losses(
    text_encoder: Any, unet: Any, noise_scheduler: Any, batch: dict[str, torch.Tensor], args: argparse.Namespace
) -> tuple[torch.Tensor, torch.Tensor]:
    """The script's loss, split by network: ``(loss_tenc, loss_unet)``."""
    model_input, noise, timesteps = batch["model_input"], batch["noise"], batch["timesteps"]
    noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)
    encoder_hidden_states = encode_prompt(text_encoder, batch["input_ids"])
    model_pred = unet(noisy_model_input, timesteps, encoder_hidden_states, return_dict=False)[0]
    target = noise  # prediction_type "epsilon"
    if args.with_prior_preservation:
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    loss_tenc = loss  # gradroute: the text encoder learns the instance prompt only
    if args.with_prior_preservation:
        loss = loss + args.prior_loss_weight * prior_loss
    return loss_tenc, loss  # gradroute: (loss_tenc, loss_unet)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=args.mixed_precision
    )
    set_seed(args.seed)
    text_encoder, unet, noise_scheduler = tiny.models(args.seed)  # from_pretrained(...) in the real script
    if args.gradient_checkpointing:
        gradroute.enable_checkpointing(unet)  # gradroute: was unet.enable_gradient_checkpointing()
        if args.train_text_encoder:
            gradroute.enable_checkpointing(text_encoder)  # gradroute: was text_encoder.gradient_checkpointing_enable()
    params_to_optimize = (
        itertools.chain(unet.parameters(), text_encoder.parameters()) if args.train_text_encoder else unet.parameters()
    )
    optimizer = torch.optim.AdamW(params_to_optimize, lr=args.learning_rate)
    train_dataloader = torch.utils.data.DataLoader(tiny.dataset(), batch_size=args.train_batch_size, shuffle=False)
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    if args.train_text_encoder:
        unet, text_encoder, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            unet, text_encoder, optimizer, train_dataloader, lr_scheduler
        )
        router = gradroute.Router(tenc=text_encoder, unet=unet, accelerator=accelerator)  # gradroute
    else:
        unet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
            unet, optimizer, train_dataloader, lr_scheduler
        )
        text_encoder.to(accelerator.device).requires_grad_(False)

    global_step = 0
    while global_step < args.max_train_steps:
        unet.train()
        if args.train_text_encoder:
            text_encoder.train()
        for batch in train_dataloader:
            with accelerator.accumulate(unet):
                loss_tenc, loss = compute_losses(text_encoder, unet, noise_scheduler, batch, args)
                if args.train_text_encoder:
                    router.backward(tenc=loss_tenc, unet=loss)  # gradroute: was accelerator.backward(loss)
                else:
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    params_to_clip = (
                        itertools.chain(unet.parameters(), text_encoder.parameters())
                        if args.train_text_encoder
                        else unet.parameters()
                    )
                    accelerator.clip_grad_norm_(params_to_clip, args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator.sync_gradients:
                global_step += 1
                accelerator.print(f"step {global_step}: loss {loss.item():.4f}, lr {lr_scheduler.get_last_lr()[0]:.2e}")
            if global_step >= args.max_train_steps:
                break
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
