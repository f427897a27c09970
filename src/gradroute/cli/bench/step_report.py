"""``gradroute bench --step``'s report: ratios to the hand-written loop, bounds given on the command line, and
the Markdown table."""

from __future__ import annotations

from typing import Any

from .report import bounded, parse_bounds

#: what ``--targets`` may bound: the router's loop over the hand-written one
RATIOS = {"time": ("ms", "iteration time (median)"), "peak": ("peak_mib", "whole-iteration peak memory")}


def parse_targets(spec: str | None) -> dict[str, float]:
    """``--step --targets``: ``"time=1.03,peak=1.01"`` -> ``{"time": 1.03, "peak": 1.01}`` (upper bounds on the
    ratios of :data:`RATIOS`; see :func:`gradroute.cli.bench.report.parse_bounds`)."""
    return parse_bounds(spec, RATIOS)


def step_targets(results: dict[str, dict[str, Any]], bounds: dict[str, float]) -> dict[str, Any]:
    """Per ratio of ``RATIOS`` that both loops have: ``{"ratio"}``, with ``{"target", "met"}`` where bounded."""
    out: dict[str, Any] = {}
    for name, (key, _) in RATIOS.items():
        mine, hand = results.get("gradroute", {}).get(key), results.get("hand_cut", {}).get(key)
        if mine is None or not hand:
            continue
        ratio = mine / hand
        out[name] = {"ratio": ratio, **bounded(ratio, "<=", bounds.get(name))}
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def step_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table with ratios to ``hand_cut``, then the ratios (and their bounds, if any)."""
    res, setup = report["results"], report["setup"]
    hand = res["hand_cut"]
    scaler = "one GradScaler" if setup["scaler"] else "no GradScaler"
    lines = [
        f"whole training iteration, workload {report['workload']}, device {report['device']}, torch "
        f"{report['torch']}, batch {report['batch']}, dtype {report['dtype']}, checkpointing "
        f"{'on' if report['checkpointing'] else 'off'}",
        f"two {setup['optimizer']}, warmup_power schedulers, max_grad_norm {setup['max_grad_norm']}, {scaler}; "
        f"{report['steps']} timed iterations per loop after {report['warmup']} warm-up, round robin "
        f"({report['settle']} untimed before them: the measured plan choice)",
        f"memory: {report['memory']}",
        "",
        "| loop | median ms | IQR ms | × hand_cut | peak MiB | × hand_cut peak | rest MiB | rel. param diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in res.items():
        t = v["ms"] / hand["ms"] if hand.get("ms") else None
        p = v["peak_mib"] / hand["peak_mib"] if v.get("peak_mib") is not None and hand.get("peak_mib") else None
        lines.append(
            f"| {name} | {_fmt(v['ms'], '.2f')} | {_fmt(v['iqr_ms'], '.2f')} | {_fmt(t, '.3f')} | "
            f"{_fmt(v.get('peak_mib'), '.1f')} | {_fmt(p, '.3f')} | {_fmt(v.get('rest_mib'), '.1f')} | "
            f"{v['param_diff']:.1e} |"
        )
    errors = {name: v["memory_error"] for name, v in res.items() if v.get("memory_error")}
    targets = report.get("targets") or {}
    chosen = [(what, res["gradroute"].get(key)) for what, key in (("timed", "autotune"), ("memory", "memory_autotune"))]
    chosen = [(what, c) for what, c in chosen if c]
    if errors or targets or chosen:
        lines.append("")
    lines += [f"- {name}: memory not measured: {e}" for name, e in errors.items()]
    # the router's measured plan choice, made in each process: the timed loop's and the memory child's
    lines += [f"- gradroute, measured plan choice ({what}): {c}" for what, c in chosen]
    for name, t in targets.items():
        bound = f" (target {t['target']}: {'met' if t['met'] else 'MISSED'})" if "target" in t else ""
        lines.append(f"- gradroute / hand_cut, {RATIOS[name][1]}: {t['ratio']:.3f}{bound}")
    return "\n".join(lines)
