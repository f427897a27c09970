"""The bench's timing: the strategies take turns step by step, the statistics are torch.utils.benchmark's."""

from __future__ import annotations

import statistics

import pytest

from gradroute.cli.bench.measure import round_robin


class _Bar:
    """Records what a tqdm bar is told: the text shown at each update."""

    def __init__(self) -> None:
        self.postfix, self.shown = "", []

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def update(self, n: int = 1) -> None:
        self.shown += [self.postfix] * n


@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("steps", [1, 4])
def test_round_robin_interleaves_and_summarises_the_timed_runs(warmup: int, steps: int) -> None:
    names = ["a", "b", "c"]
    calls: list[str] = []
    seconds = {"a": [], "b": [], "c": []}  # what each run returned, in order

    def run(name: str) -> float:
        calls.append(name)
        t = 0.001 * (len(calls) ** 1.5 % 7 + 1)  # distinct, unsorted durations
        seconds[name].append(t)
        return t

    bar = _Bar()
    got = round_robin(run, names, steps=steps, warmup=warmup, progress=bar, label="test")
    assert calls == names * (warmup + steps)  # one run of each name per turn, in the given order
    assert bar.shown == [f"warm-up {n}" for n in names] * warmup + [f"time {n}" for n in names] * steps
    assert list(got) == names
    for name, m in got.items():
        timed = seconds[name][warmup:]
        assert m.times == timed and m.task_spec.stmt == name and m.label == "test"
        assert m.median == pytest.approx(statistics.median(timed), rel=1e-12)
        if steps > 1:
            q1, _, q3 = statistics.quantiles(timed, n=4, method="inclusive")
            assert m.iqr == pytest.approx(q3 - q1, rel=1e-9, abs=1e-15)
