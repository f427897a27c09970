"""Four threads routing through one router while its measured choice measures; run in a process of its own by
``tests/test_autotune.py`` (``python -m tests._threaded_grads``); prints one JSON line: the errors seen (every
result is compared with per-loss references in float64) and whether the router is still measuring."""

from __future__ import annotations

import json
import threading

import torch
from torch import nn

import gradroute
from tests._reference import reference_grads

D = 4


def main() -> dict[str, object]:
    torch.manual_seed(0)
    tenc = nn.Linear(D, D).double()
    unet = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D)) for _ in range(4)).double()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}

    def forward(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        h = tenc(torch.randn(5, D, generator=g, dtype=torch.float64))
        for k in (0, 2):
            h = gradroute.checkpoint(lambda x, k=k: unet[k + 1](unet[k](x)) + x, h)
        loss = h.pow(2)
        return {"tenc": loss.mean(), "unet": loss[:2].mean()}

    expected = {s: reference_grads(lambda s=s: forward(s), groups) for s in range(4)}
    router = gradroute.Router(groups, autotune=gradroute.Autotune(trials=3))
    errors: list[str] = []
    start = threading.Barrier(4)

    def run(seed: int) -> None:
        try:
            start.wait(10)
            for _ in range(15):
                got = router.grads(**forward(seed))
                for name, params in groups.items():  # the groups share no parameter
                    for p, g in zip(params, got[name], strict=True):
                        torch.testing.assert_close(g, expected[seed][id(p)], rtol=1e-9, atol=1e-12)
        except BaseException as e:  # reported by the test
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return {"errors": errors, "autotuning": router.autotuning}


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
