"""A failed ``router.step()`` leaves everything as before, the exception unchanged, and a retry steps once.

Faults are injected where user code runs inside a step: a group's ``grad_hook``, its optimizer (before and
after it has updated), its scheduler; as an ordinary exception and as a ``KeyboardInterrupt``. Each test
compares the whole state (parameters, every ``.grad``, optimizer state, schedulers, scaler, counters) before
and after with ``torch.equal``, then checks that the retried run is bit-identical to a run that never failed.

``atomic_step="copy"`` undoes every fault; the default (by ordering, NOTE [Atomic step]) undoes the
faults of the first part (hooks) exactly, holds a real Ctrl-C (SIGINT) until the step ends, and documents that
an optimizer or scheduler raising inside its own ``step()`` is not undone.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from tests._state import assert_same, whole_state
from tests._step_setup import Setup, backward_again


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
    """Two chained layers, AdamW + a LambdaLR schedule + clipping each, hooks that reweight in place.

    ``scaler``: a GradScaler (``True``; ``"other"``: a scale that is not a power of two), none (``False``), or
    none with ``skip_nonfinite=True`` (``"skip_nonfinite"``: a fused AdamW then skips on the device).
    """

    def __init__(
        self,
        *,
        scaler: bool | str,
        accumulate: int = 1,
        seed: int = 0,
        atomic_step: bool | str = True,
        hooks: str = "ab",
        fused: bool = False,
    ) -> None:
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.faults: dict[str, list[BaseException]] = {"hook_a": [], "hook_b": [], "sched_b": []}
        self.opts = {n: FaultyAdamW(m.parameters(), lr=0.05, fused=fused) for n, m in (("a", self.a), ("b", self.b))}
        groups = {
            n: gradroute.Group(
                m,
                optimizer=self.opts[n],
                scheduler=torch.optim.lr_scheduler.LambdaLR(self.opts[n], self._schedule(n)),
                max_grad_norm=0.5,
                grad_hook=self._hook(n) if n in hooks else None,
            )
            for n, m in (("a", self.a), ("b", self.b))
        }
        # "other": a scale that is not a power of two (an unscale is then not undone by multiplying)
        kwargs = {"init_scale": 1000.0, "growth_factor": 1.5} if scaler == "other" else {"init_scale": 2.0**8}
        self.router = gradroute.Router(
            groups,
            scaler=torch.amp.GradScaler("cpu", growth_interval=1, **kwargs) if scaler in (True, "other") else None,
            accumulate=accumulate,
            atomic_step=atomic_step,
            skip_nonfinite=scaler == "skip_nonfinite",
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


PREPARE_FAULTS = ["hook_a", "hook_b"]  # the first part of a step: undone by the default too
APPLY_FAULTS = ["optimizer_b", "optimizer_b_after_update", "sched_b"]  # inside an optimizer's/scheduler's step
# (atomic_step, fault, groups with a grad_hook, fused AdamW: skips on the device)
CASES = (
    [("copy", f, "ab", False) for f in PREPARE_FAULTS + APPLY_FAULTS]
    + [("copy", f, "ab", True) for f in APPLY_FAULTS]
    + [(True, f, hooks, fused) for f in PREPARE_FAULTS for hooks in ("ab", f[-1]) for fused in (False, True)]
)


@pytest.mark.parametrize("interrupt", [False, True])
@pytest.mark.parametrize("scaler", [False, "skip_nonfinite", True, "other"])
@pytest.mark.parametrize(("atomic_step", "fault", "hooks", "fused"), CASES)
def test_failed_step_changes_nothing_and_a_retry_steps_once(
    atomic_step: bool | str, fault: str, hooks: str, fused: bool, scaler: bool | str, interrupt: bool
) -> None:
    run = Run(scaler=scaler, atomic_step=atomic_step, hooks=hooks, fused=fused)
    ref = Run(scaler=scaler, atomic_step=atomic_step, hooks=hooks, fused=fused)
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


def _counters(router: gradroute.Router) -> dict[str, Any]:
    sd = router.state_dict()
    return {k: sd[k] for k in ("micro_step", "steps", "backward_pending", "losses", "scaler")}


@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("fault", APPLY_FAULTS)
def test_default_step_raising_inside_an_optimizer_or_scheduler_keeps_its_updates_and_trains_on(
    fault: str, scaler: bool
) -> None:
    """NOTE [Atomic step] rule 4: not undone, the groups stepped before keep their update, the
    scaler and counters are put back, and after zero_grad() training goes on."""
    run = Run(scaler=scaler)
    run.backward()
    run.router.step()
    run.backward()
    before, a_before = _counters(run.router), [p.detach().clone() for p in run.a.parameters()]
    exc = RuntimeError("inside")
    run.inject(fault, exc)
    with pytest.raises(RuntimeError) as info:
        run.router.step()
    assert info.value is exc
    assert_same(before, _counters(run.router))
    assert not any(torch.equal(x, p) for x, p in zip(a_before, run.a.parameters(), strict=True))  # a stepped
    run.router.zero_grad()
    run.backward()
    assert not run.router.step().accumulating
    assert run.router.state_dict()["steps"] == 2


class SignallingAdamW(torch.optim.AdamW):
    """AdamW that sends this process a SIGINT (a Ctrl-C) from inside its step, once."""

    signal_once = False

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        if self.signal_once:
            self.signal_once = False
            os.kill(os.getpid(), signal.SIGINT)
        return out


@pytest.mark.parametrize("atomic_step", [True, "copy", False])
def test_ctrl_c_inside_the_step_is_held_until_the_step_has_finished(atomic_step: bool | str) -> None:
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        a, b = nn.Linear(3, 3), nn.Linear(3, 3)
        opts = [SignallingAdamW(m.parameters(), lr=0.1) for m in (a, b)]
        router = gradroute.Router(
            a=gradroute.Group(a, optimizer=opts[0], max_grad_norm=0.5),
            b=gradroute.Group(b, optimizer=opts[1]),
            atomic_step=atomic_step,
        )
        out = b(torch.tanh(a(torch.ones(2, 3))))
        router.backward(a=out.pow(2).mean(), b=out.abs().mean())
        runs.append((router, opts))
    (run, opts), (ref, _) = runs
    opts[0].signal_once = True  # between the two groups' optimizer steps
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        run.step()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ref.step()
    assert_same(whole_state(ref), whole_state(run))  # the step finished: both groups stepped, counted, zeroed


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
    run = Run(scaler=True, atomic_step=False)
    run.backward()
    scale = run.router.state_dict()["scaler"]
    run.inject("optimizer_b", RuntimeError("once"))
    with pytest.raises(RuntimeError, match="once"):
        run.router.step()
    sd = run.router.state_dict()
    assert sd["scaler"] == scale and sd["steps"] == 0 and sd["backward_pending"]
    run.router.step()  # the scaler accepts the retry
    assert run.router.state_dict()["steps"] == 1


def test_load_state_dict_refused_halfway_by_an_optimizer_changes_nothing() -> None:
    class Refusing(torch.optim.SGD):
        def load_state_dict(self, state_dict: Any) -> None:
            raise RuntimeError("refused")

    s = Setup("sgd", "fp32")
    router = s.router()
    backward_again(s, router)
    router.step()
    backward_again(s, router)
    saved = router.state_dict()
    router.step()
    backward_again(s, router)  # the optimizer states and gradients differ from the saved ones
    router.groups["unet"].optimizer.__class__ = Refusing  # after tenc's optimizer has loaded
    before = whole_state(router)
    with pytest.raises(RuntimeError, match="refused"):
        router.load_state_dict(saved)
    assert_same(before, whole_state(router))
