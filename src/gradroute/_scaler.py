"""The one place that reads or writes a ``torch.amp.GradScaler``'s private state.

``router.step()`` needs three things the GradScaler API does not offer: whether ``scaler.step`` will skip an
optimizer (the record ``unscale_`` left), which stage of its iteration the scaler is in for an optimizer (so a
step can be refused before anything is touched), and a way to put the scaler back exactly as it was when a
step fails half-way (``unscale_`` and ``update`` change it in place, and a scaler left with an optimizer in
stage UNSCALED refuses every later iteration). Everything here goes through :class:`Scaler`, and the private
attributes themselves through ``_compat``; when a torch version lacks one, the adapter falls back to what the
public API can tell.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import (
    found_inf,
    found_inf_tensor,
    scale_init,
    scale_tensors,
    scale_uninitialised,
    scaler_states,
    set_scaler_states,
)


@dataclass(frozen=True)
class ScalerSnapshot:
    """What :meth:`Scaler.snapshot` saved: the public state (or copies of the scale and growth tracker
    tensors, taken without a host sync), and the per-optimizer records of the iteration."""

    public: dict[str, Any] | None
    per_optimizer: dict[int, dict[str, Any]] | None
    tensors: tuple[torch.Tensor, torch.Tensor] | None = None


def _power_of_two(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5


class Scaler:
    """A GradScaler (or None) seen through the few questions ``router.step()`` asks of it.

    Args:
        scaler: a ``torch.amp.GradScaler``, anything with its methods, or None.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    @property
    def enabled(self) -> bool:
        """Whether losses are scaled and gradients unscaled (a scaler given and enabled)."""
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def used_stage(self, optimizer: Any) -> str | None:
        """The name of the stage ``optimizer`` is in this iteration (``"UNSCALED"``, ``"STEPPED"``), or None if
        the scaler has not touched it since its last ``update()``."""
        states = scaler_states(self.scaler)
        state = states.get(id(optimizer)) if states is not None else None
        if not state:
            return None
        stage = state.get("stage")
        name = getattr(stage, "name", None)
        return None if name in (None, "READY") else str(name)

    def found_inf(self, optimizer: Any, params: list[torch.Tensor]) -> bool:
        """Whether ``scaler.step(optimizer)`` will skip it: what ``unscale_`` recorded for ``optimizer``.

        ``GradScaler._found_inf_per_device`` is what ``scaler.step`` itself sums; without it, the unscaled
        gradients of ``params`` are checked.
        """
        skipped = found_inf(self.scaler, optimizer)
        if skipped is not None:
            return skipped
        return not all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)

    def found_inf_tensor(self, optimizer: Any, params: list[torch.Tensor]) -> torch.Tensor | bool:
        """What :meth:`found_inf` tells, as the tensor ``unscale_`` recorded (no host sync); a bool where the
        record is not there (then read from the gradients, with a sync)."""
        record = found_inf_tensor(self.scaler, optimizer)
        return record if record is not None else self.found_inf(optimizer, params)

    def scale_tensor(self) -> torch.Tensor | float | None:
        """A copy of the current scale, on its device (no host sync); None without an enabled scaler."""
        if not self.enabled:
            return None
        tensors = scale_tensors(self.scaler)
        if tensors is None:
            return float(self.scaler.get_scale())
        return tensors[0].detach().clone()

    def unscale_is_exact(self) -> bool:
        """Whether the scale is always a power of two (the scale it starts from, or was loaded with, and its
        growth and backoff factors are), so that multiplying unscaled gradients by it gives them back exactly
        (NOTE [Atomic step], rule 2)."""
        try:
            factors = (float(self.scaler.get_growth_factor()), float(self.scaler.get_backoff_factor()))
        except (AttributeError, TypeError):  # a GradScaler look-alike without them
            return False
        return all(_power_of_two(x) for x in (scale_init(self.scaler), *factors))

    def ready_on(self, device: torch.device) -> None:
        """Create the scale tensor on ``device`` if the scaler has none yet (a scaler loaded from a state dict
        and stepped before any ``scale()`` call, as on a resume between ``backward`` and ``step``)."""
        if self.enabled and scale_uninitialised(self.scaler):
            self.scaler.scale(torch.zeros((), device=device))  # public: initialises the scale lazily

    def snapshot(self, *, sync: bool = True) -> ScalerSnapshot | None:
        """The scaler's state, to put back with :meth:`restore`; None without an enabled scaler.

        ``sync=False`` copies the scale and growth tracker tensors on their device instead of reading
        ``state_dict()`` (whose ``get_scale()`` waits for the device), where the scaler has them.
        """
        if not self.enabled:
            return None
        tensors = None if sync else scale_tensors(self.scaler)
        states = scaler_states(self.scaler)
        per_optimizer = None
        if states is not None:
            per_optimizer = {
                k: {
                    "stage": v.get("stage"),
                    "found_inf_per_device": {d: t.clone() for d, t in v.get("found_inf_per_device", {}).items()},
                }
                for k, v in states.items()
            }
        if tensors is not None:
            saved = (tensors[0].detach().clone(), tensors[1].detach().clone())
            return ScalerSnapshot(public=None, per_optimizer=per_optimizer, tensors=saved)
        return ScalerSnapshot(public=dict(self.scaler.state_dict()), per_optimizer=per_optimizer)

    def restore(self, snap: ScalerSnapshot | None) -> None:
        """Put back what :meth:`snapshot` saved (scale and growth tracker in place, the iteration's records)."""
        if snap is None:
            return
        if snap.public is not None:
            self.scaler.load_state_dict(snap.public)
        current = scale_tensors(self.scaler)
        if snap.tensors is not None and current is not None:
            with torch.no_grad():
                for now, saved in zip(current, snap.tensors, strict=True):
                    now.copy_(saved)
        states = scaler_states(self.scaler)
        if snap.per_optimizer is not None and isinstance(states, defaultdict):
            fresh: defaultdict[int, Any] = defaultdict(states.default_factory)
            fresh.update(snap.per_optimizer)
            set_scaler_states(self.scaler, fresh)
