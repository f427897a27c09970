"""The bench's report: the fields it starts with, the ratios of one run (against bounds given on the command
line, if any), and the Markdown table."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import torch

from ..choices import CKPT_STRATEGIES
from .compiled import cells, compiled_vs_eager, header


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


#: the ratios of one run that ``--targets`` may bound: name -> (what it is, the comparison a bound makes)
RATIOS: dict[str, tuple[str, str]] = {
    "time_vs_hand": ("gradroute time / faster of pruned, cut", "<="),
    **{f"{s}_vs_hand": (f"{s} time / faster of pruned, cut", "<=") for s in CKPT_STRATEGIES},
    "speedup_vs_naive": ("fastest of retain_twice, freeze, two_forward / gradroute time", ">="),
    "peak_vs_sum": ("gradroute peak / sum peak", "<="),
    "error": ("gradroute max rel. grad error", "<="),
    "compiled_vs_eager": ("(gradroute / sum) compiled over (gradroute / sum) eager", "<="),
}


def parse_bounds(spec: str | None, names: Collection[str]) -> dict[str, float]:
    """``--targets``: ``"a=1.03,b=1.01"`` -> ``{"a": 1.03, "b": 1.01}``, each name one of ``names``.

    Raises:
        ValueError: an unknown name, a value that is not a positive number, or an empty specification.
    """
    if spec is None:
        return {}
    out: dict[str, float] = {}
    for item in (s.strip() for s in spec.split(",")):
        name, sep, value = item.partition("=")
        if name not in names or not sep:
            raise ValueError(f"`--targets` takes NAME=BOUND with NAME in {', '.join(names)}, got {item!r}")
        try:
            bound = float(value)
        except ValueError:
            bound = float("nan")
        if not bound > 0:
            raise ValueError(f"`--targets`: the bound of {name!r} must be a positive number, got {value!r}")
        out[name] = bound
    return out


def bounded(value: float, op: str, bound: float | None) -> dict[str, Any]:
    """``{"target", "met"}`` of ``value`` against ``bound`` (``op``: ``"<="`` or ``">="``); empty without one."""
    if bound is None:
        return {}
    return {"target": f"{op} {bound:g}", "met": value <= bound if op == "<=" else value >= bound}


def parse_targets(spec: str | None) -> dict[str, float]:
    """``gradroute bench --targets``: bounds on :data:`RATIOS` (see :func:`parse_bounds`)."""
    return parse_bounds(spec, RATIOS)


def targets(results: dict[str, dict[str, Any]], bounds: dict[str, float] | None = None) -> dict[str, Any]:
    """The ratios of :data:`RATIOS` whose strategies ran: ``{"ratio"}`` (``{"value"}`` for ``error``), with
    ``{"target", "met"}`` where ``bounds`` has one."""
    bounds = bounds or {}
    out: dict[str, Any] = {}
    for name, value in _ratios(results).items():
        key = "value" if name == "error" else "ratio"
        out[name] = {key: value, **bounded(value, RATIOS[name][1], bounds.get(name))}
    return out


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The ratios of :data:`RATIOS` that the strategies which ran give."""
    ms = {s: v["ms"] for s, v in results.items() if v.get("ms")}
    g = results.get("gradroute", {})
    if "gradroute" not in ms:
        return {}
    out: dict[str, float] = {}
    hand = [ms[s] for s in ("pruned", "cut") if s in ms]
    if hand:
        out["time_vs_hand"] = ms["gradroute"] / min(hand)
        out.update({f"{s}_vs_hand": ms[s] / min(hand) for s in CKPT_STRATEGIES if s in ms})
    naive = [ms[s] for s in ("retain_twice", "freeze", "two_forward") if s in ms]
    if naive:
        out["speedup_vs_naive"] = min(naive) / ms["gradroute"]
    peak, floor = g.get("peak_mib"), results.get("sum", {}).get("peak_mib")
    if peak is not None and floor:
        out["peak_vs_sum"] = peak / floor
    if g.get("err") is not None:
        out["error"] = g["err"]
    compiled = compiled_vs_eager(results)
    if compiled is not None:
        out["compiled_vs_eager"] = compiled
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, ratios to ``sum``, then the ratios of :data:`RATIOS` (and their bounds)."""
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
            bound = f" (target {v['target']}: {'met' if v['met'] else 'MISSED'})" if "target" in v else ""
            lines.append(f"- {RATIOS[k][0]}: {val:{'.1e' if k == 'error' else '.3f'}}{bound}")
    chosen = {s: v["autotune"] for s, v in res.items() if v.get("autotune")}
    if chosen:  # the router's measured plan choice (Router(autotune=...)), run untimed before timing
        lines.append("")
        for s, note in chosen.items():
            row = next((r.strip() for r in note.splitlines() if "<- chosen" in r), note.splitlines()[0])
            lines.append(f"- {s}, measured plan choice: {row.replace(' <- chosen', '')}")
    return "\n".join(lines)
