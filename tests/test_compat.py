"""gradroute._compat: the paths taken without the private APIs older torch releases lack, on every torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradroute import _compat

STATES = [_compat.saved_state, _compat._state_by_register]


@pytest.mark.parametrize("state", STATES)
def test_saved_state_live_then_freed(state: Callable[[Any], str]) -> None:
    x = torch.randn(3, requires_grad=True)
    y = x.exp()  # saves its result
    saved = y.grad_fn._raw_saved_result
    assert state(saved) == "live"
    assert state(saved) == "live"  # asking twice (the probe's hooks are set the second time)
    y.sum().backward()
    assert state(saved) == "freed"
    torch.testing.assert_close(x.grad, x.exp(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("state", STATES)
def test_saved_state_does_not_unpack(state: Callable[[Any], str]) -> None:
    unpacked = []
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(1) or t):
        y = x.sin()
    assert state(y.grad_fn._raw_saved_self) == "live"
    assert not unpacked
    y.sum().backward()
    assert len(unpacked) == 1


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("saved", ["input", "output"])
def test_in_place_change_after_the_probe_still_fails(state: Callable[[Any], str], saved: str) -> None:
    x = torch.randn(3, requires_grad=True)
    h = x * 1
    y = h.sin() if saved == "input" else h.exp()
    state(y.grad_fn._raw_saved_self if saved == "input" else y.grad_fn._raw_saved_result)
    with torch.no_grad():
        (h if saved == "input" else y).add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        y.sum().backward()


def test_release_parsing_against_the_minimum() -> None:
    assert _compat._release(_compat.TORCH_VERSION) >= _compat.MIN_TORCH
    assert _compat._release("2.4.1+cu121") < _compat.MIN_TORCH <= _compat._release("2.5.0a0+git1234")


def test_no_donated_buffers_turns_donation_off_inside_only() -> None:
    import torch._functorch.config as functorch_config

    before = getattr(functorch_config, "donated_buffer", None)
    with _compat.no_donated_buffers():
        assert getattr(functorch_config, "donated_buffer", False) is False
    assert getattr(functorch_config, "donated_buffer", None) == before


def test_get_autocast_kwargs_read_the_autocast_state() -> None:
    device, cpu = _compat.get_autocast_kwargs("cpu")
    assert device == cpu and cpu["enabled"] is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        device, cpu = _compat.get_autocast_kwargs("cpu")
    assert cpu["enabled"] is True and cpu["dtype"] == torch.bfloat16


def test_fully_shard_is_fsdp2() -> None:
    fn = _compat.fully_shard()
    assert callable(fn) and fn.__name__ == "fully_shard"


def test_is_optimized_module() -> None:
    m = torch.nn.Linear(2, 2)
    assert not _compat.is_optimized_module(m)
    assert _compat.is_optimized_module(torch.compile(m, backend="eager"))
