"""`gradroute bench` end to end on CPU at tiny sizes: the report, exact strategies, the crash, checkpointing."""

from __future__ import annotations

import json

import pytest
import torch

from gradroute.cli.main import main

TINY_BENCH = ["--batch-size", "2", "--steps", "2", "--warmup", "0", "--device", "cpu"]
EXACT = ("retain_twice", "freeze", "two_forward", "pruned", "cut", "gradroute")
ALL = ("sum", "no_retain", *EXACT)


def test_bench_sd_tiny_json_errors_and_crash(tmp_path, capsys):
    path, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--workload", "sd-tiny", "--width", "8", *TINY_BENCH, "--json", str(path), "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| strategy |" in out and "gradroute" in out
    report = json.loads(path.read_text())
    assert {"workload", "device", "torch", "batch", "results"} <= set(report)
    assert report["workload"] == "sd-tiny" and report["batch"] == 2 and report["torch"] == torch.__version__
    res = report["results"]
    assert tuple(res) == ALL
    for s in (*EXACT, "sum"):
        assert {"err", "ms", "ms_min", "peak_mib"} <= set(res[s]), s
        assert "error" not in res[s], (s, res[s])
        assert res[s]["ms_min"] <= res[s]["ms"]
        assert res[s]["peak_mib"] is not None and res[s]["peak_mib"] >= 0
    for s in EXACT:
        assert res[s]["err"] <= 1e-5, (s, res[s]["err"])
    assert res["sum"]["err"] > 0.1
    assert "backward through the graph a second time" in res["no_retain"]["error"]
    assert res["no_retain"]["err"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("workload", ["gan", "actor-critic"])
def test_bench_other_workloads_route_exactly(workload, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--workload", workload, "--width", "8", *TINY_BENCH, "--no-memory", "--json", str(path)]
    assert main(argv) == 0
    capsys.readouterr()
    res = json.loads(path.read_text())["results"]
    for s in EXACT:
        assert res[s]["err"] <= 1e-5, (s, res[s])
    assert res["sum"]["err"] > 0.1  # each loss leaks into the other network


def test_bench_static_graph_gives_each_gradroute_strategy_a_static_router(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--width", "8", *TINY_BENCH, "--checkpointing", "--static-graph", "--json", str(path)]
    argv += ["--strategies", "pruned,gradroute,gradroute_ckpt", "--steps", "3"]
    assert main(argv) == 0
    capsys.readouterr()
    res = json.loads(path.read_text())["results"]
    for s in ("pruned", "gradroute", "gradroute_ckpt"):
        assert res[s]["err"] <= 1e-5 and res[s]["peak_mib"] is not None, (s, res[s])


def test_bench_checkpointing_on_sd_tiny(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--width", "8", *TINY_BENCH, "--checkpointing", "--no-memory", "--json", str(path)]
    argv += ["--strategies", "sum,pruned,gradroute,gradroute_ckpt"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["checkpointing"] is True
    for s in ("pruned", "gradroute", "gradroute_ckpt"):
        assert report["results"][s]["err"] <= 1e-5, (s, report["results"][s])
    # gradroute.checkpoint segments that both passes enter: the router's measured plan choice ran (untimed)
    # before timing, and the bench says what it kept
    chosen = report["results"]["gradroute_ckpt"]["autotune"]
    assert chosen.startswith("autotune: candidate #") and chosen.count("<- chosen") == 1
    assert "gradroute_ckpt, measured plan choice: #" in out
    # torch's checkpoint: no gradroute.checkpoint segment, one candidate plan (one call per pass would keep the
    # retained pass's activations alive: Autotune(keep_graph=True) only), nothing measured
    assert "autotune" not in report["results"]["gradroute"]


def test_bench_prints_ratios_and_the_bounds_given(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--workload", "gan", "--width", "8", *TINY_BENCH, "--no-memory", "--json", str(path)]
    argv += ["--strategies", "retain_twice,cut,gradroute"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "- gradroute time / faster of pruned, cut: " in out and "target" not in out  # no bound built in
    assert main([*argv, "--targets", "time_vs_hand=1000,speedup_vs_naive=1000,error=1e-5"]) == 0
    out = capsys.readouterr().out
    assert "(target <= 1000: met)" in out and "(target >= 1000: MISSED)" in out and "(target <= 1e-05: met)" in out
    report = json.loads(path.read_text())
    err = report["results"]["gradroute"]["err"]
    assert report["targets"]["error"] == {"value": err, "target": "<= 1e-05", "met": True}
    for s in ("retain_twice", "cut", "gradroute"):
        v = report["results"][s]
        assert v["ms_min"] <= v["ms"] and v["iqr_ms"] >= 0
