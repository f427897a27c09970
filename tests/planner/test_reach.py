"""Step 1 on hand-built graphs: what each route's losses reach, its leaks, which routes must run apart."""

from __future__ import annotations

import pytest
import torch

from gradroute._planner.reach import reach

from ._chain import ROOTS, chain
from ._graphs import graph


def test_reach_of_the_chain() -> None:
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    assert found.owners == {3: 0b10, 5: 0b01}
    assert found.reached_by == [0b01, 0b10, 0b11, 0b11, 0b11, 0b11]
    assert found.counts == [[1, 1], [1, 1]]
    assert found.leaks == [0b10, 0b01]
    assert found.apart == [0b10, 0b01]


@pytest.mark.parametrize("merge_shared", [True, False])
def test_routes_sharing_a_parameter_run_apart_only_without_merge_shared(merge_shared: bool) -> None:
    w = torch.zeros(1, requires_grad=True)
    g = graph({0: [2], 1: [2], 2: [3]}, {3: w})  # two losses on one op of a parameter both groups own
    found = reach(g, [[w], [w]], [[0], [1]], merge_shared=merge_shared)
    assert found.leaks == [0, 0]
    assert found.apart == ([0, 0] if merge_shared else [0b10, 0b01])


def test_a_loss_reaching_nothing_of_its_own_counts_zero() -> None:
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    g = graph({0: [2], 1: [3], 2: [4]}, {3: b, 4: a})  # each loss reaches only the other route's parameter
    found = reach(g, [[b], [a]], [[0], [1]], merge_shared=True)
    assert found.counts == [[0, 1], [1, 0]]
    assert found.leaks == [0b10, 0b01]
