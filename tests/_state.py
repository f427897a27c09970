"""The whole training state of a Router, snapshotted for bit-exact before/after comparisons.

Parameters, every ``.grad``, optimizer state and hyperparameters, schedulers, the scaler's state and the
router's counters and window losses (through ``Router.state_dict()``), each tensor cloned so that later
in-place updates do not change the snapshot.
"""

from __future__ import annotations

from typing import Any

import torch

import gradroute


def clone_tree(x: Any) -> Any:
    """``x`` with every tensor cloned and every container copied."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clone_tree(v) for v in x] if isinstance(x, list) else tuple(clone_tree(v) for v in x)
    return x


def whole_state(router: gradroute.Router) -> dict[str, Any]:
    """Everything a step may change, for :func:`assert_same`."""
    out: dict[str, Any] = {"router": clone_tree(router.state_dict())}
    for name, g in router.groups.items():
        out[name] = {
            "params": [p.detach().clone() for p in g.params],
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in g.params],
            "optimizer": None if g.optimizer is None else clone_tree(g.optimizer.state_dict()),
            "scheduler": None if g.scheduler is None else clone_tree(g.scheduler.state_dict()),
        }
    return out


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """Equal structure, ``torch.equal`` tensors (same dtype too), ``==`` for the rest; the path on failure."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{k}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
