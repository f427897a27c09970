"""The sd15 workload (tiny configuration of the same block types): every strategy that should be exact is."""

from __future__ import annotations

import pytest

from gradroute.cli.bench.measure import measure
from gradroute.cli.bench.runner import Runner
from gradroute.cli.workloads import build


def test_sd15_tiny_configuration_routes_exactly():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")

    runner = Runner(build("sd15", batch_size=1, size="tiny"), "fp32")
    res = measure(runner, ["sum", "no_retain", "pruned", "gradroute"], steps=1, warmup=0)
    assert res["gradroute"]["err"] <= 1e-5 and res["pruned"]["err"] <= 1e-5
    assert res["sum"]["err"] > 0.1
    assert "error" in res["no_retain"]


def test_sd15_latent_size_sets_the_latents_and_still_routes_exactly():

    wl = build("sd15", batch_size=1, size="tiny", latent_size=8)
    assert wl.batch["noisy"].shape == (1, 4, 8, 8) and wl.info["latent_size"] == 8
    res = measure(Runner(wl, "fp32"), ["gradroute"], steps=1, warmup=0)
    assert res["gradroute"]["err"] <= 1e-5


@pytest.mark.parametrize("strategy", ["gradroute_ckpt", "gradroute_blocks", "gradroute_cuts"])
def test_sd15_tiny_checkpointing_strategies_route_exactly(strategy):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")

    runner = Runner(build("sd15", batch_size=1, size="tiny", checkpointing=True), "fp32")
    res = measure(runner, ["sum", "cut", strategy, "gradroute"], steps=1, warmup=0)
    for s in ("cut", strategy, "gradroute"):
        assert res[s]["err"] <= 1e-5, (s, res[s])
