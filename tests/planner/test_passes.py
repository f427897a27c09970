"""Steps 2-5 on hand-built graphs: routes merged into passes, what each pass needs, the order, last uses."""

from __future__ import annotations

import torch

from gradroute._planner.needs import needs
from gradroute._planner.order import last_use, order_passes
from gradroute._planner.passes import merge_routes
from gradroute._planner.reach import reach

from ._chain import ROOTS, chain
from ._graphs import graph


def test_leaking_routes_get_a_pass_each() -> None:
    g, params = chain()
    passes = merge_routes(reach(g, params, ROOTS, merge_shared=True))
    assert passes.routes == (0b01, 0b10)
    assert passes.unreached == ()
    assert passes.of_routes(0b11) == 0b11


def test_routes_that_do_not_leak_share_a_pass_and_unreached_ones_get_none() -> None:
    a, b, c = (torch.zeros(1, requires_grad=True) for _ in range(3))
    # route 0 -> a, route 1 -> b (apart), route 2's loss reaches a only: a is not its own
    g = graph({0: [3], 1: [4], 2: [3], 3: [5], 4: [6]}, {5: a, 6: b})
    passes = merge_routes(reach(g, [[a], [b], [c]], [[0], [1], [2]], merge_shared=True))
    assert passes.routes == (0b011,)
    assert passes.unreached == (2,)
    assert passes.of_routes(0b100) == 0


def test_needs_are_the_nodes_between_a_pass_losses_and_its_parameters() -> None:
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    need = needs(g, found, merge_routes(found))
    assert need.needed_by == [0b01, 0b10, 0b11, 0, 0b01, 0]
    assert need.targets == {3: 0b10, 5: 0b01}


def test_the_pass_whose_weight_gradients_share_nodes_goes_last_and_frees_them() -> None:
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    need = needs(g, found, merge_routes(found))
    order = order_passes(g, need, 2)
    assert order == (0, 1)  # node 2 feeds the UNet weight and is needed by the text encoder's pass too
    assert last_use(need, order) == [0, 1, 1, -1, 0, -1]
    assert last_use(need, (1, 0)) == [0, 1, 0, -1, 0, -1]
