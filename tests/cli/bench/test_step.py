"""`gradroute bench --step`: the whole training iteration, the router's loop against the hand-written one."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from gradroute.cli.bench.loops import make_loop
from gradroute.cli.bench.step_report import parse_targets
from gradroute.cli.main import main
from gradroute.cli.workloads import build

TINY = ["--width", "8", "--batch-size", "2", "--steps", "2", "--warmup", "1", "--device", "cpu"]


def _loops(workload: str, scaler: bool):
    return [
        make_loop(name, build(workload, batch_size=2, device="cpu", width=8), "fp32", scaler=scaler)
        for name in ("hand_cut", "gradroute")
    ]


@pytest.mark.parametrize("workload", ["sd-tiny", "gan"])
@pytest.mark.parametrize("scaler", [False, True])
def test_both_loops_train_the_same_parameters(workload: str, scaler: bool) -> None:
    # torch's AMP recipe for several optimizers, written out by hand, is the reference of the router's loop
    hand, routed = _loops(workload, scaler)
    before = [p.detach().clone() for ps in hand.params for p in ps]
    for _ in range(3):
        hand.iterate()
        routed.iterate()
    got = [p.detach() for ps in routed.params for p in ps]
    want = [p.detach() for ps in hand.params for p in ps]
    # the step is there to check: three AdamW steps moved every trained parameter
    assert all(not torch.equal(w, b) for w, b in zip(want, before))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    if scaler:
        assert routed.scaler.get_scale() == hand.scaler.get_scale()
    for opt_r, opt_h in zip(routed.optimizers, hand.optimizers):
        assert [g["lr"] for g in opt_r.param_groups] == [g["lr"] for g in opt_h.param_groups]
    assert all(p.grad is None for loop in (hand, routed) for ps in loop.params for p in ps)


@pytest.mark.parametrize("name", ["hand_cut", "gradroute"])
def test_the_losses_stay_referenced_until_the_next_forward(name: str) -> None:
    loop = make_loop(name, build("gan", batch_size=2, device="cpu", width=8), "fp32", scaler=False)
    loop.iterate()
    loss = weakref.ref(loop.held[1])
    gc.collect()
    assert loss() is not None  # the iteration is over: the loop still holds it, as `loss = ...` does
    alive = []  # during the next forward too: `loss` is rebound only once it has returned
    loop.wl.up_module.register_forward_hook(lambda *_: alive.append(loss() is not None))
    loop.wl.down_module.register_forward_hook(lambda *_: alive.append(loss() is not None))
    loop.forward()
    gc.collect()
    assert alive and all(alive) and loss() is None


@pytest.mark.parametrize("workload", ["sd-tiny", "gan"])
def test_bench_step_prints_both_loops(workload: str, tmp_path, capsys) -> None:
    path = tmp_path / "step.json"
    memory = [] if workload == "sd-tiny" else ["--no-memory"]  # the memory children once, on one workload
    argv = ["bench", "--step", "--workload", workload, *TINY, *memory, "--json", str(path)]
    assert main([*argv, "--targets", "time=1.05,peak=1.01"]) == 0
    out = capsys.readouterr().out
    assert "| hand_cut |" in out and "| gradroute |" in out and "rel. param diff" in out
    assert "- gradroute / hand_cut, iteration time (median): " in out and "(target <= 1.05: " in out
    report = json.loads(path.read_text())
    res = report["results"]
    assert tuple(res) == ("hand_cut", "gradroute")
    assert report["setup"]["optimizer"] == "AdamW (fused)" and report["setup"]["scaler"] is False
    for v in res.values():
        assert v["ms"] > 0 and v["iqr_ms"] >= 0
        assert v["param_diff"] <= 1e-6  # both loops trained the same iterations on the same batch
    assert report["targets"]["time"]["target"] == "<= 1.05"
    if workload == "sd-tiny":
        assert all(v["peak_mib"] > 0 and v["peak_mib"] >= v["rest_mib"] for v in res.values()), res
        assert report["targets"]["peak"]["target"] == "<= 1.01"
        assert "(target <= 1.01: " in out
    else:
        assert all(v["peak_mib"] is None for v in res.values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--step", "--compile", "aot_eager"], "`--compile` does not apply to `--step`"),
        (["--step", "--strategies", "sum"], "`--strategies` does not apply to `--step`"),
        # the ratios of --step are not those of the plain bench
        (["--targets", "time=1.03"], "`--targets` takes NAME=BOUND with NAME in time_vs_hand, "),
        (["--step", "--targets", "speed=1.03"], "`--targets` takes NAME=BOUND"),
        (["--step", "--targets", "time=-1"], "the bound of 'time' must be a positive number, got '-1'"),
    ],
)
def test_bench_step_refuses_what_does_not_apply(extra: list[str], message: str, capsys) -> None:
    assert main(["bench", "--workload", "gan", *TINY, *extra]) == 2
    assert message in capsys.readouterr().err


def test_parse_targets() -> None:
    assert parse_targets(None) == {}
    assert parse_targets("time=1.03, peak=1.01") == {"time": 1.03, "peak": 1.01}
    with pytest.raises(ValueError, match="`--targets`"):
        parse_targets("time")
