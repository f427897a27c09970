"""`gradroute` argument errors: one line on stderr, exit code 2, no traceback; `--help` exits 0."""

from __future__ import annotations

import sys

import pytest

from gradroute.cli.main import main


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


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


def test_sd15_without_diffusers_fails_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "diffusers", None)
    assert main(["bench", "--workload", "sd15", "--device", "cpu", "--no-memory"]) == 2
    assert "needs diffusers and transformers" in one_line_error(capsys)
