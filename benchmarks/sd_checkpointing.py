"""Checkpointing set-ups of the tiny Stable Diffusion stack (diffusers' UNet, transformers' CLIP), in CPU time.

    python benchmarks/sd_checkpointing.py [--size 16 --batch-size 2] [--steps 30] [--processes 3]

transformers' CLIPTextModel -> diffusers' UNet2DConditionModel from small configs (no weights downloaded), both
checkpointed. Forward + backward, the variants interleaved step by step, CPU time of the calling thread, one
torch thread; ratios to ``plain``, one backward of the loss with torch's own checkpointing through both
libraries' switches (an unmodified DreamBooth script's ``accelerator.backward(loss)``):

* ``switches``: ``router.backward(tenc=loss.mean(), unet=(loss * mask).mean())`` with diffusers' switch pointed
  at ``gradroute.checkpoint`` and ``gradroute.enable_checkpointing(text_encoder)``, no cut points;
* ``by_hand``: the same plus ``gradroute.cut_points`` on the UNet blocks' layers, placed by hand;
* ``enable``: ``gradroute.enable_checkpointing`` on both models (the documented one call per model);
* ``same_loss``: ``enable``'s models, the one loss routed to both (DreamBooth without prior preservation);
* ``plain_enable``: ``enable``'s models, one plain backward of the loss (what ``same_loss`` is to cost).

``--processes N`` prints the median ratios over N processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import diffusers
import torch
import transformers
from _processes import outputs
from torch import nn

import gradroute
from gradroute.cli.workloads.sd15 import unet_cut_points

VARIANTS = ("plain", "plain_enable", "switches", "by_hand", "enable", "same_loss")


def stack(size: int, batch: int, setup: str) -> tuple[nn.Module, nn.Module, Callable[[], dict[str, torch.Tensor]]]:
    """The text encoder, the UNet and a forward giving both losses; the same weights for every ``setup``."""
    torch.manual_seed(0)
    tenc = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=99,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    unet = diffusers.UNet2DConditionModel(
        sample_size=size,
        block_out_channels=(32, 64, 64),
        layers_per_block=2,
        cross_attention_dim=64,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=32,
    )
    tenc.train()
    unet.train()
    if setup == "plain":
        unet.enable_gradient_checkpointing()  # torch's non-reentrant checkpoint
        tenc.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif setup in ("switches", "by_hand"):
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=gradroute.checkpoint)
        gradroute.enable_checkpointing(tenc)
        if setup == "by_hand":
            gradroute.cut_points(*unet_cut_points(unet))
    else:
        gradroute.enable_checkpointing(unet)
        gradroute.enable_checkpointing(tenc)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 99, (batch, 16), generator=g)
    noisy, noise = torch.randn(batch, 4, size, size, generator=g), torch.randn(batch, 4, size, size, generator=g)
    mask = (torch.rand(batch, 1, size, size, generator=g) > 0.5).float()
    timesteps = torch.tensor([10, 500] * (batch // 2) + [250] * (batch % 2))

    def forward() -> dict[str, torch.Tensor]:
        states = tenc(input_ids=tokens).last_hidden_state
        pred = unet(noisy, timesteps, encoder_hidden_states=states).sample
        loss = nn.functional.mse_loss(pred, noise, reduction="none")
        return {"loss": loss.mean(), "tenc": loss.mean(), "unet": (loss * mask).mean()}

    return tenc, unet, forward


def run_once(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(1)
    steps: dict[str, Callable[[], None]] = {}
    params: list[torch.Tensor] = []
    for name in VARIANTS:
        setup = {"plain_enable": "enable", "same_loss": "enable"}.get(name, name)
        tenc, unet, forward = stack(args.size, args.batch_size, setup)
        params += [*tenc.parameters(), *unet.parameters()]
        if name.startswith("plain"):
            steps[name] = lambda forward=forward: forward()["loss"].backward()
            continue
        router = gradroute.Router(tenc=tenc, unet=unet)
        if name == "same_loss":

            def step(router: gradroute.Router = router, forward: Callable = forward) -> None:
                loss = forward()["loss"]
                router.backward(tenc=loss, unet=loss)

        else:

            def step(router: gradroute.Router = router, forward: Callable = forward) -> None:
                losses = forward()
                router.backward(tenc=losses["tenc"], unet=losses["unet"])

        steps[name] = step
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for k in range(args.warmup + args.steps):
        order = list(VARIANTS) if k % 2 else list(VARIANTS)[::-1]
        for name in order:
            for p in params:
                p.grad = None
            t = time.thread_time()
            steps[name]()
            if k >= args.warmup:
                times[name].append(time.thread_time() - t)
    base = statistics.median(times["plain"])
    return {n: statistics.median(v) / base for n, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--processes", type=int, default=1)
    args = p.parse_args()
    if args.processes > 1:
        outs, _ = outputs(args.processes, __file__)
        runs = [dict(kv.split("=") for kv in out.split()[1:]) for out in outs]
        print(f"{args.processes} processes, size {args.size}, batch {args.batch_size}; median ratio to plain:")
        for n in VARIANTS:
            values = [float(r[n]) for r in runs]
            print(f"  {n:10s} {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})")
        return
    ratios = run_once(args)
    print("ratios " + " ".join(f"{n}={v:.3f}" for n, v in ratios.items()))


if __name__ == "__main__":
    main()
