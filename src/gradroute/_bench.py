"""``gradroute bench``: ways of routing two losses from one forward, side by side on one workload.

Strategies (``up``/``down`` are the upstream and downstream groups of the workload, see ``_workloads``):

* ``sum`` -- one backward of ``loss_up + loss_down``: the cost floor, wrong gradients (each loss leaks into
  the other group).
* ``seed`` -- ``loss_up.backward(inputs=up)`` then ``loss_down.backward(inputs=down)`` without
  ``retain_graph``: crashes (the first call frees the shared graph).
* ``retain_twice`` -- ``loss_up.backward(retain_graph=True)``, keep the upstream grads, ``loss_down.backward()``,
  put the upstream grads back: two full backwards.
* ``freeze`` -- the same two full backwards, with the other group's ``requires_grad`` switched off around each.
* ``two_forward`` -- GAN style: the downstream loss on ``boundary.detach()``, then a second downstream forward
  with the downstream network frozen for the upstream loss.
* ``pruned`` -- hand-written ``backward(inputs=)`` passes, retaining on the first; upstream loss first (the
  order with the lower peak).
* ``cut`` -- a hand cut at the boundary: ``grad(loss_up, boundary, retain_graph=True)``, ``loss_down`` into
  the downstream group, then the boundary gradient into the upstream group.
* ``gradroute`` -- ``Router.backward(up=loss_up, down=loss_down)``.
* ``gradroute_ckpt`` -- with ``--checkpointing`` only: the same with ``gradroute.checkpoint`` as both
  networks' checkpoint function (one recomputation per segment for all engine calls), where the other
  strategies use ``torch.utils.checkpoint`` (non-reentrant).
* ``gradroute_blocks`` -- with ``--checkpointing`` only: ``gradroute`` with ``gradroute.checkpoint_modules``
  on whole UNet blocks (``sd15``: down, mid and up blocks instead of diffusers' per-layer switch, so that the
  router can interleave its calls per block; ``sd-tiny`` checkpoints whole blocks already: as ``gradroute_ckpt``).
* ``gradroute_cuts`` -- with ``--checkpointing`` only: ``gradroute_ckpt`` plus ``gradroute.cut_points`` on the
  UNet blocks' submodules (``sd15``: the passes interleave layer by layer, one recomputation per segment;
  ``sd-tiny``: as ``gradroute_ckpt``).

Measured per strategy: the relative L2 error of each group's gradient against a reference of independent
forwards (one fresh forward per loss and ``torch.autograd.grad``, under the same dtype/autocast as the run,
fp32 gradients); median and min time of forward + backward after warm-up (strategies interleaved step by
step, so that load from other processes hits all of them alike); peak memory above the resting state
(CUDA: ``max_memory_allocated``; CPU: each strategy in its own process, peak RSS above its baseline after a
warm-up step, with the kernel's high-water mark reset through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ._demo import Progress, rel_error, resolve_device
from ._workloads import DEFAULT_BATCH, Workload, build

STRATEGIES = ("sum", "seed", "retain_twice", "freeze", "two_forward", "pruned", "cut", "gradroute")
#: with activation checkpointing only
#: strategy -> the checkpoint kind the workload switches to (see ``Workload.set_checkpoint``)
CKPT_STRATEGIES = {"gradroute_ckpt": "gradroute", "gradroute_blocks": "blocks", "gradroute_cuts": "cuts"}
#: strategies whose gradients are wrong by design
INEXACT = ("sum", "seed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Runner:
    """A workload with its router and precision: runs one step (forward + backward) of a strategy."""

    def __init__(self, wl: Workload, dtype: str) -> None:
        import gradroute

        self.wl = wl
        self.dtype = dtype
        self.device = next(wl.up_module.parameters()).device
        self.up_params = wl.params(wl.up_name)
        self.down_params = wl.params(wl.down_name)
        self.all_params = list(dict.fromkeys(self.up_params + self.down_params))
        self.router = gradroute.Router(dict(wl.groups))

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype == "fp32":
            yield
        else:
            with torch.autocast(self.device.type, dtype=DTYPES[self.dtype]):
                yield

    def up(self) -> torch.Tensor:
        with self.autocast():
            return self.wl.up(self.wl.batch)

    def down(self, h: torch.Tensor, *need: str) -> dict[str, torch.Tensor]:
        with self.autocast():
            return self.wl.down(self.wl.batch, h, need or (self.wl.up_name, self.wl.down_name))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """boundary, loss_up, loss_down"""
        h = self.up()
        losses = self.down(h)
        return h, losses[self.wl.up_name], losses[self.wl.down_name]

    def zero(self) -> None:
        for p in self.all_params:
            p.grad = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare(self, strategy: str) -> None:
        """Untimed set-up before a step: the checkpoint function the strategy uses."""
        if self.wl.set_checkpoint is not None:
            self.wl.set_checkpoint(CKPT_STRATEGIES.get(strategy, "torch"))

    def step(self, strategy: str) -> None:
        STRATEGY_FNS[strategy](self)

    def reference(self) -> dict[str, list[torch.Tensor]]:
        """Per group: the gradient of its own loss alone, from a fresh forward (fp32 gradients)."""
        self.prepare("sum")
        ref = {}
        for name, params in ((self.wl.up_name, self.up_params), (self.wl.down_name, self.down_params)):
            loss = self.down(self.up(), name)[name]
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            ref[name] = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
        return ref

    def errors(self, ref: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """Relative L2 error of each group's ``.grad`` against ``ref`` (missing grads count as zero)."""
        return {
            name: rel_error([p.grad for p in params], ref[name])
            for name, params in ((self.wl.up_name, self.up_params), (self.wl.down_name, self.down_params))
        }


