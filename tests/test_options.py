from __future__ import annotations

from typing import Any

import pytest
import torch

import gradroute


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk": 0}, ValueError, "`chunk` must be at least 1, got 0"),
        ({"chunk": 2.5}, TypeError, r"`chunk` must be an int, got float \(2.5\)"),
        ({"chunk": True}, TypeError, "`chunk` must be an int, got bool"),
        ({"held_factor": -1.0}, ValueError, "`held_factor` must be at least 0, got -1.0"),
        ({"held_factor": "2"}, TypeError, "`held_factor` must be a number, got str"),
        ({"interleave": 1}, TypeError, "`interleave` must be a bool, got int"),
        ({"split": "no"}, TypeError, "`split` must be a bool, got str"),
        ({"remake_min_bytes": -1}, ValueError, "`remake_min_bytes` must be at least 0, got -1"),
    ],
)
def test_plan_options_bad_value_fails(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        gradroute.PlanOptions(**kwargs)


def test_router_plan_options_of_wrong_type_fails() -> None:
    with pytest.raises(TypeError, match=r"`plan_options` must be a gradroute\.PlanOptions, got dict"):
        gradroute.Router(a=torch.nn.Linear(2, 2), plan_options={"chunk": 3})  # type: ignore[arg-type]


def test_router_keeps_the_options_it_was_given() -> None:
    options = gradroute.PlanOptions(chunk=7, interleave=False)
    assert gradroute.Router(a=torch.nn.Linear(2, 2), plan_options=options).plan_options is options
    assert gradroute.Router(a=torch.nn.Linear(2, 2)).plan_options == gradroute.PlanOptions()
