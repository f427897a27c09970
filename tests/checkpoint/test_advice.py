"""The warning where a routed backward recomputes diffusers' checkpointed layers once per engine call."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import gradroute
from tests._reference import assert_grads_match, reference_grads

from ._helpers import sd_stack


def _advice_given(switch: str, cuts: bool, backwards: int, routed: bool = True) -> list[int]:
    """How many warnings naming ``gradroute.enable_checkpointing(unet)`` each backward gave."""
    tenc, unet, forward = sd_stack(switch, None, cuts)
    router = gradroute.Router(tenc=tenc, unet=unet)
    counts = []
    for _ in range(backwards):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning given, not once per place
            if routed:
                router.backward(**forward())
            else:
                forward()["tenc"].backward()
        counts.append(sum("gradroute.enable_checkpointing(unet)" in str(w.message) for w in caught))
    return counts


def test_diffusers_switch_alone_warns_once_per_routed_backward_naming_the_call() -> None:
    # the plan recomputes the UNet's segments once per engine call: one warning per routed backward (and
    # Python's default filter shows it once per process)
    assert _advice_given("gradroute", cuts=False, backwards=2) == [1, 1]
    with pytest.warns(UserWarning, match=r"Call gradroute\.enable_checkpointing\(unet\) instead of"):
        tenc, unet, forward = sd_stack("gradroute", None)
        gradroute.Router(tenc=tenc, unet=unet).backward(**forward())


@pytest.mark.parametrize(
    "switch, cuts", [("enable_checkpointing", False), ("gradroute", True)], ids=["enable_checkpointing", "by hand"]
)
def test_no_warning_with_cut_points(switch: str, cuts: bool) -> None:
    # three backwards: the autotuner's candidate plans include one that does not interleave (per call), which
    # is no reason to warn
    assert _advice_given(switch, cuts, backwards=3) == [0, 0, 0]


def test_no_warning_without_a_router() -> None:
    assert _advice_given("gradroute", cuts=False, backwards=1, routed=False) == [0]


class _Block(nn.Module):
    """A residual block: the checkpointed body's input also feeds the sum around it (a skip connection)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.proj = nn.Linear(w, w)
        self.body = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return gradroute.checkpoint(self.body, h, use_reentrant=False) + h


def _skip_net(blocks: int = 6, w: int = 16) -> tuple[nn.Module, nn.Module, Any]:
    torch.manual_seed(0)
    tenc, unet = nn.Linear(w, w).double(), nn.Sequential(*(_Block(w) for _ in range(blocks))).double()
    x = torch.randn(8, w, dtype=torch.float64)

    def forward() -> dict[str, torch.Tensor]:
        loss = unet(tenc(x)).pow(2)
        return {"tenc": loss.mean(), "unet": loss[:4].mean()}

    return tenc, unet, forward


@pytest.mark.parametrize("fix", ["none", "cut_points", "checkpoint_modules"])
def test_other_segments_recomputed_per_call_warn_naming_cut_points(fix: str) -> None:
    gc.collect()  # cut points of earlier tests' modules, if any are left, silence the advice (rule 2)
    tenc, unet, forward = _skip_net()
    handles = gradroute.cut_points(*[b.proj for b in unet]) if fix == "cut_points" else []
    if fix == "checkpoint_modules":
        gradroute.checkpoint_modules(*unet)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(groups, autotune=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        router.backward(**forward())
    named = [w for w in caught if "gradroute.cut_points(*modules)" in str(w.message)]
    assert len(named) == (1 if fix == "none" else 0)
    if named:
        assert "(`Sequential`)" in str(named[0].message)
    assert_grads_match([p for ps in groups.values() for p in ps], expected, rtol=1e-12, atol=1e-14)
    for h in handles:
        h.remove()