def _set_requires_grad(params: list[torch.Tensor], flag: bool) -> None:
    for p in params:
        p.requires_grad_(flag)


def _sum(r: Runner) -> None:
    _, lu, ld = r.forward()
    (lu + ld).backward()


def _seed(r: Runner) -> None:
    _, lu, ld = r.forward()
    lu.backward(inputs=r.up_params)
    ld.backward(inputs=r.down_params)


def _retain_twice(r: Runner) -> None:
    _, lu, ld = r.forward()
    lu.backward(retain_graph=True)
    kept = [p.grad for p in r.up_params]
    r.zero()
    ld.backward()
    for p, g in zip(r.up_params, kept):
        p.grad = g


def _freeze(r: Runner) -> None:
    _, lu, ld = r.forward()
    _set_requires_grad(r.down_params, False)
    try:
        lu.backward(retain_graph=True)
    finally:
        _set_requires_grad(r.down_params, True)
    _set_requires_grad(r.up_params, False)
    try:
        ld.backward()
    finally:
        _set_requires_grad(r.up_params, True)


def _two_forward(r: Runner) -> None:
    up, down = r.wl.up_name, r.wl.down_name
    h = r.up()
    r.down(h.detach(), down)[down].backward()
    _set_requires_grad(r.down_params, False)
    try:
        r.down(h, up)[up].backward()
    finally:
        _set_requires_grad(r.down_params, True)


def _pruned(r: Runner) -> None:
    _, lu, ld = r.forward()
    lu.backward(inputs=r.up_params, retain_graph=True)
    ld.backward(inputs=r.down_params)


def _cut(r: Runner) -> None:
    h, lu, ld = r.forward()
    (g_h,) = torch.autograd.grad(lu, h, retain_graph=True)
    ld.backward(inputs=r.down_params)
    h.backward(g_h, inputs=r.up_params)


def _gradroute(r: Runner) -> None:
    _, lu, ld = r.forward()
    r.router.backward(**{r.wl.up_name: lu, r.wl.down_name: ld})


STRATEGY_FNS: dict[str, Callable[[Runner], None]] = {
    "sum": _sum,
    "seed": _seed,
    "retain_twice": _retain_twice,
    "freeze": _freeze,
    "two_forward": _two_forward,
    "pruned": _pruned,
    "cut": _cut,
    "gradroute": _gradroute,
    "gradroute_ckpt": _gradroute,
    "gradroute_blocks": _gradroute,
    "gradroute_cuts": _gradroute,
}


def crash_text(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:200]


