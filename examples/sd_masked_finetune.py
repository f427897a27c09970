"""Stable Diffusion fine-tuning with a masked loss, on diffusers + transformers, routed with gradroute.

One forward per batch: ``hidden = text_encoder(ids)``, ``pred = unet(noisy_latents, t, hidden)``,
``loss = mse(pred, target, reduction="none")``. The text encoder is trained on the whole loss
(``loss.mean()``), the UNet on the masked loss (``(loss * mask).mean()``, the mask resized to the latents).
``router.backward(tenc=..., unet=...)`` gives each network exactly the gradient of its own loss, as two
independent forward/backward passes would, from the one forward and without ``retain_graph``.

Models come from a local directory with the layout of a Stable Diffusion repository, each part loaded with
``from_pretrained``: ``unet/`` (``UNet2DConditionModel``), ``text_encoder/`` (``CLIPTextModel``),
``tokenizer/`` (``CLIPTokenizer``), ``scheduler/`` (``DDPMScheduler``) and, optionally, ``vae/``
(``AutoencoderKL``, frozen). With a VAE the UNet trains on latents, as Stable Diffusion does; without one it
trains in pixel space (its ``in_channels`` must then be 3). Nothing is downloaded: pass a snapshot you have,
or write a tiny one with ``--write-tiny DIR`` (random weights, about 0.3M parameters in all, a 95-token
vocabulary and four 16x16 images), which is what the tests do.

The data directory holds ``images/``, ``masks/`` (a grayscale PNG per image, same file name and size; white =
the region the UNet is trained on) and ``captions.txt`` (one ``file_name<TAB>caption`` line per image).

Optimizers: two AdamW with the seed's settings (text encoder lr 1e-7, weight decay 1e-3; UNet lr 1e-6, weight
decay 1e-2; betas (0.9, 0.99), eps 1e-7) and a warmup-then-power schedule per optimizer. Mixed precision:
``--mixed-precision fp16`` (autocast + one GradScaler shared by both optimizers, one update per step) or
``bf16`` (autocast, no scaler). ``--gradient-checkpointing [gradroute|blocks|torch]``: ``gradroute`` (the
default when the flag has no value) points both libraries' own switches at ``gradroute.checkpoint`` and marks
the UNet blocks' layers as ``gradroute.cut_points``: each segment recomputed once per step, shared by both
passes, peak memory within 2% of one backward of the summed losses (SD-1.5 at 512 px, traced);
``blocks`` checkpoints whole UNet blocks with ``gradroute.checkpoint_modules`` instead (one shared
recomputation too, but a block is more to hold than a layer: at 512 px about 1.5× the peak); ``torch`` uses
the switches as they are (each segment recomputed by each pass);
``--lora-rank R`` trains LoRA adapters (peft) on both models instead of all weights. The trained models are
written with ``save_pretrained`` to ``--output-dir`` in the same layout (LoRA adapters are merged there, and
also saved on their own under ``lora/``).

``--check-grads`` compares the first optimizer step's routed gradients (unscaled, before clipping) with an
independent reference: a fresh forward per loss and ``torch.autograd.grad``, on the same inputs and noise. It
prints the relative error per network and exits with status 1 above ``--grad-tol``.

Try it (CPU, a few seconds)::

    python examples/sd_masked_finetune.py --write-tiny /tmp/sd-tiny
    python examples/sd_masked_finetune.py --model-dir /tmp/sd-tiny/model --data-dir /tmp/sd-tiny/data \\
        --output-dir /tmp/sd-tiny/out --max-steps 3 --check-grads
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import gradroute
from gradroute.schedules import warmup_power

SUBFOLDERS = ("unet", "text_encoder", "tokenizer", "scheduler")
GROUPS = ("tenc", "unet")


#: ``--gradient-checkpointing`` modes, the default (no value given) first
CHECKPOINTING = ("gradroute", "blocks", "torch")


class UsageError(Exception):
    """A problem with the command line or the files it names: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Example:
    image: Path
    mask: Path
    caption: str


