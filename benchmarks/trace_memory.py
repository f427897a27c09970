"""Peak live tensor bytes of one step, traced op by op: summed backward against the routed one.

The bench's CPU memory column is the process's resident set; this counts the bytes of the tensors alive after
every aten op (a ``TorchDispatchMode``), so it says where a peak happens and what is alive there.

    python benchmarks/trace_memory.py                      # sd-tiny with checkpointing, gradroute.checkpoint
    python benchmarks/trace_memory.py --chunk 40           # the planner's chunk size (``_plan._CHUNK``)
    python benchmarks/trace_memory.py --no-checkpointing
"""

from __future__ import annotations

import argparse
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import gradroute
from gradroute import _plan, _workloads


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made under the mode and still alive; the peak and the op it happened in."""

    def __init__(self) -> None:
        super().__init__()
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
            key = storage.data_ptr()
            if key and key not in self.live:
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def trace(routed: bool, checkpointing: bool, kind: str) -> tuple[float, float, str, int]:
    """(bytes alive after the forward, peak, where, engine calls) in MiB, of the second of two steps."""
    wl = _workloads.build("sd-tiny", checkpointing=checkpointing)
    if checkpointing and wl.set_checkpoint is not None:
        wl.set_checkpoint(kind if routed else "torch")
    router = gradroute.Router(**wl.groups)
    calls = 0
    for _ in range(2):
        with LiveBytes() as mode:
            _, losses = wl.forward()
            after_forward = mode.now
            if routed:
                calls = len(router.plan(**losses).calls)
                router.backward(**losses)
            else:
                (losses[wl.up_name] + losses[wl.down_name]).backward()
            del losses
        for module in wl.groups.values():
            module.zero_grad(set_to_none=True)
    return after_forward / 2**20, mode.peak / 2**20, mode.at, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument(
        "--kind", choices=("gradroute", "blocks", "torch"), default="gradroute", help="routed step's checkpoint"
    )
    p.add_argument("--chunk", type=int, default=None, help=f"nodes per chunk (default {_plan._CHUNK})")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.chunk is not None:
        _plan._CHUNK = args.chunk
    ckpt = not args.no_checkpointing
    for routed in (False, True):
        fwd, peak, at, calls = trace(routed, ckpt, args.kind)
        name = f"gradroute ({args.kind if ckpt else 'no checkpointing'})" if routed else "sum"
        extra = f", {calls} engine calls" if routed else ""
        print(f"{name}: {fwd:.2f} MiB after the forward, peak {peak:.2f} MiB at {at}{extra}")


if __name__ == "__main__":
    main()