# ---------------------------------------------------------------------------------------------- memory


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak_of_step(r: Runner, strategy: str) -> tuple[float, str]:
    """Peak RSS above the resting state during one step, in bytes, and how it was measured."""
    import resource

    r.zero()
    gc.collect()
    if _reset_hwm():
        base = _proc_status("VmRSS")
        r.step(strategy)
        return max(0.0, _proc_status("VmHWM") - base), "VmHWM-VmRSS"
    # no resettable high-water mark: ru_maxrss, which includes the setup's peak (a lower bound)
    base = _proc_status("VmRSS") if os.path.exists("/proc/self/status") else 0
    r.step(strategy)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return max(0.0, peak - base), "ru_maxrss-VmRSS (lower bound)"


def one(args: argparse.Namespace) -> int:
    """Child process of a CPU run: measure one strategy's peak RSS; print one JSON line."""
    torch.set_num_threads(1)
    wl = _build(args, torch.device("cpu"))
    r = Runner(wl, _dtype(args, torch.device("cpu")))
    strategy = args._one
    r.prepare(strategy)
    r.step(strategy)  # warm-up: lazy initialisation, allocator pools
    peak, method = 0.0, ""
    for _ in range(2):
        p, method = _rss_peak_of_step(r, strategy)
        peak = max(peak, p)
    print(json.dumps({"peak_mib": peak / 2**20, "method": method}))
    return 0


def _child_argv(args: argparse.Namespace, strategy: str) -> list[str]:
    argv = [sys.executable, "-m", "gradroute", "bench", "--_one", strategy, "--workload", args.workload]
    argv += ["--device", "cpu", "--dtype", _dtype(args, torch.device("cpu")), "--seed", str(args.seed)]
    if args.batch_size is not None:
        argv += ["--batch-size", str(args.batch_size)]
    if args.width is not None:
        argv += ["--width", str(args.width)]
    if args.latent_size is not None:
        argv += ["--latent-size", str(args.latent_size)]
    if args.checkpointing:
        argv.append("--checkpointing")
    return argv


def _cpu_peaks(args: argparse.Namespace, strategies: list[str], progress: Any) -> dict[str, Any]:
    env = dict(os.environ)
    # every allocation of 64 KiB or more gets its own mapping, returned to the system when freed, so that
    # the resident set follows the live tensors instead of the allocator's free lists
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env.setdefault("OMP_NUM_THREADS", "1")
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    def run_child(s: str) -> tuple[str, Any]:
        proc = subprocess.run(_child_argv(args, s), env=env, capture_output=True, text=True, check=False)
        progress.update(1, s)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return s, {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
        return s, json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return dict(pool.map(run_child, strategies))


def _cuda_peak(r: Runner, strategy: str) -> float:
    r.prepare(strategy)
    r.zero()
    gc.collect()
    r.sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(r.device)
    base = torch.cuda.memory_allocated(r.device)
    r.step(strategy)
    r.sync()
    return float(torch.cuda.max_memory_allocated(r.device) - base)


# ---------------------------------------------------------------------------------------------- run


def _dtype(args: argparse.Namespace, dev: torch.device) -> str:
    if args.dtype == "auto":
        return "bf16" if dev.type == "cuda" else "fp32"
    return str(args.dtype)


def _build(args: argparse.Namespace, dev: torch.device) -> Workload:
    return build(
        args.workload,
        batch_size=args.batch_size,
        device=dev,
        checkpointing=args.checkpointing,
        seed=args.seed,
        width=args.width,
        latent_size=args.latent_size,
    )


def parse_strategies(spec: str | None, checkpointing: bool = False) -> list[str]:
    """The strategies named by ``--strategies`` (all by default; ``gradroute_ckpt`` needs checkpointing)."""
    import gradroute

    known = list(STRATEGIES)
    if checkpointing and hasattr(gradroute, "checkpoint"):
        known += CKPT_STRATEGIES
    if spec is None:
        return known
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"`--strategies` names no strategy, got {spec!r}")
    for s in names:
        if s in CKPT_STRATEGIES and s not in known:
            raise ValueError(f"`--strategies`: {s!r} needs `--checkpointing`")
        if s not in known:
            raise ValueError(f"`--strategies`: unknown strategy {s!r}; choose from {','.join(known)}")
    return list(dict.fromkeys(names))


