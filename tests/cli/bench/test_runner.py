"""The bench's ``Runner``: one router per gradroute strategy."""

from __future__ import annotations

import pytest
import torch

from gradroute.cli.bench.runner import Runner
from gradroute.cli.choices import CKPT_STRATEGIES
from gradroute.cli.workloads import build


@pytest.mark.parametrize("static_graph", [False, True])
def test_each_gradroute_strategy_measures_its_own_plan_choice(static_graph: bool) -> None:
    wl = build("sd-tiny", batch_size=1, device=torch.device("cpu"), checkpointing=True, width=8)
    r = Runner(wl, "fp32", static_graph=static_graph)
    strategies = list(CKPT_STRATEGIES)
    first = {s: r.settle(s) for s in strategies}
    assert all(first.values()), first  # every checkpointed graph has candidates to measure
    assert len({id(r.router_for(s)) for s in ["gradroute", *strategies]}) == len(strategies) + 1
    # settling the others did not touch a strategy's own measurement: its note is what it was
    assert {s: r.settle(s) for s in strategies} == first
