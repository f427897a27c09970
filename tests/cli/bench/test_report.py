"""The bench report's ratios: each gradroute strategy against the faster hand-written one of the same run, and
the bounds given with ``--targets`` (none built in)."""

from __future__ import annotations

import pytest

from gradroute.cli.bench.report import parse_targets, table, targets


def _row(ms: float) -> dict:
    return {"ms": ms, "ms_min": ms, "err": 0.0, "err_groups": {"a": 0.0, "b": 0.0}, "peak_mib": None}


RESULTS = {
    "sum": _row(8.0),
    "retain_twice": _row(16.0),
    "pruned": _row(10.0),
    "cut": _row(12.0),
    "gradroute": _row(11.0),
    "gradroute_cuts": _row(10.2),
    "gradroute_ckpt": _row(11.5),
}


def _report(t: dict) -> dict:
    return {
        "results": RESULTS,
        "groups": ["a", "b"],
        "workload": "sd-tiny",
        "device": "cpu",
        "torch": "x",
        "batch": 1,
        "dtype": "fp32",
        "steps": 1,
        "warmup": 0,
        "checkpointing": False,
        "targets": t,
    }


def test_every_gradroute_strategy_is_compared_with_the_faster_hand_written_one():
    bounds = {"time_vs_hand": 1.02, "gradroute_cuts_vs_hand": 1.03, "gradroute_ckpt_vs_hand": 1.03}
    t = targets(RESULTS, bounds)
    assert t["time_vs_hand"]["ratio"] == 11.0 / 10.0 and not t["time_vs_hand"]["met"]
    assert t["gradroute_cuts_vs_hand"] == {"ratio": 10.2 / 10.0, "target": "<= 1.03", "met": True}
    assert t["gradroute_ckpt_vs_hand"]["ratio"] == 11.5 / 10.0 and not t["gradroute_ckpt_vs_hand"]["met"]
    text = table(_report(t))
    assert "- gradroute_cuts time / faster of pruned, cut: 1.020 (target <= 1.03: met)" in text
    assert "- gradroute_ckpt time / faster of pruned, cut: 1.150 (target <= 1.03: MISSED)" in text


def test_without_bounds_the_report_gives_ratios_only():
    t = targets(RESULTS)
    assert t["time_vs_hand"] == {"ratio": 11.0 / 10.0}
    assert t["speedup_vs_naive"] == {"ratio": 16.0 / 11.0}
    assert t["error"] == {"value": 0.0}
    text = table(_report(t))
    assert "- gradroute time / faster of pruned, cut: 1.100\n" in text
    assert "target" not in text


@pytest.mark.parametrize(("bound", "met"), [(1.4, True), (1.5, False)])
def test_the_speedup_is_bounded_from_below(bound: float, met: bool):
    t = targets(RESULTS, parse_targets(f"speedup_vs_naive={bound}"))
    assert t["speedup_vs_naive"] == {"ratio": 16.0 / 11.0, "target": f">= {bound}", "met": met}


def test_parse_targets():
    assert parse_targets(None) == {}
    assert parse_targets("time_vs_hand=1.02, error=1e-5") == {"time_vs_hand": 1.02, "error": 1e-5}
    with pytest.raises(ValueError, match="`--targets` takes NAME=BOUND with NAME in time_vs_hand, "):
        parse_targets("time=1.03")
    with pytest.raises(ValueError, match="the bound of 'peak_vs_sum' must be a positive number, got '0'"):
        parse_targets("peak_vs_sum=0")
