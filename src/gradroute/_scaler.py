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

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import found_inf, scale_uninitialised, scaler_states, set_scaler_states


@dataclass(frozen=True)
class ScalerSnapshot:
    """What :meth:`Scaler.snapshot` saved: the public state, and the per-optimizer records of the iteration."""

    public: dict[str, Any]
    per_optimizer: dict[int, dict[str, Any]] | None


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

    def ready_on(self, device: torch.device) -> None:
        """Create the scale tensor on ``device`` if the scaler has none yet (a scaler loaded from a state dict
        and stepped before any ``scale()`` call, as on a resume between ``backward`` and ``step``)."""
        if self.enabled and scale_uninitialised(self.scaler):
            self.scaler.scale(torch.zeros((), device=device))  # public: initialises the scale lazily

    def snapshot(self) -> ScalerSnapshot | None:
        """The scaler's state, to put back with :meth:`restore`; None without an enabled scaler."""
        if not self.enabled:
            return None
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
        return ScalerSnapshot(public=dict(self.scaler.state_dict()), per_optimizer=per_optimizer)

    def restore(self, snap: ScalerSnapshot | None) -> None:
        """Put back what :meth:`snapshot` saved (scale and growth tracker in place, the iteration's records)."""
        if snap is None:
            return
        self.scaler.load_state_dict(snap.public)
        states = scaler_states(self.scaler)
        if snap.per_optimizer is not None and isinstance(states, defaultdict):
            fresh: defaultdict[int, Any] = defaultdict(states.default_factory)
            fresh.update(snap.per_optimizer)
            set_scaler_states(self.scaler, fresh)