def read_dataset(data_dir: Path) -> list[Example]:
    """The examples listed in ``data_dir/captions.txt``, every image and mask checked to exist and match.

    Raises:
        UsageError: a missing directory, file or mask, a malformed line, a mask whose size differs from its
            image, or no examples at all.
    """
    if not data_dir.is_dir():
        raise UsageError(f"`--data-dir` {str(data_dir)!r} does not exist or is not a directory")
    captions = data_dir / "captions.txt"
    if not captions.is_file():
        raise UsageError(f"`--data-dir` {str(data_dir)!r} has no captions.txt (one `file_name<TAB>caption` a line)")
    examples = []
    for lineno, line in enumerate(captions.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, caption = line.partition("\t")
        if not sep:
            raise UsageError(f"{captions}:{lineno}: expected `file_name<TAB>caption`, got {line[:60]!r}")
        image, mask = data_dir / "images" / name.strip(), data_dir / "masks" / name.strip()
        for path, what in ((image, "image"), (mask, "mask")):
            if not path.is_file():
                raise UsageError(f"{captions}:{lineno}: {what} {str(path)!r} does not exist")
        with Image.open(image) as im, Image.open(mask) as mk:
            if im.size != mk.size:
                raise UsageError(
                    f"mask {str(mask)!r} is {mk.size[0]}x{mk.size[1]} but its image {str(image)!r} is "
                    f"{im.size[0]}x{im.size[1]}; a mask must have its image's size"
                )
        examples.append(Example(image, mask, caption.strip()))
    if not examples:
        raise UsageError(f"`--data-dir` {str(data_dir)!r}: captions.txt lists no examples (the dataset is empty)")
    return examples


class MaskedCaptions(torch.utils.data.Dataset):
    """Images scaled to [-1, 1], masks to [0, 1], both resized to ``resolution``; captions tokenized."""

    def __init__(self, examples: Sequence[Example], tokenizer: Any, resolution: int) -> None:
        self.examples = list(examples)
        self.resolution = resolution
        self.ids = tokenizer(
            [e.caption for e in self.examples],
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        e, size = self.examples[i], (self.resolution, self.resolution)
        with Image.open(e.image) as im:
            pixels = np.asarray(im.convert("RGB").resize(size, Image.BICUBIC), dtype=np.float32) / 127.5 - 1
        with Image.open(e.mask) as mk:
            mask = np.asarray(mk.convert("L").resize(size, Image.NEAREST), dtype=np.float32) / 255
        return {
            "pixels": torch.from_numpy(pixels).permute(2, 0, 1),
            "mask": torch.from_numpy(mask)[None],
            "input_ids": self.ids[i],
        }


def batches(dataset: MaskedCaptions, batch_size: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Shuffled batches, epoch after epoch."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=gen)
        yield from loader


# -------------------------------------------------------------------------------------------------- models


@dataclass
class Models:
    tokenizer: Any
    tenc: torch.nn.Module
    unet: torch.nn.Module
    scheduler: Any
    vae: torch.nn.Module | None


def load_models(
    model_dir: Path, device: torch.device, *, lora_rank: int = 0, gradient_checkpointing: str | None = None
) -> Models:
    """Every part from ``model_dir`` with ``from_pretrained``; the VAE (if any) frozen; LoRA wrapped if asked."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    if not model_dir.is_dir():
        raise UsageError(f"`--model-dir` {str(model_dir)!r} does not exist or is not a directory")
    missing = [s for s in SUBFOLDERS if not (model_dir / s).is_dir()]
    if missing:
        raise UsageError(
            f"`--model-dir` {str(model_dir)!r} has no {', '.join(m + '/' for m in missing)} "
            f"(expected the layout of a Stable Diffusion repository: {', '.join(s + '/' for s in SUBFOLDERS)})"
        )
    tokenizer = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")
    tenc = CLIPTextModel.from_pretrained(model_dir / "text_encoder").to(device)
    unet = UNet2DConditionModel.from_pretrained(model_dir / "unet").to(device)
    scheduler = DDPMScheduler.from_pretrained(model_dir / "scheduler")
    vae = None
    if (model_dir / "vae").is_dir():
        vae = AutoencoderKL.from_pretrained(model_dir / "vae").to(device).eval().requires_grad_(False)
    channels = vae.config.latent_channels if vae is not None else 3
    if unet.config.in_channels != channels:
        raise UsageError(
            f"`--model-dir` {str(model_dir)!r}: the UNet takes {unet.config.in_channels} channels but "
            + (f"the VAE makes {channels}" if vae is not None else "without vae/ it trains on RGB pixels (3)")
        )
    if gradient_checkpointing not in (None, *CHECKPOINTING):
        raise UsageError(
            f"`--gradient-checkpointing` must be one of {', '.join(CHECKPOINTING)}, got {gradient_checkpointing!r}"
        )
    if gradient_checkpointing:
        # transformers >= 5 renamed the switch; non-reentrant checkpointing works with gradient routing
        enable = getattr(tenc, "activation_checkpointing_enable", None) or tenc.gradient_checkpointing_enable
        enable({"use_reentrant": False})
        if gradient_checkpointing == "torch":
            unet.enable_gradient_checkpointing()
        else:  # the text encoder's switch, pointed at gradroute.checkpoint
            gradroute.enable_checkpointing(tenc)
        if gradient_checkpointing == "gradroute":
            unet.enable_gradient_checkpointing(gradient_checkpointing_func=gradroute.checkpoint)
            # the consumers of each block layer's output get views of their own: the router can cut there, so
            # its passes interleave layer by layer and share one recomputation of every segment
            blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
            names = ("resnets", "attentions", "downsamplers", "upsamplers")
            layers = [m for b in blocks for n in names for m in getattr(b, n, None) or []]
            gradroute.cut_points(unet.conv_in, unet.time_embedding, *layers)
        elif gradient_checkpointing == "blocks":
            gradroute.checkpoint_modules(*unet.down_blocks, unet.mid_block, *unet.up_blocks)
    tenc.train()
    unet.train()
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        def lora(targets: list[str]) -> LoraConfig:
            return LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0, target_modules=targets)

        tenc = get_peft_model(tenc, lora(["q_proj", "k_proj", "v_proj", "out_proj"]))
        unet = get_peft_model(unet, lora(["to_q", "to_k", "to_v", "to_out.0"]))
    return Models(tokenizer, tenc, unet, scheduler, vae)


def save_models(models: Models, model_dir: Path, output_dir: Path) -> None:
    """``save_pretrained`` every part into ``output_dir`` (LoRA: the adapters under ``lora/``, then merged)."""
    from diffusers import AutoencoderKL

    output_dir.mkdir(parents=True, exist_ok=True)
    tenc, unet = models.tenc, models.unet
    if hasattr(unet, "merge_and_unload"):  # peft
        tenc.save_pretrained(output_dir / "lora" / "text_encoder")
        unet.save_pretrained(output_dir / "lora" / "unet")
        tenc, unet = tenc.merge_and_unload(), unet.merge_and_unload()
    tenc.save_pretrained(output_dir / "text_encoder")
    unet.save_pretrained(output_dir / "unet")
    models.tokenizer.save_pretrained(output_dir / "tokenizer")
    models.scheduler.save_pretrained(output_dir / "scheduler")
    if models.vae is not None:  # unchanged: copied as loaded
        AutoencoderKL.from_pretrained(model_dir / "vae").save_pretrained(output_dir / "vae")
    if (model_dir / "model_index.json").is_file():
        (output_dir / "model_index.json").write_text((model_dir / "model_index.json").read_text())


# ---------------------------------------------------------------------------------------------------- step


@dataclass
class Inputs:
    """Everything random about one step, drawn once so that reference forwards see the same values."""

    input_ids: torch.Tensor
    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    mask: torch.Tensor


@torch.no_grad()
def draw_inputs(
    models: Models, batch: dict[str, torch.Tensor], gen: torch.Generator, device: torch.device, autocast: Any
) -> Inputs:
    """Latents (or pixels), noise, timesteps, the target and the mask at latent resolution."""
    pixels = batch["pixels"].to(device)
    if models.vae is not None:
        with autocast():
            dist = models.vae.encode(pixels).latent_dist
        latents = (dist.mean + dist.std * torch.randn(dist.mean.shape, generator=gen).to(device)).float()
        latents = latents * models.vae.config.scaling_factor
    else:
        latents = pixels
    noise = torch.randn(latents.shape, generator=gen).to(device)
    sched = models.scheduler
    t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],), generator=gen).to(device)
    noisy = sched.add_noise(latents, noise, t)
    if sched.config.prediction_type == "epsilon":
        target = noise
    elif sched.config.prediction_type == "v_prediction":
        target = sched.get_velocity(latents, noise, t)
    else:
        raise UsageError(f"scheduler prediction_type {sched.config.prediction_type!r} is not supported")
    # "area" keeps partial coverage: a latent pixel half inside the mask gets weight 0.5
    mask = F.interpolate(batch["mask"].to(device), size=latents.shape[-2:], mode="area")
    return Inputs(batch["input_ids"].to(device), noisy, t, target, mask)


def losses(models: Models, x: Inputs, autocast: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The one forward: ``(loss_tenc, loss_unet)`` = the unmasked and the masked mean squared error."""
    with autocast():
        hidden = models.tenc(input_ids=x.input_ids)[0]
        pred = models.unet(x.noisy, x.timesteps, encoder_hidden_states=hidden).sample
    loss = F.mse_loss(pred.float(), x.target.float(), reduction="none")
    return loss.mean(), (loss * x.mask).mean()


def reference_grads(
    models: Models, x: Inputs, autocast: Any, rng: dict[str, Any], scale: float = 1.0
) -> dict[str, list[torch.Tensor]]:
    """Independent reference: a fresh forward per loss, ``torch.autograd.grad`` into that loss's network.

    ``rng`` is the random state the routed forward started from (dropout, if any, draws the same masks).
    ``scale``: the loss scale the routed backward used (fp16), so that both backwards round alike; the
    reference gradients are divided by it again.
    """
    out = {}
    for k, (name, module) in enumerate((("tenc", models.tenc), ("unet", models.unet))):
        params = [p for p in module.parameters() if p.requires_grad]
        with restored_rng(rng):
            loss = losses(models, x, autocast)[k]
        grads = torch.autograd.grad(loss * scale, params, allow_unused=True, materialize_grads=True)
        out[name] = [g / scale for g in grads]
    return out


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@contextlib.contextmanager
def restored_rng(state: dict[str, Any]) -> Iterator[None]:
    devices = [torch.cuda.current_device()] if "cuda" in state else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])
        yield


def relative_error(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """``||got - ref|| / ||ref||`` over all of a network's gradients (float64)."""
    num = sum(float((g.double() - r.double()).square().sum()) for g, r in zip(got, ref, strict=True))
    den = sum(float(r.double().square().sum()) for r in ref)
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="local SD layout: unet/ text_encoder/ tokenizer/ scheduler/ [vae/]")
    p.add_argument("--data-dir", type=Path, help="images/, masks/ and captions.txt")
    p.add_argument("--output-dir", type=Path, help="where save_pretrained writes the trained models")
    p.add_argument("--write-tiny", type=Path, metavar="DIR", help="write DIR/model and DIR/data (tiny) and exit")
    p.add_argument("--max-steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--resolution", type=int, default=None, help="default: UNet sample_size x VAE scale factor")
    p.add_argument("--tenc-lr", type=float, default=1e-7)
    p.add_argument("--tenc-weight-decay", type=float, default=1e-3)
    p.add_argument("--unet-lr", type=float, default=1e-6)
    p.add_argument("--unet-weight-decay", type=float, default=1e-2)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.99))
    p.add_argument("--eps", type=float, default=1e-7)
    p.add_argument("--warmup-steps", type=int, default=30, help="linear warmup (capped at --max-steps)")
    p.add_argument("--lr-exponent", type=float, default=5.0, help="decay (1 - progress) ** exponent after warmup")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip each network's gradients")
    p.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default="no")
    p.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const="gradroute",
        default=None,
        choices=CHECKPOINTING,
        help="gradroute (default): the libraries' own switches pointed at gradroute.checkpoint, the UNet blocks' "
        "layers as cut points; blocks: whole UNet blocks under gradroute.checkpoint; torch: the switches as they are",
    )
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-grads", action="store_true", help="compare step 0 with independent references")
    p.add_argument("--grad-tol", type=float, default=None, help="default: 1e-4 in fp32, 1e-3 in fp16/bf16")
    p.add_argument(
        "--naive-sum",
        action="store_true",
        help="for comparison: route loss_tenc + loss_unet to both networks, which is what one backward of the\n"
        "summed loss does (both networks get the other's gradient too); --check-grads then fails",
    )
    args = p.parse_args(argv)
    if args.write_tiny is None:
        for flag in ("model_dir", "data_dir", "output_dir"):
            if getattr(args, flag) is None:
                p.error(f"--{flag.replace('_', '-')} is required (or --write-tiny DIR)")
    for flag in ("max_steps", "batch_size", "accumulate"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.lora_rank < 0:
        p.error(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.grad_tol is None:
        args.grad_tol = 1e-4 if args.mixed_precision == "no" else 1e-3
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_hf()
    try:
        if args.write_tiny is not None:
            write_tiny(args.write_tiny)
            print(f"wrote {args.write_tiny / 'model'} and {args.write_tiny / 'data'}")
            return 0
        return train(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    examples = read_dataset(args.data_dir)  # before loading models: bad data fails fast
    models = load_models(
        args.model_dir, device, lora_rank=args.lora_rank, gradient_checkpointing=args.gradient_checkpointing
    )
    scale = 2 ** (len(models.vae.config.block_out_channels) - 1) if models.vae is not None else 1
    resolution = args.resolution or models.unet.config.sample_size * scale
    data = batches(MaskedCaptions(examples, models.tokenizer, resolution), args.batch_size, args.seed)

    amp_dtype = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.mixed_precision]

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None

    # step 0's unscaled gradients, seen by each group's hook before clipping and stepping
    seen: dict[str, list[torch.Tensor]] = {}

    def hook_for(name: str, params: list[torch.Tensor]) -> Any:
        def hook(_with_grad: Sequence[torch.Tensor]) -> None:
            if args.check_grads and name not in seen:
                seen[name] = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]

        return hook

    groups = {}
    for name, module, lr, wd in (
        ("tenc", models.tenc, args.tenc_lr, args.tenc_weight_decay),
        ("unet", models.unet, args.unet_lr, args.unet_weight_decay),
    ):
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=tuple(args.betas), eps=args.eps)
        sched = warmup_power(opt, min(args.warmup_steps, args.max_steps), args.lr_exponent, args.max_steps)
        groups[name] = gradroute.Group(
            params, optimizer=opt, scheduler=sched, max_grad_norm=args.max_grad_norm, grad_hook=hook_for(name, params)
        )
    router = gradroute.Router(groups, scaler=scaler, accumulate=args.accumulate)

    gen = torch.Generator().manual_seed(args.seed)
    reference: dict[str, list[torch.Tensor]] = {}
    start = time.perf_counter()
    for step in range(args.max_steps):
        for _ in range(args.accumulate):
            x = draw_inputs(models, next(data), gen, device, autocast)
            rng = rng_state(device)
            loss_tenc, loss_unet = losses(models, x, autocast)
            if args.naive_sum:
                total = loss_tenc + loss_unet
                router.backward(tenc=total, unet=total)
            else:
                router.backward(tenc=loss_tenc, unet=loss_unet)
            if args.check_grads and step == 0:  # the mean over the micro-batches, as the hook will see it
                scale = float(scaler.get_scale()) if scaler is not None else 1.0
                for name, grads in reference_grads(models, x, autocast, rng, scale).items():
                    acc = reference.setdefault(name, [torch.zeros_like(g) for g in grads])
                    for a, g in zip(acc, grads, strict=True):
                        a.add_(g, alpha=1 / args.accumulate)
            stats = router.step()
        print(f"step {step + 1}/{args.max_steps}  " + "  ".join(_fmt(n, stats.get(n)) for n in GROUPS), flush=True)
    print(f"trained {args.max_steps} steps in {time.perf_counter() - start:.1f} s")

    status = 0
    if args.check_grads:
        errors = {}
        for name in GROUPS:
            if name not in seen:
                print(f"grad check: the {name} hook never ran (step 0 skipped?)")
                return 1
            errors[name] = relative_error(seen[name], reference[name])
        worst = max(errors.values())
        verdict = "ok" if worst <= args.grad_tol else "FAILED"
        print(
            "grad check (step 0 vs fresh forward per loss + torch.autograd.grad): "
            + "  ".join(f"{n} rel. error {e:.2e}" for n, e in errors.items())
            + f"  max relative error {worst:.2e} (tolerance {args.grad_tol:.0e}) {verdict}"
        )
        status = 0 if worst <= args.grad_tol else 1
    save_models(models, args.model_dir, args.output_dir)
    (args.output_dir / "gradroute_train.json").write_text(json.dumps({"args": _jsonable(vars(args))}, indent=1))
    print(f"saved to {args.output_dir}")
    return status


