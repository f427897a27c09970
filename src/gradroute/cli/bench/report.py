"""The bench's results against the targets of issues 4 and 17, and as a Markdown table."""

from __future__ import annotations

import os
from typing import Any

import torch

from .compiled import cells, header, target


def device_name(dev: torch.device) -> str:
    """The device, for the report: the GPU's name, or the CPU's cores and torch threads."""
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def run_fields(args: Any, dev: torch.device, n_batch: int, dtype: str, memory: str) -> dict[str, Any]:
    """The fields every bench report starts with: what ran, where, and how memory was measured."""
    return {
        "workload": args.workload,
        "device": device_name(dev),
        "torch": torch.__version__,
        "batch": n_batch,
        "dtype": dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "checkpointing": bool(args.checkpointing),
        "threads": torch.get_num_threads(),
        "memory": memory,
    }


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
            for s in ms:  # the other gradroute strategies, against issue 17's target
                if s.startswith("gradroute_"):
                    ratio = ms[s] / min(hand)
                    out[f"{s}_vs_hand"] = {"ratio": ratio, "target": "<= 1.03", "met": ratio <= 1.03}
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
        compiled = target(results)
        if compiled is not None:
            out["compiled_vs_eager"] = compiled
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


_TARGET_NAMES = {
    "time_vs_hand": "gradroute time / faster of pruned, cut",
    "speedup_vs_naive": "fastest of retain_twice, freeze, two_forward / gradroute time",
    "peak_vs_sum": "gradroute peak / sum peak",
    "error": "gradroute max rel. grad error",
    "compiled_vs_eager": "(gradroute / sum) compiled over (gradroute / sum) eager",
}


def _target_name(key: str) -> str:
    if key.endswith("_vs_hand") and key != "time_vs_hand":
        return f"{key.removesuffix('_vs_hand')} time / faster of pruned, cut"
    return _TARGET_NAMES[key]


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, ratios to ``sum``, then the targets."""
    res = report["results"]
    up, down = report["groups"]
    floor = res.get("sum", {})
    compiled = report.get("compile")
    head, sep, what = header(compiled)
    lines = [
        f"workload {report['workload']}, device {report['device']}, torch {report['torch']}, "
        f"batch {report['batch']}, dtype {report['dtype']}, {report['steps']} timed steps after "
        f"{report['warmup']} warm-up, checkpointing {'on' if report['checkpointing'] else 'off'}",
        *([what] if what else []),
        "",
        f"| strategy | rel. grad error {up} / {down} | median ms | min ms | × sum | peak MiB | × sum peak |{head}",
        f"|---|---|---|---|---|---|---|{sep}",
    ]
    for s, v in res.items():
        if "error" in v:
            lines.append(f"| {s} | crashes: {v['error'][:90]} | | | | | |{cells(v, floor, compiled)}")
            continue
        eg = v["err_groups"]
        ratio = v["ms"] / floor["ms"] if v.get("ms") and floor.get("ms") else None
        pratio = v["peak_mib"] / floor["peak_mib"] if v.get("peak_mib") is not None and floor.get("peak_mib") else None
        lines.append(
            f"| {s} | {eg[up]:.1e} / {eg[down]:.1e} | {_fmt(v['ms'], '.1f')} | {_fmt(v['ms_min'], '.1f')} | "
            f"{_fmt(ratio, '.2f')} | {_fmt(v['peak_mib'], '.1f')} | {_fmt(pratio, '.3f')} |" + cells(v, floor, compiled)
        )
    t = report.get("targets") or {}
    if t:
        lines.append("")
        for k, v in t.items():
            val = v.get("ratio", v.get("value"))
            spec = ".1e" if k == "error" else ".3f"
            lines.append(f"- {_target_name(k)}: {val:{spec}} (target {v['target']}: {'met' if v['met'] else 'MISSED'})")
    chosen = {s: v["autotune"] for s, v in res.items() if v.get("autotune")}
    if chosen:  # the router's measured plan choice (Router(autotune=...)), run untimed before timing
        lines.append("")
        for s, note in chosen.items():
            row = next((r.strip() for r in note.splitlines() if "<- chosen" in r), note.splitlines()[0])
            lines.append(f"- {s}, measured plan choice: {row.replace(' <- chosen', '')}")
    return "\n".join(lines)
