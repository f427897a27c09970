"""Shared fixtures: every test starts from the same seed; CPU tests use one thread (CI has 2 cores)."""

from __future__ import annotations

import random

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)
