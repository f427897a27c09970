"""Step bookkeeping around the router: loss scaling, accumulation, unscale/clip/step, one scaler update.

Placeholder: only the no-scaler, no-accumulation path of ``before_backward``/``after_backward``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._group import Group
from ._plan import Route


class Stepper:
    def __init__(self, groups: Mapping[str, Group], *, scaler: Any = None, accumulate: int = 1) -> None:
        self.groups = groups
        self.scaler = scaler
        self.accumulate = accumulate

    def before_backward(self, routes: list[Route]) -> list[Route]:
        return routes

    def after_backward(self, routes: list[Route]) -> None:
        pass

    def step(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError
