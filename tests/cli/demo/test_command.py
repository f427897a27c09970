"""`gradroute demo` end to end on CPU at tiny sizes: files, the step-0 check, determinism, learning."""

from __future__ import annotations

import json
import math

from gradroute.cli.demo.command import run
from gradroute.cli.main import build_parser, main

TINY_DEMO = ["--steps", "3", "--batch-size", "4", "--width", "8", "--device", "cpu"]


def test_demo_writes_files_and_passes_the_reference_check(tmp_path, capsys):
    assert main(["demo", *TINY_DEMO, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert out.count("gradroute plan:") == 1
    assert "step 0 check against independent forwards" in out and " ok" in out
    assert (tmp_path / "a" / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((tmp_path / "a" / "demo.json").read_text())
    assert report["check"]["passed"] is True
    assert report["check"]["max_rel_err"] <= 1e-5
    assert [r["step"] for r in report["log"]] == [0, 1, 2]
    for row in report["log"]:
        for key in ("loss_tenc", "loss_unet", "grad_norm_tenc", "grad_norm_unet", "lr_tenc", "lr_unet"):
            assert math.isfinite(row[key]), (key, row)
        assert row["skipped_tenc"] is False and row["skipped_unet"] is False
    assert report["hyper"]["tenc"]["lr"] != report["hyper"]["unet"]["lr"]
    assert "gradroute plan:" in report["plan"]


def test_demo_is_deterministic_for_a_seed(tmp_path, capsys):
    logs = []
    for name in ("a", "b"):
        assert main(["demo", *TINY_DEMO, "--steps", "2", "--seed", "3", "--out", str(tmp_path / name)]) == 0
        report = json.loads((tmp_path / name / "demo.json").read_text())
        logs.append([(r["loss_tenc"], r["loss_unet"], r["grad_norm_tenc"], r["grad_norm_unet"]) for r in report["log"]])
    capsys.readouterr()
    assert logs[0] == logs[1]


def test_demo_bf16_autocast_on_cpu(tmp_path, capsys):
    assert main(["demo", *TINY_DEMO, "--steps", "1", "--dtype", "bf16", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["dtype"] == "bf16" and report["check"]["passed"] is True


def test_demo_off_the_main_rank_prints_and_writes_nothing(tmp_path, capsys):
    args = build_parser().parse_args(["demo", *TINY_DEMO, "--steps", "1", "--out", str(tmp_path / "x")])
    assert run(args, is_main=False) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert not (tmp_path / "x").exists()


def test_demo_learns_in_its_default_configuration_scaled_down(tmp_path, capsys):
    # a short run with the default hyper-parameters lowers the held-out losses of both routes
    assert main(["demo", "--steps", "25", "--batch-size", "8", "--width", "8", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    held = json.loads((tmp_path / "demo.json").read_text())["held_out"]
    assert held["after"]["tenc"] < held["before"]["tenc"]
    assert held["after"]["unet"] < held["before"]["unet"]
