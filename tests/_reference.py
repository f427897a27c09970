"""Independent references for routed gradients: a fresh forward per loss and ``torch.autograd.grad``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Losses = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]


def _total(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.stack([v.reshape(()) for v in value]).sum()


def reference_grads(
    forward: Callable[[], Losses],
    groups: Mapping[str, Sequence[torch.Tensor]],
    names: Sequence[str] | None = None,
) -> dict[int, torch.Tensor]:
    """``id(p) -> sum over routed groups g containing p of d loss_g / d p``, each from its own fresh forward.

    ``forward`` must be deterministic (reset RNG inside it if it uses dropout). Parameters no routed loss
    reaches are absent from the result.
    """
    out: dict[int, torch.Tensor] = {}
    for name in names if names is not None else list(forward().keys()):
        params = list(groups[name])
        loss = _total(forward()[name])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads):
            if g is None:
                continue
            out[id(p)] = g.detach().clone() if id(p) not in out else out[id(p)] + g
    return out


def assert_grads_match(
    params: Sequence[torch.Tensor],
    expected: Mapping[int, torch.Tensor],
    *,
    base: Mapping[int, torch.Tensor | None] | None = None,
    rtol: float = 1e-10,
    atol: float = 1e-12,
) -> None:
    """``p.grad == base[p] + expected[p]``; parameters absent from ``expected`` keep ``base`` (None if unset)."""
    for k, p in enumerate(params):
        before = None if base is None else base.get(id(p))
        exp = expected.get(id(p))
        if exp is None:
            if before is None:
                assert p.grad is None, f"parameter {k} got a gradient it should not have"
            else:
                torch.testing.assert_close(p.grad, before, rtol=0, atol=0)
            continue
        want = exp if before is None else before + exp
        assert p.grad is not None, f"parameter {k} got no gradient"
        torch.testing.assert_close(p.grad, want, rtol=rtol, atol=atol, msg=f"parameter {k}")


def assert_routed_exact(
    forward: Callable[[], Losses],
    groups: Mapping[str, Sequence[torch.Tensor]],
    *,
    rtol: float = 1e-10,
    atol: float = 1e-12,
) -> None:
    """``Router(groups).backward(**forward())`` gives every parameter the per-loss reference gradients."""
    import gradroute

    expected = reference_grads(forward, groups)
    gradroute.Router(groups).backward(**forward())
    params = list(dict.fromkeys(p for ps in groups.values() for p in ps))
    assert_grads_match(params, expected, rtol=rtol, atol=atol)


def route_into_grad(router: Any, method: str, losses: Losses, params: Sequence[torch.Tensor]) -> None:
    """``router.backward(**losses)``, or with ``method="grads"`` ``router.grads(**losses)`` written into ``.grad``
    of ``params`` (the router's parameters of every group, in group order), so both compare the same way."""
    if method == "backward":
        router.backward(**losses)
        return
    got = router.grads(**losses)
    for p, g in zip(params, [g for grads in got.values() for g in grads], strict=True):
        p.grad = g
