"""Step 6 on hand-built graphs: stage numbers, clean cuts, and one pass split into retaining and freeing calls."""

from __future__ import annotations

import pytest

from gradroute._planner.conflicts import find_conflict, resolve
from gradroute._planner.needs import needs
from gradroute._planner.numbering import (
    at_or_after,
    at_or_before,
    fold_stateless_stages,
    number_stages,
    retains,
)
from gradroute._planner.order import last_use, order_passes
from gradroute._planner.passes import merge_routes
from gradroute._planner.reach import reach
from gradroute._planner.stage import PassInputs, PassStages, stage_pass

from ._chain import NAMES, ROOTS, chain
from ._graphs import graph


@pytest.mark.parametrize("stage", range(6))
@pytest.mark.parametrize("retain", [False, True])
def test_stage_number_steps_land_on_the_asked_kind(stage: int, retain: bool) -> None:
    up, down = at_or_after(stage, retain), at_or_before(stage, retain)
    assert retains(up) is retain and retains(down) is retain
    assert 0 <= up - stage <= 1 and 0 <= stage - down <= 1
    assert retains(0) is False  # the first call of a pass frees


def test_late_numbering_defers_and_early_numbering_hurries() -> None:
    # a chain 0 -> 1 -> 2 -> 3: 1 is used again by a later pass, the others not
    g = graph({0: [1], 1: [2], 2: [3]}, {})
    members, retained = [0, 1, 2, 3], {0: False, 1: True, 2: False, 3: False}
    late = number_stages(g, members, retained, set(), set(members), late=True, lower={})
    early = number_stages(g, members, retained, set(), set(members), late=False, lower={})
    assert late == {0: 0, 1: 1, 2: 2, 3: 2}
    assert early == {0: 0, 1: 1, 2: 2, 3: 2}
    bounded = number_stages(g, members, retained, set(), set(members), late=False, lower={2: 4})
    assert bounded == {0: 0, 1: 1, 2: 4, 3: 4}


def test_a_stage_of_stateless_nodes_only_folds_into_the_next() -> None:
    assert fold_stateless_stages({0: 0, 1: 1, 2: 2}, {0}) == {0: 1, 1: 1, 2: 2}
    assert fold_stateless_stages({0: 0, 1: 1, 2: 2}, {1}) == {0: 0, 1: 2, 2: 2}
    assert fold_stateless_stages({0: 0, 1: 2}, {0}) == {0: 0, 1: 2}  # no stage 1 to fold into


def test_a_node_feeding_a_capture_from_a_later_stage_is_a_conflict_resolved_by_merging() -> None:
    # a (stage 0) feeds j directly and through p (stage 1): the call of stage 0 would execute p too
    a, p, j = 0, 1, 2
    g = graph({a: [j, p], p: [j]}, {})
    stage = {a: 0, p: 1, j: 2}
    assert find_conflict(g, stage, set()) == (0, 1, j)
    retained = dict.fromkeys(stage, False)
    resolved = resolve(g, stage, set(), retained, set(), move=False)
    assert resolved == {a: 0, p: 0, j: 2}
    assert find_conflict(g, resolved, set()) is None
    retained[p] = True  # the merged call retains when one of its nodes must
    assert resolve(g, stage, set(), retained, set(), move=False) == {a: 1, p: 1, j: 2}


def _chain_pass(k: int) -> tuple[PassStages, list[int]]:
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    passes = merge_routes(found)
    need = needs(g, found, passes)
    last = last_use(need, order_passes(g, need, 2))
    inputs = PassInputs(index=k, routes=passes.routes[k], groups=(NAMES[k],), roots=ROOTS, owners=found.owners)
    return stage_pass(g, inputs, need, last, {}), last


def test_the_text_encoder_pass_retains_through_the_unet_and_frees_its_own_part() -> None:
    staged, _ = _chain_pass(0)
    assert [c.retain for c in staged.calls] == [True, False]
    first, second = (c.wiring for c in staged.calls)
    assert first.losses == ((0, 0),) and first.edges_out == ((4, 0),) and first.targets == ()
    assert second.edges_in == ((4, 0),) and second.targets == (5,) and second.target_routes == (0,)
    assert [sorted(m) for m in staged.members] == [[0, 2], [4]]
    assert staged.kept == 0


def test_the_last_pass_through_its_nodes_is_one_freeing_call() -> None:
    staged, _ = _chain_pass(1)
    (call,) = staged.calls
    assert not call.retain and (call.losses, call.edges_in, call.edges_out, call.params) == (1, 0, 0, 1)
    assert call.wiring.targets == (3,) and sorted(staged.members[0]) == [1, 2]
