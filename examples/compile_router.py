"""Routed gradients through a ``torch.compile``d text encoder and UNet (diffusers + transformers).

The models, data and losses are those of ``sd_masked_finetune.py``: ``loss_tenc = loss.mean()`` routed to the
text encoder, ``loss_unet = (loss * mask).mean()`` to the UNet, from one forward of the *compiled* modules.
The router needs nothing special: a compiled module's backward is one node of the autograd graph (an
AOTAutograd ``CompiledFunctionBackward``), and the router plans its passes around such nodes like around any
other. What changes is cost, not exactness: inside a compiled region nothing can be pruned, so a routed pass
that crosses the compiled UNet runs the UNet's whole compiled backward (parameter gradients included) even
when it only needs the gradient of the UNet's input. The plan printed below shows the passes.

AOTAutograd may *donate* the activations it saves to a compiled backward that it expects to run once
(``torch._functorch.config.donated_buffer``). It turns that off by itself when the first backward through a
compiled region runs with ``retain_graph=True``, as a routed pass that a later pass depends on does; but if a
plain backward ran first, the routed pass fails with "This backward function was compiled with non-empty
donated buffers". The script runs with ``donated_buffer=False`` (compile and backward), which makes the order
irrelevant at the cost of the memory donation would have reused.

The script compiles both models and checks the routed gradients against an independent reference: a fresh
forward per loss through the same compiled modules and ``torch.autograd.grad`` (``--grad-tol``, relative L2
error per network; exit status 1 above it). It also prints how far the compiled modules' own gradients are
from eager ones (no routing involved: that is the compiler's accuracy) and times the routed step eager vs
compiled. (With torch 2.13.0 on CPU, ``inductor``'s backward of the tiny UNet differs from eager by a relative
error of about 0.65, with a plain ``torch.autograd.grad`` and no gradroute in the picture; ``aot_eager`` matches eager
exactly.)

Backends: ``--backend inductor`` (the default; on CPU it compiles C++ with the system compiler, a minute or
more even for the tiny models) or ``--backend aot_eager`` (AOTAutograd with eager kernels: the same graph
capture and autograd structure as inductor, no code generation; seconds on CPU, and what the tests run).

Run::

    python examples/compile_router.py                        # a tiny model written to a temp dir
    python examples/compile_router.py --backend aot_eager
    python examples/compile_router.py --model-dir /path/to/sd-snapshot --device cuda --batch-size 8
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sd_masked_finetune as sd
import torch

import gradroute


def routed_step(router: gradroute.Router, models: sd.Models, x: sd.Inputs, autocast: Any) -> None:
    loss_tenc, loss_unet = sd.losses(models, x, autocast)
    router.backward(tenc=loss_tenc, unet=loss_unet)


def timed(fn: Callable[[], None], device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="SD layout as in sd_masked_finetune.py (default: a tiny one)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend: inductor, aot_eager, ...")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=5, help="timed routed steps per variant (0: no timing)")
    p.add_argument("--grad-tol", type=float, default=None, help="default: 1e-4 (2e-2 with bf16)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.repeat < 0:
        p.error(f"--repeat must be >= 0, got {args.repeat}")
    if args.grad_tol is None:
        args.grad_tol = 1e-4 if args.mixed_precision == "no" else 2e-2
    return args


def no_donated_buffers() -> contextlib.AbstractContextManager[object]:
    """``torch._functorch.config.donated_buffer = False`` while inside (torch 2.6+; before, none are donated)."""
    config = torch._functorch.config
    return config.patch(donated_buffer=False) if hasattr(config, "donated_buffer") else contextlib.nullcontext()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sd.quiet_hf()
    with contextlib.ExitStack() as stack:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "model"
            sd.write_tiny_model(model_dir)
        try:
            # see the module docstring: compiled backwards that a routed pass may run with retain_graph=True
            with no_donated_buffers():
                return run(args, model_dir)
        except sd.UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2


def run(args: argparse.Namespace, model_dir: Path) -> int:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    models = sd.load_models(model_dir, device)
    amp_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else None

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    # a random batch at the model's resolution
    gen = torch.Generator().manual_seed(args.seed)
    scale = 2 ** (len(models.vae.config.block_out_channels) - 1) if models.vae is not None else 1
    res = models.unet.config.sample_size * scale
    captions = ["a cat on the mat", "the dog"] * args.batch_size
    ids = models.tokenizer(
        captions[: args.batch_size],
        padding="max_length",
        max_length=models.tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    batch = {
        "pixels": torch.rand(args.batch_size, 3, res, res, generator=gen) * 2 - 1,
        "mask": (torch.rand(args.batch_size, 1, res, res, generator=gen) > 0.5).float(),
        "input_ids": ids,
    }
    x = sd.draw_inputs(models, batch, gen, device, autocast)

    compiled = sd.Models(
        models.tokenizer,
        torch.compile(models.tenc, backend=args.backend),
        torch.compile(models.unet, backend=args.backend),
        models.scheduler,
        models.vae,
    )
    # the groups are the eager modules' parameters: the compiled modules share them
    router = gradroute.Router(tenc=models.tenc, unet=models.unet)

    start = time.perf_counter()
    routed_step(router, compiled, x, autocast)  # compiles forward and backward
    print(f"compiled with backend {args.backend!r} in {time.perf_counter() - start:.1f} s (first routed step)")
    got = {
        name: [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.parameters()]
        for name, module in (("tenc", models.tenc), ("unet", models.unet))
    }
    router.zero_grad()
    # references: a fresh forward per loss + torch.autograd.grad, through the same compiled modules (the
    # router must match these), and through the eager ones (how far the compiler itself is from eager)
    rng = sd.rng_state(device)
    same = sd.reference_grads(compiled, x, autocast, rng)
    eager = sd.reference_grads(models, x, autocast, rng)
    errors = {name: sd.relative_error(got[name], same[name]) for name in got}
    worst = max(errors.values())
    ok = worst <= args.grad_tol
    print(
        "grad check (routed vs fresh forward per loss + torch.autograd.grad, both compiled): "
        + "  ".join(f"{n} rel. error {e:.2e}" for n, e in errors.items())
        + f"  max relative error {worst:.2e} (tolerance {args.grad_tol:.0e}) {'ok' if ok else 'FAILED'}"
    )
    drift = {name: sd.relative_error(same[name], eager[name]) for name in got}
    print(
        "compiled vs eager (no routing involved): "
        + "  ".join(f"{n} rel. error {e:.2e}" for n, e in drift.items())
        + ("" if max(drift.values()) <= args.grad_tol else "  WARNING: the compiled model's own gradients differ")
    )
    print(router.plan(**dict(zip(("tenc", "unet"), sd.losses(compiled, x, autocast), strict=True))))

    if args.repeat:
        for name, m in (("eager", models), ("compiled", compiled)):
            seconds = timed(lambda m=m: (routed_step(router, m, x, autocast), router.zero_grad()), device, args.repeat)
            print(f"routed forward + backward, {name}: {seconds * 1e3:.1f} ms (median of {args.repeat})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
