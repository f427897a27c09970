"""Routed gradients through a ``torch.compile``d text encoder and UNet (diffusers + transformers).

The models, data and losses are those of ``sd_masked_finetune.py``: ``loss_tenc = loss.mean()`` routed to the
text encoder, ``loss_unet = (loss * mask).mean()`` to the UNet, from one forward of the *compiled* modules.
The models are compiled with ``gradroute.compile`` (``torch.compile`` with a backend whose compiled backwards are
specialised per engine call): a compiled module's backward is one autograd node (an AOTAutograd
``CompiledFunctionBackward``), and with plain ``torch.compile`` it computes every input gradient in every call,
so the text encoder's routed pass through the compiled UNet would compute all of the UNet's weight gradients and
drop them. With ``gradroute.compile`` each call runs a backward graph that computes only what the engine will use
(``--compile torch`` shows the difference: exact too, slower). ``gradroute.compile``'s backwards also never take
donated buffers, so no ``torch._functorch.config.donated_buffer`` setting is needed (plain ``torch.compile``:
see examples/README.md).

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
    python examples/compile_router.py --compile torch         # plain torch.compile: exact, unpruned
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
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"), help="compiler backend")
    p.add_argument(
        "--compile",
        choices=("gradroute", "torch"),
        default="gradroute",
        help="gradroute.compile (backwards specialised per routed pass) or plain torch.compile",
    )
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
            if args.compile == "gradroute":
                return run(args, model_dir)
            # plain torch.compile: see examples/README.md for why (routed passes retain through compiled backwards)
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

    compile_fn = gradroute.compile if args.compile == "gradroute" else torch.compile
    compiled = sd.Models(
        models.tokenizer,
        compile_fn(models.tenc, backend=args.backend),
        compile_fn(models.unet, backend=args.backend),
        models.scheduler,
        models.vae,
    )
    # the groups are the eager modules' parameters: the compiled modules share them
    router = gradroute.Router(tenc=models.tenc, unet=models.unet)

    start = time.perf_counter()
    routed_step(router, compiled, x, autocast)  # compiles forward and backward
    print(
        f"{args.compile}.compile with backend {args.backend!r}: {time.perf_counter() - start:.1f} s "
        "(first routed step, compiling included)"
    )
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
    for name, m in (("tenc", compiled.tenc), ("unet", compiled.unet)):
        st = gradroute.compile_stats(m)
        if st is not None:
            print(
                f"{name}: {st.backwards} compiled backward(s), {st.variants} specialised variant(s) cached "
                f"(compiling them took {st.seconds:.1f} s)"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
