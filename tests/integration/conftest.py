"""Fixtures for the examples' tests: the examples importable, a tiny local SD model directory and dataset.

Nothing is downloaded: the model directory (SD layout: unet/, text_encoder/, tokenizer/ with a 95-token
vocab.json + merges.txt, scheduler/, vae/) is written from tiny configs with random weights, the dataset is
four 16x16 PNGs with masks and a captions file (PIL comes with matplotlib).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root`` with ``root/model`` (latent UNet + VAE) and ``root/data``; written once per session. Read-only."""
    import sd_masked_finetune as sd

    root = tmp_path_factory.mktemp("sd-tiny")
    sd.write_tiny(root)
    return root


@pytest.fixture(scope="session")
def tiny_sd_pixel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory without vae/: the UNet trains on 16x16 RGB pixels."""
    import sd_masked_finetune as sd

    path = tmp_path_factory.mktemp("sd-tiny-pixel") / "model"
    sd.write_tiny_model(path, vae=False)
    return path


@pytest.fixture
def data_copy(tiny_sd: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny dataset, for tests that break it."""
    dst = tmp_path / "data"
    shutil.copytree(tiny_sd / "data", dst)
    return dst


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: reset them around a test."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
