"""``Workload``: two chained networks, a fixed batch, and the forward split at their boundary."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(eq=False)
class Workload:
    """Two chained networks and a fixed batch.

    Attributes:
        name: the workload's name.
        up_name, down_name: group names of the upstream and downstream networks.
        up_module, down_module: the networks (all their trainable parameters form the group).
        batch: the fixed batch, already on the device.
        up: ``batch -> boundary`` (the upstream network's output).
        down: ``(batch, boundary, need) -> {group name: scalar loss}`` for the names in ``need``.
        info: sizes, for the report.
        set_checkpoint: with activation checkpointing, switches the checkpoint function of both networks:
            ``"torch"`` (``torch.utils.checkpoint``, non-reentrant), ``"gradroute"`` (``gradroute.checkpoint``) or
            ``"blocks"`` (``gradroute.checkpoint_modules`` on whole UNet blocks) or ``"cuts"`` (``"gradroute"`` with
            ``gradroute.cut_points`` on the UNet blocks' submodules; ``sd-tiny``: as ``"gradroute"``).
    """

    name: str
    up_name: str
    down_name: str
    up_module: nn.Module
    down_module: nn.Module
    batch: Any
    up: Callable[[Any], torch.Tensor]
    down: Callable[[Any, torch.Tensor, Sequence[str]], dict[str, torch.Tensor]]
    info: dict[str, Any] = field(default_factory=dict)
    set_checkpoint: Callable[[str], None] | None = None

    @property
    def groups(self) -> dict[str, nn.Module]:
        return {self.up_name: self.up_module, self.down_name: self.down_module}

    def params(self, name: str) -> list[torch.Tensor]:
        return [p for p in self.groups[name].parameters() if p.requires_grad]

    def forward(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One forward of both networks: the boundary and both losses."""
        h = self.up(self.batch)
        return h, self.down(self.batch, h, (self.up_name, self.down_name))