def measure(
    r: Runner,
    strategies: list[str],
    *,
    steps: int,
    warmup: int,
    progress: Any = None,
) -> dict[str, dict[str, Any]]:
    """Errors against the reference, then interleaved timing. Returns ``strategy -> result`` (no memory)."""
    progress = progress or Progress(0, "", enabled=False)
    ref = r.reference()
    results: dict[str, dict[str, Any]] = {}
    for s in strategies:
        r.prepare(s)
        r.zero()
        try:
            r.step(s)
            errs = r.errors(ref)
            results[s] = {"err": max(errs.values()), "err_groups": errs}
        except Exception as e:  # a strategy that crashes is a result, not a failure of the bench
            results[s] = {"err": None, "error": crash_text(e)}
        progress.update(1, f"check {s}")
    del ref
    r.zero()
    ok = [s for s in strategies if "error" not in results[s]]
    times: dict[str, list[float]] = {s: [] for s in ok}
    for k in range(warmup + steps):
        for s in ok:
            r.prepare(s)
            r.zero()
            r.sync()
            t0 = time.perf_counter()
            r.step(s)
            r.sync()
            if k >= warmup:
                times[s].append((time.perf_counter() - t0) * 1000)
            progress.update(1, f"{'warm-up' if k < warmup else 'time'} {s}")
    r.zero()
    for s in ok:
        results[s]["ms"] = statistics.median(times[s]) if times[s] else None
        results[s]["ms_min"] = min(times[s]) if times[s] else None
    return results


