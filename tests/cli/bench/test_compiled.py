"""`gradroute bench --compile`: every strategy also through compiled networks, side by side, exact."""

from __future__ import annotations

import json

import torch

from gradroute.cli.main import main

TINY_BENCH = ["--batch-size", "2", "--steps", "1", "--warmup", "1", "--device", "cpu", "--no-memory"]


def test_bench_compile_column(tmp_path, capsys):
    torch._dynamo.reset()
    path = tmp_path / "bench.json"
    argv = ["bench", "--width", "8", *TINY_BENCH, "--strategies", "sum,cut,gradroute", "--compile", "aot_eager"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    torch._dynamo.reset()
    assert "| compiled err | compiled median ms | compiled × sum |" in out
    assert "gradroute.compile(backend='aot_eager')" in out and "pruned per call" in out
    report = json.loads(path.read_text())
    res = report["results"]
    assert tuple(res) == ("sum", "cut", "gradroute")  # the compiled forms are nested, not rows of their own
    for s in ("cut", "gradroute"):
        assert res[s]["compiled"]["err"] <= 1e-5, (s, res[s]["compiled"])
        assert res[s]["compiled"]["ms"] > 0
    assert res["sum"]["compiled"]["err"] > 0.1  # the summed backward leaks, compiled or not
    assert report["compile"]["backend"] == "aot_eager" and report["compile"]["pruned"] is True
    assert report["compile"]["backwards"] == 2 and report["compile"]["variants"] >= 3
    assert "compiled_vs_eager" in report["targets"]


def test_bench_compile_unknown_backend_fails(capsys):
    assert main(["bench", "--compile", "cudagraphs"]) == 2
    assert "invalid choice: 'cudagraphs'" in capsys.readouterr().err