def quiet_hf() -> None:
    """No progress bars from transformers/diffusers when they load or save."""
    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


def _fmt(name: str, s: Any) -> str:
    if s is None or s.loss is None:
        return f"{name} -"
    if s.skipped:
        return f"{name} skipped (inf/nan)"
    return f"{name} loss {s.loss:.4f} grad {s.grad_norm:.3g} lr {s.lr:.2e}"


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


# ------------------------------------------------------------------------- a tiny local model and dataset

TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
TINY_MERGES = ("a t</w>", "t h", "th e</w>", "o n</w>", "i n", "c a", "ca t</w>", "d o", "do g</w>")


def write_tiny(root: Path) -> None:
    """Write ``root/model`` (tiny SD layout, random weights) and ``root/data`` (four 16x16 images)."""
    write_tiny_model(root / "model")
    write_tiny_dataset(root / "data")


def write_tiny_model(path: Path, *, vae: bool = True, seed: int = 0) -> None:
    """A Stable-Diffusion-shaped model directory small enough for CPU tests (about 0.3M parameters).

    ``vae=False`` leaves out ``vae/`` and makes a pixel-space UNet (3 channels, 16x16).
    """
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    tok_dir = path / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in TINY_CHARS:
        vocab[c] = len(vocab)
    for c in TINY_CHARS:
        vocab[c + "</w>"] = len(vocab)
    for m in TINY_MERGES:
        vocab[m.replace(" ", "")] = len(vocab)
    (tok_dir / "vocab.json").write_text(json.dumps(vocab))
    (tok_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(TINY_MERGES) + "\n")
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "CLIPTokenizer", "model_max_length": 16})
    )
    text_config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    CLIPTextModel(text_config).save_pretrained(path / "text_encoder")
    channels = 4 if vae else 3
    UNet2DConditionModel(
        sample_size=8 if vae else 16,
        in_channels=channels,
        out_channels=channels,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=8,
    ).save_pretrained(path / "unet")
    if vae:
        AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
            sample_size=16,
        ).save_pretrained(path / "vae")
    DDPMScheduler(num_train_timesteps=1000).save_pretrained(path / "scheduler")


def write_tiny_dataset(path: Path, n: int = 4, size: int = 16, seed: int = 0) -> None:
    """``n`` random RGB images with a rectangle mask each, and their captions."""
    rng = np.random.default_rng(seed)
    (path / "images").mkdir(parents=True, exist_ok=True)
    (path / "masks").mkdir(parents=True, exist_ok=True)
    words = ["a cat", "the dog", "a cat on the mat", "the sea at dawn"]
    lines = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path / "images" / f"{i}.png")
        mask = np.zeros((size, size), dtype=np.uint8)
        mask[size // 4 : 3 * size // 4, i % 2 * size // 2 :] = 255
        Image.fromarray(mask).save(path / "masks" / f"{i}.png")
        lines.append(f"{i}.png\t{words[i % len(words)]}")
    (path / "captions.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
