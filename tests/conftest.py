"""Shared fixtures: every test starts from the same seed; CPU tests use one thread (CI has 2 cores); a hung
test ends the run with every thread's stack."""

from __future__ import annotations

import faulthandler
import os
import random
from collections.abc import Iterator

import pytest
import torch

# NOTE [A hung test ends the run with every thread's stack]
# pytest-timeout's thread method needs the GIL, so a test hung holding it printed nothing until CI's own limit. A
# faulthandler C thread needs none: armed past each test's own pytest-timeout limit, it dumps every thread's stack
# and exits. pytest's faulthandler_timeout (its exit option: pytest 9) is one limit for all tests (ours: 600-3600 s).
_STDERR_FD = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "hard_timeout_extra",
        "seconds past a test's pytest-timeout limit after which faulthandler dumps every stack and exits",
        default="60",
    )


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)
    config.stash[_STDERR_FD] = os.dup(2)


def _timeout_of(item: pytest.Item) -> float:
    """The test's pytest-timeout limit in seconds: its marker's, else ``--timeout``'s, else the ini's (0: none,
    or pytest-timeout not loaded)."""
    marker = item.get_closest_marker("timeout")
    if marker and marker.args:
        return float(marker.args[0])
    try:
        option = item.config.getoption("timeout")
        return float(option if option is not None else item.config.getini("timeout") or 0)
    except ValueError:  # -p no:timeout: no such option or ini value
        return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    limit = _timeout_of(item)
    if limit > 0:
        extra = float(item.config.getini("hard_timeout_extra"))
        faulthandler.dump_traceback_later(limit + extra, exit=True, file=item.config.stash[_STDERR_FD])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)
