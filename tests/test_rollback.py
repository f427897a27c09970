"""A failed ``router.step()`` leaves everything as before, the exception unchanged, and a retry steps once.

Faults are injected where user code runs inside a step: a group's ``grad_hook``, its optimizer (before and
after it has updated), its scheduler; as an ordinary exception and as a ``KeyboardInterrupt``. Each test
compares the whole state (parameters, every ``.grad``, optimizer state, schedulers, scaler, counters) before
and after with ``torch.equal``, then checks that the retried run is bit-identical to a run that never failed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from tests._state import assert_same, whole_state


class FaultyAdamW(torch.optim.AdamW):
    """AdamW that raises the queued exceptions, before its update or (``after_update``) once it is applied."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.faults: list[BaseException] = []
        self.after_update = False

    def step(self, closure: Any = None) -> Any:
        if self.faults and not self.after_update:
            raise self.faults.pop()
        out = super().step(closure)
        if self.faults:
            raise self.faults.pop()
        return out


class Run:
    """Two chained layers, AdamW + a LambdaLR schedule + clipping each, hooks that reweight in place."""

    def __init__(self, *, scaler: bool, accumulate: int = 1, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.faults: dict[str, list[BaseException]] = {"hook_a": [], "hook_b": [], "sched_b": []}
        self.opts = {n: FaultyAdamW(m.parameters(), lr=0.05) for n, m in (("a", self.a), ("b", self.b))}
        groups = {
            n: gradroute.Group(
                m,
                optimizer=self.opts[n],
                scheduler=torch.optim.lr_scheduler.LambdaLR(self.opts[n], self._schedule(n)),
                max_grad_norm=0.5,
                grad_hook=self._hook(n),
            )
            for n, m in (("a", self.a), ("b", self.b))
        }
        self.router = gradroute.Router(
            groups,
            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1) if scaler else None,
            accumulate=accumulate,
        )
        self.batch = 0

    def _hook(self, name: str) -> Any:
        def hook(params: Any) -> None:
            for p in params:
                p.grad.mul_(0.5)  # changes the gradients in place before it fails: the undo must see it
            if self.faults[f"hook_{name}"]:
                raise self.faults[f"hook_{name}"].pop()

        return hook

    def _schedule(self, name: str) -> Any:
        def factor(step: int) -> float:
            if name == "b" and self.faults["sched_b"]:
                raise self.faults["sched_b"].pop()
            return 1.0 / (1 + step)

        return factor

    def backward(self) -> None:
        g = torch.Generator().manual_seed(self.batch)
        self.batch += 1
        x = torch.randn(4, 3, generator=g)
        out = self.b(torch.tanh(self.a(x)))
        self.router.backward(a=out.pow(2).mean(), b=(out - 1).abs().mean())

    def inject(self, fault: str, exc: BaseException) -> None:
        if fault.startswith("optimizer_b"):
            self.opts["b"].faults.append(exc)
            self.opts["b"].after_update = fault.endswith("after_update")
        else:
            self.faults[fault].append(exc)


FAULTS = ["hook_a", "hook_b", "optimizer_b", "optimizer_b_after_update", "sched_b"]


@pytest.mark.parametrize("interrupt", [False, True])
@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("fault", FAULTS)
def test_failed_step_changes_nothing_and_a_retry_steps_once(fault: str, scaler: bool, interrupt: bool) -> None:
    run, ref = Run(scaler=scaler), Run(scaler=scaler)
    for r in (run, ref):  # one clean step first: optimizer states, schedules and the scale are not fresh
        r.backward()
        r.router.step()
        r.backward()
    before = whole_state(run.router)
    exc: BaseException = KeyboardInterrupt() if interrupt else RuntimeError("transient")
    run.inject(fault, exc)
    with pytest.raises(type(exc)) as info:
        run.router.step()
    assert info.value is exc  # propagated unchanged
    assert_same(before, whole_state(run.router))

    assert run.router.step() == ref.router.step()  # the retry steps every group once
    for r in (run, ref):
        r.backward()
    assert run.router.step() == ref.router.step()
    assert_same(whole_state(ref.router), whole_state(run.router))


@pytest.mark.parametrize("scaler", [False, True])
def test_after_a_failed_step_zero_grad_and_a_new_backward_train_on(scaler: bool) -> None:
    """The issue's first report: with a GradScaler, every later step() refused the scaler's stage."""
    run, ref = Run(scaler=scaler, accumulate=2), Run(scaler=scaler, accumulate=2)
    run.backward()
    run.router.step()
    run.backward()
    run.inject("hook_a", RuntimeError("transient"))
    with pytest.raises(RuntimeError, match="transient"):
        run.router.step()
    run.router.zero_grad()
    run.batch = ref.batch = 10
    for _ in range(3):  # the window restarts; ref never saw the failed one
        for r in (run, ref):
            for _ in range(2):
                r.backward()
                stats = r.router.step()
            assert not stats.accumulating
    assert_same(whole_state(ref.router), whole_state(run.router))


def test_without_atomic_step_the_scaler_and_counters_are_still_put_back() -> None:
    run = Run(scaler=True)
    run.router = gradroute.Router(
        {n: g for n, g in run.router.groups.items()},
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8),
        atomic_step=False,
    )
    run.backward()
    scale = run.router.state_dict()["scaler"]
    run.inject("optimizer_b", RuntimeError("once"))
    with pytest.raises(RuntimeError, match="once"):
        run.router.step()
    sd = run.router.state_dict()
    assert sd["scaler"] == scale and sd["steps"] == 0 and sd["backward_pending"]
    run.router.step()  # the scaler accepts the retry
    assert run.router.state_dict()["steps"] == 1


@pytest.mark.parametrize("value", [1, "yes", None])
@pytest.mark.parametrize("arg", ["atomic_step", "skip_nonfinite"])
def test_step_flag_not_a_bool_fails(arg: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"`{arg}` must be True or False, got {type(value).__name__}"):
        gradroute.Router(a=nn.Linear(2, 2), **{arg: value})
