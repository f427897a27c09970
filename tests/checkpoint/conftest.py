"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradroute import _compat


@pytest.fixture
def no_donated_buffers() -> Iterator[None]:
    with _compat.no_donated_buffers():  # routed calls retain (examples/README.md)
        yield
