"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def no_donated_buffers() -> Iterator[None]:
    import torch._functorch.config as functorch_config

    with functorch_config.patch(donated_buffer=False):  # routed calls retain (examples/README.md)
        yield
