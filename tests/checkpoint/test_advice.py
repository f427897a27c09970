"""The warning where a routed backward recomputes diffusers' checkpointed layers once per engine call."""

from __future__ import annotations

import warnings

import pytest

import gradroute

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
