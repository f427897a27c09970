"""Fixtures of the planner tests."""

from __future__ import annotations

import pytest
import torch

from gradroute.cli.data import make_batch
from gradroute.cli.models import make_models, route_losses

D = torch.float64


@pytest.fixture
def tenc_unet_setup():
    tenc, unet = make_models(seed=0, width=8)
    tenc, unet = tenc.to(D), unet.to(D)
    batch = make_batch(3, torch.Generator().manual_seed(0))
    batch = {k: v.to(D) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}

    def forward():
        pred = unet(batch["noisy"], batch["timesteps"], tenc(batch["tokens"]))
        loss_tenc, loss_unet = route_losses(pred, batch)
        return {"tenc": loss_tenc, "unet": loss_unet}

    return tenc, unet, forward
