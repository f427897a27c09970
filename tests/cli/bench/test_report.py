"""The bench report's targets: each gradroute strategy against the faster hand-written one of the same run."""

from __future__ import annotations

from gradroute.cli.bench.report import table, targets


def _row(ms: float) -> dict:
    return {"ms": ms, "ms_min": ms, "err": 0.0, "err_groups": {"a": 0.0, "b": 0.0}, "peak_mib": None}


def test_every_gradroute_strategy_is_compared_with_the_faster_hand_written_one():
    results = {
        "sum": _row(8.0),
        "pruned": _row(10.0),
        "cut": _row(12.0),
        "gradroute": _row(11.0),
        "gradroute_cuts": _row(10.2),
        "gradroute_ckpt": _row(11.5),
    }
    t = targets(results)
    assert t["time_vs_hand"]["ratio"] == 11.0 / 10.0 and not t["time_vs_hand"]["met"]
    assert t["gradroute_cuts_vs_hand"] == {"ratio": 10.2 / 10.0, "target": "<= 1.03", "met": True}
    assert t["gradroute_ckpt_vs_hand"]["ratio"] == 11.5 / 10.0 and not t["gradroute_ckpt_vs_hand"]["met"]
    report = {
        "results": results,
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
    text = table(report)
    assert "- gradroute_cuts time / faster of pruned, cut: 1.020 (target <= 1.03: met)" in text
    assert "- gradroute_ckpt time / faster of pruned, cut: 1.150 (target <= 1.03: MISSED)" in text
