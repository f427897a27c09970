"""Peak live tensor bytes of one step, traced op by op: summed backward against the routed one.

The bench's CPU memory column is the process's resident set; this counts the bytes of the tensors alive after
every aten op (a ``TorchDispatchMode``), so it says where a peak happens and what is alive there. Parameters'
own storages are not counted (a weight's transpose is a view of it); gradients are.

    python benchmarks/trace_memory.py                      # sd-tiny with checkpointing, gradroute.checkpoint
    python benchmarks/trace_memory.py --chunk 40           # the planner's chunk size (``PlanOptions.chunk``)
    python benchmarks/trace_memory.py --no-checkpointing
    python benchmarks/trace_memory.py --workload sd15 --device meta --batch-size 32 --kind gradroute,cuts,blocks
    python benchmarks/trace_memory.py --workload sd15 --device meta --batch-size 8 --no-checkpointing --iteration
    python benchmarks/trace_memory.py --workload gan --iteration          # gan: whole iterations only

``--iteration`` traces whole training iterations instead (``gradroute bench --step``'s loops: forward, backward,
two AdamW with clipping and schedulers, zero_grad), the router's loop against the hand-written one, from the
first iteration on, so that the optimizers' state (allocated on ``meta`` by their first step) counts; the peak
is that of the iteration after two warm-up iterations and the router's measured plan choice, whose forward
runs while the previous iteration's boundary and losses are still referenced. A
loop that raises (on ``meta``: a step that reads a value on the host) is reported, not a failure.

On the ``meta`` device nothing is computed, only shapes: the full SD-1.5 architecture at a GPU's batch traces
in seconds. Attention then goes through the fused kernel a GPU would take (``F.scaled_dot_product_attention``
is pointed at aten's flash kernel, or the memory-efficient one where there is a mask), so no attention matrix
is materialised; everything is fp32 (no autocast on ``meta``), which doubles the activations against a bf16
run while the gradients stay fp32, so the routed/summed ratio is, if anything, pessimistic.

Each line also gives the step's arithmetic (``torch.utils.flop_counter``: matrix products, convolutions and
attention, forward, recomputations and backward) against the first kind's: what a GPU-bound batch's time
ratio approaches, not a measurement of time.
"""

from __future__ import annotations

import argparse
import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

