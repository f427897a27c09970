"""`gradroute demo` and `gradroute bench` end to end on CPU at tiny sizes, and their argument errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from gradroute.__main__ import main

TINY_DEMO = ["--steps", "3", "--batch-size", "4", "--width", "8", "--device", "cpu"]
TINY_BENCH = ["--batch-size", "2", "--steps", "2", "--warmup", "0", "--device", "cpu"]
EXACT = ("retain_twice", "freeze", "two_forward", "pruned", "cut", "gradroute")
ALL = ("sum", "seed", *EXACT)


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------------------------- demo


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
    from gradroute.__main__ import build_parser
    from gradroute._demo import run

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


# ---------------------------------------------------------------------------------------------- bench


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
    assert "backward through the graph a second time" in res["seed"]["error"]
    assert res["seed"]["err"] is None
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


def test_bench_checkpointing_on_sd_tiny(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--width", "8", *TINY_BENCH, "--checkpointing", "--no-memory", "--json", str(path)]
    argv += ["--strategies", "sum,pruned,gradroute,gradroute_ckpt"]
    assert main(argv) == 0
    capsys.readouterr()
    report = json.loads(path.read_text())
    assert report["checkpointing"] is True
    for s in ("pruned", "gradroute", "gradroute_ckpt"):
        assert report["results"][s]["err"] <= 1e-5, (s, report["results"][s])


def test_bench_runs_as_a_module():
    # the CPU memory measurement re-runs `python -m gradroute bench --_one ...`: the entry point must work
    proc = subprocess.run(
        [sys.executable, "-m", "gradroute", "bench", "--workload", "gan", "--width", "8", "--batch-size", "2",
         "--_one", "gradroute"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"] >= 0


def test_sd15_without_diffusers_fails_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "diffusers", None)
    assert main(["bench", "--workload", "sd15", "--device", "cpu", "--no-memory"]) == 2
    assert "needs diffusers and transformers" in one_line_error(capsys)


def test_sd15_tiny_configuration_routes_exactly():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from gradroute._bench import Runner, measure
    from gradroute._workloads import build

    runner = Runner(build("sd15", batch_size=1, size="tiny"), "fp32")
    res = measure(runner, ["sum", "seed", "pruned", "gradroute"], steps=1, warmup=0)
    assert res["gradroute"]["err"] <= 1e-5 and res["pruned"]["err"] <= 1e-5
    assert res["sum"]["err"] > 0.1
    assert "error" in res["seed"]


def test_sd15_latent_size_sets_the_latents_and_still_routes_exactly():
    from gradroute._bench import Runner, measure
    from gradroute._workloads import build

    wl = build("sd15", batch_size=1, size="tiny", latent_size=8)
    assert wl.batch["noisy"].shape == (1, 4, 8, 8) and wl.info["latent_size"] == 8
    res = measure(Runner(wl, "fp32"), ["gradroute"], steps=1, warmup=0)
    assert res["gradroute"]["err"] <= 1e-5


# ---------------------------------------------------------------------------------------------- argument errors


def test_no_command_fails(capsys):
    assert main([]) == 2
    assert "required" in one_line_error(capsys)


def test_demo_zero_steps_fails(capsys):
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps" in one_line_error(capsys)


def test_demo_non_integer_batch_size_fails(capsys):
    assert main(["demo", "--batch-size", "many"]) == 2
    assert "'many'" in one_line_error(capsys)


def test_demo_unknown_device_fails(capsys, tmp_path):
    assert main(["demo", "--device", "tpu", "--out", str(tmp_path)]) == 2
    assert "`--device`" in one_line_error(capsys)


def test_demo_width_not_multiple_of_8_fails(capsys, tmp_path):
    assert main(["demo", "--width", "12", "--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "`width` must be a positive multiple of 8" in one_line_error(capsys)


def test_demo_out_is_a_file_fails(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert main(["demo", "--out", str(f), "--device", "cpu"]) == 2
    assert "`--out` must be a directory" in one_line_error(capsys)


def test_demo_unknown_flag_fails(capsys):
    assert main(["demo", "--bogus"]) == 2
    assert "--bogus" in one_line_error(capsys)


def test_bench_unknown_workload_fails(capsys):
    assert main(["bench", "--workload", "nope"]) == 2
    assert "'nope'" in one_line_error(capsys)


def test_bench_unknown_strategy_fails(capsys):
    assert main(["bench", "--strategies", "sum,bogus", "--device", "cpu"]) == 2
    assert "'bogus'" in one_line_error(capsys)


def test_bench_gradroute_ckpt_without_checkpointing_fails(capsys):
    assert main(["bench", "--strategies", "gradroute_ckpt", "--device", "cpu"]) == 2
    assert "needs `--checkpointing`" in one_line_error(capsys)


def test_bench_checkpointing_on_gan_fails(capsys):
    assert main(["bench", "--workload", "gan", "--checkpointing", "--device", "cpu"]) == 2
    assert "`--checkpointing`" in one_line_error(capsys)


def test_bench_fp16_on_cpu_fails(capsys):
    assert main(["bench", "--dtype", "fp16", "--device", "cpu"]) == 2
    assert "`--dtype fp16`" in one_line_error(capsys)


def test_bench_negative_warmup_fails(capsys):
    assert main(["bench", "--warmup", "-1"]) == 2
    assert "--warmup" in one_line_error(capsys)


def test_help_exits_zero(capsys):
    assert main(["bench", "--help"]) == 0
    assert "--strategies" in capsys.readouterr().out


@pytest.mark.parametrize("strategy", ["gradroute_ckpt", "gradroute_blocks", "gradroute_cuts"])
def test_sd15_tiny_checkpointing_strategies_route_exactly(strategy):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from gradroute._bench import Runner, measure
    from gradroute._workloads import build

    runner = Runner(build("sd15", batch_size=1, size="tiny", checkpointing=True), "fp32")
    res = measure(runner, ["sum", "cut", strategy, "gradroute"], steps=1, warmup=0)
    for s in ("cut", strategy, "gradroute"):
        assert res[s]["err"] <= 1e-5, (s, res[s])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "gan", "--latent-size", "16"], "`--latent-size` applies to sd15, not 'gan'"),
        (["--workload", "sd15", "--latent-size", "12"], "`--latent-size` must be a positive multiple of 8, got 12"),
    ],
)
def test_bench_bad_latent_size_fails(capsys, argv, message):
    assert main(["bench", *argv, "--device", "cpu", "--no-memory"]) == 2
    assert message in one_line_error(capsys)
