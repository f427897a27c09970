"""Peak memory of one step of a strategy, above the resting state.

CUDA: ``max_memory_allocated`` above the allocation at rest. CPU: each strategy in its own process
(``python -m gradroute bench --_one STRATEGY``, one thread), peak RSS above its baseline after a warm-up step,
with the kernel's high-water mark reset through ``/proc/self/clear_refs``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import gradroute

from .runner import Runner


def cuda_peak(r: Runner, strategy: str) -> float:
    """Bytes allocated at the peak of one step above those allocated before it."""
    r.settle(strategy)  # the router's measured plan choice done: the step runs the plan it keeps
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


def cpu_peaks(args: argparse.Namespace, dtype: str, strategies: list[str], progress: Any) -> dict[str, Any]:
    """Per strategy, ``{"peak_mib", "method"}`` from a child process of its own, or ``{"error"}``."""
    return run_children({s: child_argv(args, dtype, s) for s in strategies}, progress)


def child_env() -> dict[str, str]:
    """The environment of a measuring child process."""
    env = dict(os.environ)
    # every allocation of 64 KiB or more gets its own mapping, returned to the system when freed, so that
    # the resident set follows the live tensors instead of the allocator's free lists
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env.setdefault("OMP_NUM_THREADS", "1")
    src = str(Path(os.path.abspath(gradroute.__file__)).parent.parent)  # the child imports this very gradroute
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_children(argvs: dict[str, list[str]], progress: Any) -> dict[str, Any]:
    """Runs each command line (two at a time); per name, the JSON of its last line of output, or ``{"error"}``.
    ``progress`` (a ``tqdm`` bar) advances once per child, from this thread."""
    env = child_env()

    def run_child(s: str) -> tuple[str, Any]:
        proc = subprocess.run(argvs[s], env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return s, {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
        return s, json.loads(proc.stdout.strip().splitlines()[-1])

    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        for s, result in pool.map(run_child, list(argvs)):
            out[s] = result
            progress.set_postfix_str(f"memory {s}", refresh=False)
            progress.update()
    return out


def child_argv(args: argparse.Namespace, dtype: str, strategy: str, device: str = "cpu") -> list[str]:
    """The command line of the child process that measures ``strategy`` (``--_one``) on ``device``."""
    argv = [sys.executable, "-m", "gradroute", "bench", "--_one", strategy, "--workload", args.workload]
    argv += ["--device", device, "--dtype", dtype, "--seed", str(args.seed)]
    if args.batch_size is not None:
        argv += ["--batch-size", str(args.batch_size)]
    if args.width is not None:
        argv += ["--width", str(args.width)]
    if args.latent_size is not None:
        argv += ["--latent-size", str(args.latent_size)]
    if args.checkpointing:
        argv.append("--checkpointing")
    if args.static_graph:
        argv.append("--static-graph")
    return argv


def child(args: argparse.Namespace) -> int:
    """The child process of a CPU run (``--_one STRATEGY``): measure one strategy's peak RSS; print one JSON line."""
    torch.set_num_threads(1)
    r = Runner.from_args(args, torch.device("cpu"))
    strategy = args._one
    r.prepare(strategy)
    r.step(strategy)  # warm-up: lazy initialisation, allocator pools
    r.settle(strategy)  # the router's measured plan choice done: the steps run the plan it keeps
    peak, method = 0.0, ""
    for _ in range(2):
        p, method = _rss_peak_of_step(r, strategy)
        peak = max(peak, p)
    print(json.dumps({"peak_mib": peak / 2**20, "method": method}))
    return 0


def _rss_peak_of_step(r: Runner, strategy: str) -> tuple[float, str]:
    """Peak RSS above the resting state during one step, in bytes, and how it was measured."""
    import resource

    r.zero()
    gc.collect()
    if reset_hwm():
        base = proc_status("VmRSS")
        r.step(strategy)
        return max(0.0, proc_status("VmHWM") - base), "VmHWM-VmRSS"
    # no resettable high-water mark: ru_maxrss, which includes the setup's peak (a lower bound)
    base = proc_status("VmRSS") if os.path.exists("/proc/self/status") else 0
    r.step(strategy)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return max(0.0, peak - base), "ru_maxrss-VmRSS (lower bound)"


def proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