import gradroute
from gradroute.cli.bench.loops import make_loop
from gradroute.cli.bench.step_report import parse_targets
from gradroute.cli.choices import CHECKPOINTING
from gradroute.cli.workloads import Workload, build


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made under the mode and still alive; the peak and the op it happened in."""

    def __init__(self, skip: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.skip = skip
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.at = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map(self._track, out)
        if self.now > self.peak:
            node = torch._C._current_autograd_node()
            self.peak, self.at = self.now, f"{func} in {node.name() if node is not None else 'forward'}"
        return out

    def _track(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself: meta storages have no data pointer
            if key not in self.live and key not in self.skip:
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # type: ignore[no-untyped-def]
    if _LOW[0] is not None:  # autocast casts attention's inputs too
        q, k, v = (t.to(_LOW[0]) for t in (q, k, v))
        attn_mask = attn_mask.to(_LOW[0]) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    bias = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, False, dropout_p, is_causal, scale=scale
    )[0]


_LOW: list[torch.dtype | None] = [None]  # the emulated autocast's dtype while it is on


@contextlib.contextmanager
def emulated_autocast(dtype: torch.dtype) -> Iterator[None]:
    """CUDA autocast's casts, above autograd like the real ones, for the ``meta`` device (which has none).

    ``torch.nn.functional``'s linear and convolutions (and attention, in :func:`_fused_sdpa`) run in ``dtype``,
    its norms, softmax and MSE loss in fp32, everything else as its inputs come (type promotion): patched
    module functions, not a mode, so that checkpoints' recomputations inside the backward see them too. Not
    emulated: autocast's cache of the weights' casts, which keeps one low-precision copy of every weight
    until the forward's autocast region ends (about 1.8 GiB in bf16 for SD-1.5, in the forward only).
    """
    patched = {name: getattr(F, name) for name in (*_LOWER, *_FP32)}

    def cast_to(to: torch.dtype, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = tree_map(lambda a: _cast(a, to), (args, kwargs))
            return fn(*args, **kwargs)

        return run

    for name, fn in patched.items():
        setattr(F, name, cast_to(dtype if name in _LOWER else torch.float32, fn))
    _LOW[0] = dtype
    try:
        yield
    finally:
        _LOW[0] = None
        for name, fn in patched.items():
            setattr(F, name, fn)


_LOWER = ("linear", "conv1d", "conv2d", "conv3d")
_FP32 = ("layer_norm", "group_norm", "softmax", "log_softmax", "mse_loss")


def _cast(a: Any, dtype: torch.dtype) -> Any:
    if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype:
        return a.to(dtype)
    return a


@contextlib.contextmanager
def fused_attention(on: bool) -> Iterator[None]:
    original = F.scaled_dot_product_attention
    if on:
        F.scaled_dot_product_attention = _fused_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def trace(
    wl: Workload,
    kind: str,
    autocast: torch.dtype | None = None,
    options: gradroute.PlanOptions | None = None,
) -> tuple[float, float, str, int, int]:
    """(bytes alive after the forward, peak, where, engine calls, FLOPs), bytes in MiB, of the second of two steps.

    ``kind``: the checkpoint (``gradroute``, ``cuts``, ``blocks``, ``torch``; ignored without checkpointing) of a routed
    step, or with a ``sum:`` prefix of one backward of the summed losses (``sum`` alone: ``sum:torch``).
    """
    routed = not kind.startswith("sum")
    if wl.set_checkpoint is not None:
        wl.set_checkpoint(kind.partition(":")[2] or "torch" if not routed else kind)
    params = {p.untyped_storage()._cdata for m in wl.groups.values() for p in m.parameters()}
    router = gradroute.Router(**wl.groups, plan_options=options)

    def step(live: LiveBytes | None = None) -> int:
        with emulated_autocast(autocast) if autocast is not None else contextlib.nullcontext():
            return _step(live)

    def _step(live: LiveBytes | None) -> int:
        _, losses = wl.forward()
        after_forward = live.now if live is not None else 0
        if routed:
            router.backward(**losses)
        else:
            (losses[wl.up_name] + losses[wl.down_name]).backward()
        for module in wl.groups.values():
            module.zero_grad(set_to_none=True)
        return after_forward

    calls = len(router.plan(**wl.forward()[1]).calls) if routed else 0
    with FlopCounterMode(display=False) as flops:  # a step of its own: the counter changes what stays alive
        step()
    for _ in range(2):
        with LiveBytes(params) as mode:
            after_forward = step(mode)
    return after_forward / 2**20, mode.peak / 2**20, mode.at, calls, flops.get_total_flops()


def trace_iteration(
    wl: Workload, name: str, kind: str, autocast: torch.dtype | None = None
) -> tuple[float, float, str]:
    """(bytes alive between two iterations, peak of the next iteration, where), bytes in MiB, of the loop
    ``name`` of ``gradroute bench --step`` (``hand_cut`` or ``gradroute``), traced from its first iteration on.

    ``kind``: the router's checkpoint (``gradroute``, ``cuts``, ``blocks``, ``torch``; ignored without
    checkpointing); the hand-written loop uses ``torch.utils.checkpoint``.
    """
    if wl.set_checkpoint is not None:
        wl.set_checkpoint(kind if name == "gradroute" else "torch")
    params = {p.untyped_storage()._cdata for m in wl.groups.values() for p in m.parameters()}
    loop = make_loop(name, wl, "fp32", scaler=False)  # no GradScaler on meta; --autocast emulates bf16/fp16
    amp = emulated_autocast(autocast) if autocast is not None else contextlib.nullcontext()
    with amp, LiveBytes(params) as mode:
        for _ in range(2):
            loop.iterate()
        loop.settle()  # the router's measured plan choice done, as in the bench
        loop.iterate()  # (the iteration that ends the choice still holds some of its tensors afterwards)
        rest = mode.now
        mode.peak, mode.at = mode.now, "rest"
        loop.iterate()
    chosen = loop.chosen()
    return rest / 2**20, mode.peak / 2**20, mode.at + (f"; measured plan choice: {chosen}" if chosen else "")


def iterations(wl: Workload, kinds: list[str], autocast: torch.dtype | None, bound: float | None) -> None:
    """Prints the whole-iteration trace of the hand-written loop, then of the router's loop for every kind."""
    hand = None
    for name, kind in [("hand_cut", "torch"), *(("gradroute", k) for k in kinds)]:
        label = name if name == "hand_cut" or wl.set_checkpoint is None else f"{name} ({kind})"
        try:
            rest, peak, at = trace_iteration(wl, name, kind, autocast)
        except Exception as e:  # a loop that fails is a result
            print(f"{label}: crashes: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}")
            continue
        hand = peak if name == "hand_cut" else hand
        ratio = "" if hand is None or name == "hand_cut" else f" ({peak / hand:.3f}x hand_cut"
        if ratio and bound is not None:
            ratio += f"; target <= {bound}: {'met' if peak / hand <= bound else 'MISSED'}"
        print(f"{label}: {rest:.2f} MiB between iterations, peak {peak:.2f} MiB{ratio + ')' if ratio else ''} at {at}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("sd-tiny", "sd15", "gan"), default="sd-tiny", help="gan: --iteration only")
    p.add_argument("--width", type=int, default=None, help="sd-tiny, gan: the model width (default per workload)")
    p.add_argument("--device", default="cpu", help="cpu (default) or meta (shapes only)")
    p.add_argument("--batch-size", type=int, default=None, help="default per workload")
    p.add_argument("--latent-size", type=int, default=None, help="sd15: latent height and width (default 64)")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument(
        "--kind",
        default="gradroute",
        help="comma-separated: a routed step's checkpoint (gradroute, cuts, blocks, torch) or sum:<checkpoint>; the "
        "first is the reference (sum:torch is put first unless a sum: comes first)",
    )
    p.add_argument("--chunk", type=int, default=None, help=f"nodes per chunk (default {gradroute.PlanOptions.chunk})")
    p.add_argument(
        "--autocast",
        choices=("bf16", "fp16"),
        default=None,
        help="emulate CUDA autocast in the forward and the recomputations (emulated_autocast; default: fp32)",
    )
    p.add_argument(
        "--iteration",
        action="store_true",
        help="trace whole training iterations with AdamW state, the router's loop against the hand-written one",
    )
    p.add_argument("--targets", default=None, help="with --iteration: peak=BOUND, printed next to the ratio")
    args = p.parse_args()
    torch.set_num_threads(1)
    options = gradroute.PlanOptions() if args.chunk is None else gradroute.PlanOptions(chunk=args.chunk)
    ckpt = not args.no_checkpointing and args.workload in CHECKPOINTING
    if args.workload == "gan" and not args.iteration:
        p.error("--workload gan needs --iteration")
    wl = build(
        args.workload,
        batch_size=args.batch_size,
        device=args.device,
        checkpointing=ckpt,
        latent_size=args.latent_size,
        width=args.width,
    )
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast or "")
    if args.iteration:
        bound = parse_targets(args.targets).get("peak")
        kinds = [k for k in args.kind.split(",") if not k.startswith("sum")] or ["gradroute"]
        with fused_attention(args.device == "meta"):
            iterations(wl, kinds if ckpt else ["gradroute"], low, bound)
        return
    with fused_attention(args.device == "meta"):
        kinds = args.kind.split(",") if ckpt else ["gradroute"]
        kinds = kinds if kinds[0].startswith("sum") else ["sum", *kinds]
        floor = work = None
        for kind in kinds:
            fwd, peak, at, calls, flops = trace(wl, kind, low, options)
            floor, work = floor or peak, work or flops
            name = kind if kind.startswith("sum") else f"gradroute ({kind if ckpt else 'no checkpointing'})"
            extra = "" if kind.startswith("sum") else f", {calls} engine calls"
            ratio = f"{peak / floor:.3f}x {kinds[0]}"
            arithmetic = f"{flops / 1e12:.2f} TFLOP ({flops / work:.3f}x)"
            print(
                f"{name}: {fwd:.2f} MiB after the forward, peak {peak:.2f} MiB ({ratio}) at {at}{extra}; {arithmetic}"
            )


if __name__ == "__main__":
    main()
