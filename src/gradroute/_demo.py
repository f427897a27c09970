"""``gradroute demo``: a text encoder and a conditional UNet trained from one forward, each on its own loss.

The scenario (models and data in ``_demo_models``): a text encoder reads captions such as "red circle top
left"; a UNet, cross-attending to the text, predicts the noise added to 32x32 pictures of that caption.
``loss = mse(pred, noise, reduction="none")``; the text encoder is trained on ``loss.mean()`` and the UNet on
``(loss * mask).mean()`` (the shape's region only), routed by :class:`gradroute.Router` from ONE forward.

Each group has its own AdamW, ``warmup_power`` scheduler and gradient clipping, with the seed's settings
(docs/training_step.md: text encoder lr 1e-7 and weight decay 1e-3, UNet lr 1e-6 and weight decay 1e-2,
betas (0.9, 0.99), eps 1e-7, 30 warmup steps, decay exponent 5, clipping at 1.0) except for the learning
rates, scaled up 2000 times (text encoder 2e-4, UNet 2e-3; still ten times apart) because the seed
fine-tunes pretrained networks for thousands of steps and the demo trains from scratch in about a minute;
the warmup is 10% of the steps (30 for the default 300). Precision: fp16 autocast with a ``GradScaler`` on
CUDA, fp32 on CPU (``--dtype bf16`` for bf16 autocast).

At step 0 the plan is printed and the routed gradients are compared with an independent reference (a fresh
forward per loss and ``torch.autograd.grad``); the demo fails (exit code 1) if they differ. At the end it
writes ``DIR/demo.json`` (settings, plan, the check, a per-step log, held-out losses before and after) and
``DIR/demo.png`` (loss curves per route, and denoised samples with the mask outlined).

Everything that prints or writes is behind ``is_main`` (rank 0 in a distributed run).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch

#: The hyper-parameters of the demo (see the module docstring).
HYPER: dict[str, Any] = {
    "tenc": {"lr": 2e-4, "weight_decay": 1e-3, "max_grad_norm": 1.0},
    "unet": {"lr": 2e-3, "weight_decay": 1e-2, "max_grad_norm": 1.0},
    "betas": (0.9, 0.99),
    "eps": 1e-7,
    "warmup_fraction": 0.1,
    "exponent": 5.0,
}
#: maximum relative error of the step-0 check, by precision
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
N_SAMPLES = 4


class Progress:
    """A one-line text progress bar (no dependency): rewritten in place on a terminal, else every 10%.

    Example:
        >>> p = Progress(10, "demo", enabled=False)
        >>> p.update(1, "step 1")
        >>> p.close()
    """

    def __init__(
        self, total: int, label: str, *, stream: IO[str] | None = None, enabled: bool = True, width: int = 24
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0
        self._last_decile = -1
        self._len = 0
        self._start = time.perf_counter()

    def update(self, n: int = 1, text: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last < 0.1 and self.done < self.total:
                return
            self._last = now
            fill = round(self.width * self.done / self.total)
            line = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {text}"
            pad = max(0, self._len - len(line))
            self._len = len(line)
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
        else:
            decile = 10 * self.done // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                elapsed = now - self._start
                self.stream.write(f"{self.label}: {self.done}/{self.total} ({elapsed:.0f} s) {text}\n")
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> CUDA if available, else CPU; anything else must name an available device.

    Raises:
        ValueError: an unknown or unavailable device.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"`--device` must be auto, cpu or cuda[:N], got {spec!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"`--device` must be auto, cpu or cuda[:N], got {spec!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`--device {spec}`: CUDA is not available (torch {torch.__version__})")
    return dev


def rel_error(got: list[torch.Tensor | None], ref: list[torch.Tensor]) -> float:
    """Relative L2 error of a list of gradients (``None`` counts as zero) against a reference, in float64."""
    num = den = 0.0
    for g, r in zip(got, ref):
        r64 = r.detach().double()
        d = r64 if g is None else g.detach().double() - r64
        num += float(d.square().sum())
        den += float(r64.square().sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def _stat(stats: Any, name: str, key: str) -> Any:
    s = stats.get(name) if hasattr(stats, "get") else None
    if s is None:
        return None
    return s.get(key) if isinstance(s, dict) else getattr(s, key, None)


def run(args: argparse.Namespace, *, is_main: bool = True) -> int:
    """``gradroute demo``; see ``gradroute demo --help``. Returns the exit code."""
    import gradroute
    from gradroute.schedules import warmup_power

    from ._demo_models import SCHEDULE, forward_losses, make_batch, make_models

    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"`{flag}` must be >= 1, got {value}")
    dev = resolve_device(args.device)
    rank, world, dev = _init_distributed(dev, args.batch_size)  # under torchrun: one process per rank
    is_main = is_main and rank == 0
    dtype = args.dtype if args.dtype != "auto" else ("fp16" if dev.type == "cuda" else "fp32")
    if dtype == "fp16" and dev.type != "cuda":
        raise ValueError("`--dtype fp16` needs `--device cuda` (use bf16 or fp32 on CPU)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"`--out` must be a directory, got the file {str(out)!r}")

    torch.manual_seed(args.seed)
    tenc, unet = make_models(seed=args.seed, width=args.width)
    tenc.to(dev)
    unet.to(dev)
    train_tenc, train_unet = _wrap_ddp(tenc, unet, dev, world)  # the modules themselves unless distributed
    steps = args.steps
    warmup = max(1, round(HYPER["warmup_fraction"] * steps))

    def group(name: str, module: torch.nn.Module) -> gradroute.Group:
        h = HYPER[name]
        opt = torch.optim.AdamW(
            module.parameters(), lr=h["lr"], weight_decay=h["weight_decay"], betas=HYPER["betas"], eps=HYPER["eps"]
        )
        sched = warmup_power(opt, warmup, HYPER["exponent"], max(steps, warmup))
        return gradroute.Group(module, optimizer=opt, scheduler=sched, max_grad_norm=h["max_grad_norm"])

    scaler = torch.amp.GradScaler("cuda") if dtype == "fp16" else None
    router = gradroute.Router(tenc=group("tenc", tenc), unet=group("unet", unet), scaler=scaler)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype)

    def autocast() -> Any:
        return torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    gen = torch.Generator().manual_seed(args.seed)
    held_out = make_batch(64, torch.Generator().manual_seed(args.seed + 7919), device=dev)

    def held_out_losses() -> dict[str, float]:
        tenc.eval()
        unet.eval()
        with torch.no_grad(), autocast():
            lt, lu = forward_losses(tenc, unet, held_out)
        tenc.train()
        unet.train()
        return {"tenc": float(lt), "unet": float(lu)}

    before = held_out_losses()
    log: list[dict[str, Any]] = []
    check: dict[str, Any] = {}
    progress = Progress(steps, "demo", enabled=is_main)
    for k in range(steps):
        batch = make_batch(args.batch_size, gen, device=dev)
        t0 = time.perf_counter()
        with autocast():
            loss_tenc, loss_unet = forward_losses(train_tenc, train_unet, _shard(batch, rank, world))
        if k == 0:
            plan = router.plan(tenc=loss_tenc, unet=loss_unet)
            if is_main:
                print(plan, end="\n\n", flush=True)
            ref = _reference(tenc, unet, batch, autocast, scaler)
        router.backward(tenc=loss_tenc, unet=loss_unet)
        if k == 0:
            check = _check(router, ref, scaler, dtype)
            del ref
            if is_main:
                verdict = "ok" if check["passed"] else "FAILED"
                print(
                    f"step 0 check against independent forwards: max relative error "
                    f"{check['max_rel_err']:.2e} (tenc {check['tenc']:.2e}, unet {check['unet']:.2e}; "
                    f"tolerance {check['tolerance']:.0e}) {verdict}",
                    flush=True,
                )
            if not check["passed"]:
                progress.close()
                if is_main:
                    print("gradroute demo: routed gradients differ from the reference", file=sys.stderr)
                return 1
        stats = router.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ms = (time.perf_counter() - t0) * 1000
        row = {"step": k, "ms": ms}
        for name in ("tenc", "unet"):
            for key in ("loss", "grad_norm", "lr", "skipped"):
                row[f"{key}_{name}"] = _stat(stats, name, key)
        log.append(row)
        progress.update(
            1,
            f"loss tenc {row['loss_tenc']:.4f} unet {row['loss_unet']:.4f} | "
            f"lr {row['lr_tenc']:.1e}/{row['lr_unet']:.1e} | {ms:.0f} ms/step",
        )
    progress.close()
    after = held_out_losses()
    if not is_main:
        return 0
    print(
        f"held-out loss, before -> after: tenc {before['tenc']:.4f} -> {after['tenc']:.4f}, "
        f"unet {before['unet']:.4f} -> {after['unet']:.4f}"
    )
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "gradroute": gradroute.__version__,
        "torch": torch.__version__,
        "device": str(dev),
        "dtype": dtype,
        "settings": {
            "steps": steps,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "width": args.width,
            "warmup_steps": warmup,
            "world_size": world,
        },
        "hyper": HYPER,
        "plan": str(plan),
        "check": check,
        "held_out": {"before": before, "after": after},
        "log": log,
    }
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    written = [str(out / "demo.json")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("gradroute demo: matplotlib is not installed: demo.png skipped", file=sys.stderr)
    else:
        _plot(out / "demo.png", log, tenc, unet, SCHEDULE, args.seed, dev)
        written.append(str(out / "demo.png"))
    print(f"wrote {', '.join(written)}")
    return 0


def _reference(tenc: Any, unet: Any, batch: dict[str, Any], autocast: Any, scaler: Any) -> dict[str, Any]:
    """Independent gradients: a fresh forward per loss and ``torch.autograd.grad`` (scaled like the run)."""
    from ._demo_models import forward_losses

    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    ref = {}
    for k, (name, module) in enumerate((("tenc", tenc), ("unet", unet))):
        with autocast():
            loss = forward_losses(tenc, unet, batch)[k]
        params = [p for p in module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
        ref[name] = [torch.zeros_like(p) if g is None else g / scale for p, g in zip(params, grads)]
    return ref


def _check(router: Any, ref: dict[str, Any], scaler: Any, dtype: str) -> dict[str, Any]:
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    errs = {}
    for name, grads in ref.items():
        params = router.groups[name].params
        errs[name] = rel_error([None if p.grad is None else p.grad / scale for p in params], grads)
    worst = max(errs.values())
    tol = TOLERANCE[dtype]
    return {"max_rel_err": worst, **errs, "tolerance": tol, "passed": bool(worst <= tol)}


@torch.no_grad()
def _plot(path: Path, log: list[dict[str, Any]], tenc: Any, unet: Any, schedule: Any, seed: int, dev: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._demo_models import make_batch

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

    fig = plt.figure(figsize=(8, 10.5))
    grid = fig.add_gridspec(5, N_SAMPLES, height_ratios=[1.6, 1, 1, 1, 1])
    ax = fig.add_subplot(grid[0, :])
    steps = [r["step"] for r in log]
    for name, colour in (("tenc", "tab:blue"), ("unet", "tab:orange")):
        ys = [r[f"loss_{name}"] for r in log]
        label = {"tenc": "loss_tenc = loss.mean() -> text encoder", "unet": "loss_unet = (loss*mask).mean() -> UNet"}
        ax.plot(steps, ys, color=colour, alpha=0.3, lw=0.8)
        window = max(1, len(ys) // 20)
        smooth = [
            sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))
        ]
        ax.plot(steps, smooth, color=colour, lw=1.8, label=label[name])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log)")
    ax.legend(loc="upper right")
    ax.set_title("routed losses from one forward (gradroute.Router)")

    def show(img: torch.Tensor) -> Any:
        return ((img.float().cpu().clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()

    rows = (
        ("clean + mask", batch["images"]),
        (f"noised t={int(t_mid[0])}", noisy),
        ("denoised, 1 step", one_step),
        ("sampled, DDIM 20", sampled),
    )
    for i, (title, imgs) in enumerate(rows):
        for j in range(N_SAMPLES):
            a = fig.add_subplot(grid[i + 1, j])
            a.imshow(show(imgs[j]), interpolation="nearest")
            if i != 1:
                a.contour(batch["masks"][j, 0].cpu().numpy(), levels=[0.5], colors="white", linewidths=0.8)
            a.set_xticks([])
            a.set_yticks([])
            if j == 0:
                a.set_ylabel(title, fontsize=8)
            if i == 0:
                a.set_title(batch["captions"][j], fontsize=9)
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


# ---------------------------------------------------------------------- distributed (torchrun)


def _init_distributed(dev: torch.device, batch_size: int) -> tuple[int, int, torch.device]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group and pick this rank's device.

    nccl on CUDA (device ``cuda:LOCAL_RANK``), gloo on the CPU. Returns ``(rank, world, device)``; ``(0, 1,
    dev)`` outside torchrun. Every rank draws the same global batch and trains on its own share of the rows.
    """
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, dev
    import atexit

    import torch.distributed as dist

    if batch_size % world:
        raise ValueError(f"`--batch-size` ({batch_size}) must be a multiple of the number of processes ({world})")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        atexit.register(dist.destroy_process_group)
    return dist.get_rank(), dist.get_world_size(), dev


def _wrap_ddp(tenc: torch.nn.Module, unet: torch.nn.Module, dev: torch.device, world: int) -> tuple[Any, Any]:
    """One ``DistributedDataParallel`` per network (each is its own group), or the modules when not distributed."""
    if world <= 1:
        return tenc, unet
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [dev.index] if dev.type == "cuda" else None
    return DDP(tenc, device_ids=ids), DDP(unet, device_ids=ids)


def _shard(batch: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """This rank's contiguous share of the rows of ``batch`` (all of it when not distributed)."""
    if world <= 1:
        return batch
    n = len(batch["captions"]) // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}
