"""The demo's step-0 check: the routed gradients against independent forwards and ``torch.autograd.grad``."""

from __future__ import annotations

from typing import Any

import torch

from ..common import autocast, rel_error
from ..models import forward_losses

#: maximum relative error of the step-0 check, by precision
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}


def reference(
    tenc: torch.nn.Module, unet: torch.nn.Module, batch: dict[str, Any], dev: torch.device, dtype: str, scaler: Any
) -> dict[str, list[torch.Tensor]]:
    """Independent gradients: a fresh forward per loss and ``torch.autograd.grad`` (scaled like the run)."""
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    ref = {}
    for k, (name, module) in enumerate((("tenc", tenc), ("unet", unet))):
        with autocast(dev, dtype):
            loss = forward_losses(tenc, unet, batch)[k]
        params = [p for p in module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
        ref[name] = [torch.zeros_like(p) if g is None else g / scale for p, g in zip(params, grads)]
    return ref


def check(router: Any, ref: dict[str, list[torch.Tensor]], scaler: Any, dtype: str) -> dict[str, Any]:
    """The router's ``.grad`` (unscaled) against ``ref``: the relative error per group, the worst, and whether
    it is within ``TOLERANCE[dtype]``."""
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    errs = {}
    for name, grads in ref.items():
        params = router.groups[name].params
        errs[name] = rel_error([None if p.grad is None else p.grad / scale for p in params], grads)
    worst = max(errs.values())
    tol = TOLERANCE[dtype]
    return {"max_rel_err": worst, **errs, "tolerance": tol, "passed": bool(worst <= tol)}
