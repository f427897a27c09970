"""Whether this torch prunes compiled regions: routed passes through ``gradroute.compile`` skip weight gradients.

Run by the ``noxfile.py`` sessions with each release's venv (``python tools/prune_probe.py``); prints one JSON
object: ``prunes`` (bool) and ``why`` (the measured FLOPs, or the reason ``gradroute.compile`` gives).

What it measures: the routed backward of two small MLPs (a text encoder and a UNet stand-in, float64) counted by
``torch.utils.flop_counter.FlopCounterMode``: eager, through ``torch.compile(backend="aot_eager")`` and through
``gradroute.compile(backend="aot_eager")`` (its second step, once the variants are compiled). The release
prunes when the ``gradroute.compile`` pass costs the eager pass's FLOPs and ``torch.compile``'s costs more
(what ``tests/test_compile.py`` asserts where the release can prune), and its gradients equal the eager ones.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradroute


def routed(
    tenc: Callable, unet: Callable, router: gradroute.Router, params: list[nn.Parameter]
) -> tuple[int, list[torch.Tensor]]:
    """FLOPs of one routed backward of the two losses, and the gradients it left on ``params``."""
    g = torch.Generator().manual_seed(0)
    x, target = (
        torch.randn(32, 8, generator=g, dtype=torch.float64),
        torch.randn(32, 8, generator=g, dtype=torch.float64),
    )
    loss = (unet(tenc(x)) - target) ** 2
    router.zero_grad()
    with FlopCounterMode(display=False) as counter:
        router.backward(tenc=loss.mean(), unet=loss[:16].mean())
    grads = [p.grad.clone() for p in params]
    return counter.get_total_flops(), grads


def main() -> dict[str, object]:
    torch.manual_seed(0)
    tenc = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)).double()
    unet = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8)).double()
    router = gradroute.Router(tenc=tenc, unet=unet)
    params = [*tenc.parameters(), *unet.parameters()]
    eager, want = routed(tenc, unet, router, params)
    import torch._functorch.config as functorch_config

    no_donation = {"donated_buffer": False} if hasattr(functorch_config, "donated_buffer") else {}
    with functorch_config.patch(no_donation):
        plain, _ = routed(*(torch.compile(m, backend="aot_eager") for m in (tenc, unet)), router, params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = [gradroute.compile(m, backend="aot_eager") for m in (tenc, unet)]
        routed(*compiled, router, params)  # compiles the variants
        pruned, got = routed(*compiled, router, params)
    exact = all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got, want, strict=True))
    notes = [str(w.message) for w in caught if "gradroute.compile" in str(w.message)]
    prunes = exact and pruned == eager < plain
    why = f"routed backward FLOPs: eager {eager}, torch.compile {plain}, gradroute.compile {pruned}"
    if not exact:
        why += "; gradroute.compile's gradients differ from eager"
    return {"prunes": prunes, "why": "; ".join([why, *notes])}


if __name__ == "__main__":
    print(json.dumps(main()))