def run(args: argparse.Namespace) -> int:
    """``gradroute bench``; see ``gradroute bench --help``."""
    if getattr(args, "_one", None):
        return one(args)
    strategies = parse_strategies(args.strategies, args.checkpointing)
    dev = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = _dtype(args, dev)
    if args.steps < 1:
        raise ValueError(f"`--steps` must be >= 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"`--warmup` must be >= 0, got {args.warmup}")
    if dtype != "fp32" and dev.type == "cpu" and dtype == "fp16":
        raise ValueError("`--dtype fp16` needs `--device cuda` (use bf16 or fp32 on CPU)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("`--plot` needs matplotlib (pip install 'gradroute[demo]')") from None
    wl = _build(args, dev)
    r = Runner(wl, dtype)
    groups = [wl.up_name, wl.down_name]
    n_batch = args.batch_size if args.batch_size is not None else DEFAULT_BATCH[wl.name]
    total = len(strategies) * (1 + args.warmup + args.steps) + len(strategies)
    progress = Progress(total, f"bench {wl.name}")
    results = measure(r, strategies, steps=args.steps, warmup=args.warmup, progress=progress)
    ok = [s for s in strategies if "error" not in results[s]]
    if args.no_memory:
        method = "not measured (--no-memory)"
    elif dev.type == "cuda":
        for s in ok:
            results[s]["peak_mib"] = _cuda_peak(r, s) / 2**20
            progress.update(1, f"memory {s}")
        method = "cuda max_memory_allocated"
    else:
        del r, wl
        gc.collect()
        peaks = _cpu_peaks(args, ok, progress)
        how = sorted({str(peaks[s]["method"]) for s in ok if "method" in peaks[s]})
        method = f"peak RSS in a child process per strategy, 1 thread ({', '.join(how)})"
        for s in ok:
            results[s]["peak_mib"] = peaks[s].get("peak_mib")
            if "error" in peaks[s]:
                results[s]["memory_error"] = peaks[s]["error"]
    progress.close()
    for s in strategies:
        results[s].setdefault("ms", None)
        results[s].setdefault("ms_min", None)
        results[s].setdefault("peak_mib", None)
    report = {
        "workload": args.workload,
        "device": _device_name(dev),
        "torch": torch.__version__,
        "batch": n_batch,
        "dtype": dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "checkpointing": bool(args.checkpointing),
        "threads": torch.get_num_threads(),
        "memory": method,
        "groups": groups,
        "results": results,
    }
    report["targets"] = targets(results)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, where the needed strategies ran: ratios and whether each is met."""
    ms = {s: v["ms"] for s, v in results.items() if v.get("ms")}
    out: dict[str, Any] = {}
    g = results.get("gradroute", {})
    if "gradroute" in ms:
        hand = [ms[s] for s in ("pruned", "cut") if s in ms]
        if hand:
            ratio = ms["gradroute"] / min(hand)
            out["time_vs_hand"] = {"ratio": ratio, "target": "<= 1.02", "met": ratio <= 1.02}
        naive = [ms[s] for s in ("retain_twice", "freeze", "two_forward") if s in ms]
        if naive:
            speedup = min(naive) / ms["gradroute"]
            out["speedup_vs_naive"] = {"ratio": speedup, "target": ">= 1.20", "met": speedup >= 1.20}
        peak, floor = g.get("peak_mib"), results.get("sum", {}).get("peak_mib")
        if peak is not None and floor:
            ratio = peak / floor
            out["peak_vs_sum"] = {"ratio": ratio, "target": "<= 1.03", "met": ratio <= 1.03}
        if g.get("err") is not None:
            out["error"] = {"value": g["err"], "target": "<= 1e-5", "met": g["err"] <= 1e-5}
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, ratios to ``sum``."""
    res = report["results"]
    up, down = report["groups"]
    floor = res.get("sum", {})
    lines = [
        f"workload {report['workload']}, device {report['device']}, torch {report['torch']}, "
        f"batch {report['batch']}, dtype {report['dtype']}, {report['steps']} timed steps after "
        f"{report['warmup']} warm-up, checkpointing {'on' if report['checkpointing'] else 'off'}",
        "",
        f"| strategy | rel. grad error {up} / {down} | median ms | min ms | × sum | peak MiB | × sum peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, v in res.items():
        if "error" in v:
            lines.append(f"| {s} | crashes: {v['error'][:90]} | | | | | |")
            continue
        eg = v["err_groups"]
        ratio = v["ms"] / floor["ms"] if v.get("ms") and floor.get("ms") else None
        pratio = v["peak_mib"] / floor["peak_mib"] if v.get("peak_mib") is not None and floor.get("peak_mib") else None
        lines.append(
            f"| {s} | {eg[up]:.1e} / {eg[down]:.1e} | {_fmt(v['ms'], '.1f')} | {_fmt(v['ms_min'], '.1f')} | "
            f"{_fmt(ratio, '.2f')} | {_fmt(v['peak_mib'], '.1f')} | {_fmt(pratio, '.3f')} |"
        )
    t = report.get("targets") or {}
    if t:
        lines.append("")
        names = {
            "time_vs_hand": "gradroute time / faster of pruned, cut",
            "speedup_vs_naive": "fastest of retain_twice, freeze, two_forward / gradroute time",
            "peak_vs_sum": "gradroute peak / sum peak",
            "error": "gradroute max rel. grad error",
        }
        for k, v in t.items():
            val = v.get("ratio", v.get("value"))
            spec = ".1e" if k == "error" else ".3f"
            lines.append(f"- {names[k]}: {val:{spec}} (target {v['target']}: {'met' if v['met'] else 'MISSED'})")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """A PNG with median step time (min as a tick) and peak memory per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.6))
    y = list(range(len(names)))
    colours = ["tab:green" if s.startswith("gradroute") else "tab:grey" if s in INEXACT else "tab:blue" for s in names]
    for ax, key, label in ((axes[0], "ms", "median step time (ms)"), (axes[1], "peak_mib", "peak memory (MiB)")):
        vals = [res[s].get(key) or 0.0 for s in names]
        ax.barh(y, vals, color=colours)
        if key == "ms":
            mins = [res[s].get("ms_min") for s in names]
            ax.scatter([m or 0.0 for m in mins], y, marker="|", color="k", s=120, label="min", zorder=3)
            ax.legend(loc="lower right")
        for k, s in enumerate(names):
            if "error" in res[s]:
                ax.text(0, k, " crashes", va="center", color="tab:red")
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    fig.suptitle(
        f"gradroute bench: {report['workload']}, batch {report['batch']}, {report['dtype']}, {report['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
