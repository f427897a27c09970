"""The checks of what a router call is given: names from a mapping and from keywords, and each loss a real
floating-point scalar that requires grad. (Merging groups routed the same loss is ``_losses.py``'s job.)"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch


def merge_named(mapping: Any, named: Mapping[str, Any], arg: str, item: str, shape: str, call: str) -> dict[str, Any]:
    """``mapping`` (positional) and ``named`` (keywords) as one dict; a name given in both is an error."""
    out: dict[str, Any] = {}
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise TypeError(
                f"`{arg}` must be a mapping of {shape}, got {type(mapping).__name__} "
                f"(call {call}(name=..., ...) or {call}({{'name': ...}}))"
            )
        out.update(mapping)
    for name, value in named.items():
        if name in out:
            raise ValueError(f"{item} `{name}` is given twice (in `{arg}` and as a keyword)")
        out[name] = value
    return out


def checked_losses(
    losses: Any, named: Mapping[str, Any], what: str, groups: Collection[str]
) -> dict[str, tuple[torch.Tensor, ...]]:
    """``group name -> loss tensors`` of a ``Router.backward``/``grads``/``plan`` call (``what``): every name one of
    ``groups``, every loss a scalar tensor or a non-empty list of them; ValueError/TypeError naming the group and
    what was received, raised before anything is touched."""
    given = merge_named(losses, named, "losses", "loss for group", "group name -> loss", what)
    if not given:
        raise ValueError(f"`{what}` needs at least one loss, e.g. {what}(tenc=loss_tenc)")
    out = {}
    for name, value in given.items():
        if name not in groups:
            raise ValueError(f"unknown group `{name}`; groups are: {', '.join(groups)}")
        out[name] = _loss_tensors(name, value)
    return out


def _loss_tensors(name: str, value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        tensors: tuple[torch.Tensor, ...] = (value,)
    elif isinstance(value, (list, tuple)):
        tensors = tuple(value)
        if not tensors:
            raise ValueError(f"loss for group `{name}` is an empty {type(value).__name__}")
    else:
        raise TypeError(
            f"loss for group `{name}` must be a scalar Tensor or a list of them, got {type(value).__name__}"
        )
    for k, t in enumerate(tensors):
        label = f"loss for group `{name}`" + (f" (item {k})" if len(tensors) > 1 else "")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must be a Tensor, got {type(t).__name__}")
        if t.numel() != 1:
            raise ValueError(f"{label} must be a scalar, got shape {tuple(t.shape)} (reduce it, e.g. .mean())")
        if not t.is_floating_point():
            raise TypeError(
                f"{label} must be a real floating-point scalar, got dtype {t.dtype} (a backward needs a "
                "real loss: take .abs() or .real of a complex one)"
            )
        if not t.requires_grad:
            raise ValueError(
                f"{label} does not require grad: it was computed without autograd "
                "(under torch.no_grad(), from detached tensors, or from frozen parameters)"
            )
    return tensors
