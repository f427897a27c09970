"""The bench's strategies: one function per name the command line accepts, and no other."""

from __future__ import annotations

from gradroute.cli.bench.strategies import STRATEGY_FNS
from gradroute.cli.choices import CKPT_STRATEGIES, INEXACT, STRATEGIES


def test_every_accepted_strategy_has_a_function_and_no_other():
    assert list(STRATEGY_FNS) == [*STRATEGIES, *CKPT_STRATEGIES]
    assert set(INEXACT) <= set(STRATEGIES)
