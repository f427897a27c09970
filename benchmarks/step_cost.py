"""The training step's cost: ``router.step()`` (default, ``atomic_step="copy"``, ``False``) against the hand loop.

    python benchmarks/step_cost.py [--width 1024] [--layers 12] [--batch 32] [--rounds 30] [--fused]
        [--strategies hand,default,copy,none]

Twelve ``Linear(width, width)`` layers in a chain, the first half one group (``tenc``), the second the other
(``unet``), each with its own AdamW and ``max_grad_norm=1.0``; one loss per group on one forward. Per iteration
the strategies take turns (round ``k`` starts ``k`` places further down the list), each doing its forward and
backward untimed, then its step timed with the calling thread's CPU time (one torch thread: the step runs
there; other processes on a shared machine do not inflate it):

* ``hand``: ``torch.autograd.grad`` per loss into ``.grad``; the step is ``clip_grad_norm_`` per group,
  ``opt.step()`` per group, ``.grad = None``;
* ``default`` / ``copy`` / ``none``: ``router.backward``; the step is ``router.step()`` with ``atomic_step``
  ``True`` / ``"copy"`` / ``False``.

Reported per strategy: the median step time and its ratio to ``hand``; the median time inside the optimizers'
own ``step()`` calls and the minor page faults during them (``getrusage(RUSAGE_THREAD)``); and the peak of the
tensor bytes alive during one step above those alive before it (parameters, gradients, optimizer state), in
units of the parameters' bytes, measured in separate untimed steps with a dispatch mode that follows every
tensor storage the step allocates or frees.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import gradroute

STRATEGIES = ("hand", "default", "copy", "none")


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages alive (those registered, and every one an op makes), and their peak."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in tensors:
            self._add(t)
        self.base = self.peak = self.live()

    def _add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            self.refs.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))

    def live(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            self._add(t)
        self.peak = max(self.peak, self.live())
        return out


class Timed:
    """Wraps an optimizer's ``step`` to add up the thread CPU time and minor page faults inside it."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.seconds, self.faults, self._step = 0.0, 0, opt.step
        opt.step = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        f0, t0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time()
        out = self._step(*args, **kwargs)
        self.seconds += time.thread_time() - t0
        self.faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
        return out


class Setup:
    def __init__(self, strategy: str, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
        half = args.layers // 2
        self.tenc, self.unet = nn.Sequential(*layers[:half]), nn.Sequential(*layers[half:])
        kw = {"lr": 1e-4, "fused": True} if args.fused else {"lr": 1e-4}
        self.opts = [torch.optim.AdamW(m.parameters(), **kw) for m in (self.tenc, self.unet)]
        self.timed = [Timed(o) for o in self.opts]
        self.strategy, self.batch = strategy, args.batch
        self.router = None
        if strategy != "hand":
            atomic = {"default": True, "copy": "copy", "none": False}[strategy]
            self.router = gradroute.Router(
                tenc=gradroute.Group(self.tenc, optimizer=self.opts[0], max_grad_norm=1.0),
                unet=gradroute.Group(self.unet, optimizer=self.opts[1], max_grad_norm=1.0),
                atomic_step=atomic,
            )

    def params(self) -> list[torch.Tensor]:
        return [*self.tenc.parameters(), *self.unet.parameters()]

    def backward(self, k: int) -> None:
        x = torch.randn(self.batch, self.tenc[0].in_features, generator=torch.Generator().manual_seed(k))
        out = self.unet(torch.tanh(self.tenc(x)))
        loss_t, loss_u = out.pow(2).mean(), (out - 1).abs().mean()
        if self.router is not None:
            self.router.backward(tenc=loss_t, unet=loss_u)
            return
        pt, pu = list(self.tenc.parameters()), list(self.unet.parameters())
        for p, g in zip(pt, torch.autograd.grad(loss_t, pt, retain_graph=True), strict=True):
            p.grad = g
        for p, g in zip(pu, torch.autograd.grad(loss_u, pu), strict=True):
            p.grad = g

    def step(self) -> None:
        if self.router is not None:
            self.router.step()
            return
        for m, opt in zip((self.tenc, self.unet), self.opts, strict=True):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        for p in self.params():
            p.grad = None

    def state(self) -> list[torch.Tensor]:
        out = [*self.params(), *(p.grad for p in self.params() if p.grad is not None)]
        for opt in self.opts:
            out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return out


def measure(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    strategies = tuple(args.strategies.split(","))
    setups = {s: Setup(s, args) for s in strategies}
    param_bytes = sum(p.numel() * p.element_size() for p in setups["hand"].params())
    for s in setups.values():  # warm up: the optimizers' state exists from here on
        for k in range(2):
            s.backward(k)
            s.step()
    peaks = {}
    for name, s in setups.items():
        s.backward(2)
        with LiveBytes(s.state()) as mode:
            s.step()
        peaks[name] = (mode.peak - mode.base) / param_bytes
    times: dict[str, list[float]] = {s: [] for s in strategies}
    opt_times: dict[str, list[float]] = {s: [] for s in strategies}
    faults: dict[str, list[int]] = {s: [] for s in strategies}
    for r in range(args.rounds):
        order = strategies[r % len(strategies) :] + strategies[: r % len(strategies)]
        for name in order:
            s = setups[name]
            s.backward(3 + r)
            for t in s.timed:
                t.seconds, t.faults = 0.0, 0
            t0 = time.thread_time()
            s.step()
            times[name].append(time.thread_time() - t0)
            opt_times[name].append(sum(t.seconds for t in s.timed))
            faults[name].append(sum(t.faults for t in s.timed))
    hand, hand_opt = statistics.median(times["hand"]), statistics.median(opt_times["hand"])
    print(
        f"torch {torch.__version__}, {args.layers} x Linear({args.width}), batch {args.batch}, AdamW"
        f"{' fused' if args.fused else ''}, {args.rounds} rounds, 1 thread; parameters {param_bytes / 2**20:.0f} MiB"
    )
    print(f"{'strategy':>9} {'step ms':>8} {'ratio':>6} {'opt ms':>7} {'ratio':>6} {'faults':>7} {'peak/params':>12}")
    for name in strategies:
        t, o = statistics.median(times[name]), statistics.median(opt_times[name])
        f = statistics.median(faults[name])
        print(
            f"{name:>9} {t * 1e3:8.2f} {t / hand:6.2f} {o * 1e3:7.2f} {o / hand_opt:6.2f} {f:7.0f} {peaks[name]:+12.2f}"
        )


def main(argv: list[str] | None = None, run: Callable[[argparse.Namespace], None] = measure) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="hand (first), default, copy, none")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
