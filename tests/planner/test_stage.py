"""Step 6 on hand-built graphs: stage numbers, clean cuts, and one pass split into retaining and freeing calls."""

from __future__ import annotations

import pytest

from gradroute._planner.conflicts import find_conflict, resolve
from gradroute._planner.needs import needs
from gradroute._planner.numbering import (
    FIRST,
    Stage,
    at_or_after,
    at_or_before,
    chunk_start,
    fold_stateless_stages,
    freeing,
    ladder,
    number_stages,
    pull_stateless,
)
from gradroute._planner.order import last_use, order_passes
from gradroute._planner.passes import merge_routes
from gradroute._planner.reach import reach
from gradroute._planner.stage import PassInputs, PassStages, stage_pass

from ._chain import NAMES, ROOTS, chain
from ._graphs import graph

# a pass's first stages, written out: F frees, R retains
F0, R1, F2, R3, F4, R5, F6 = (
    Stage(0, False),
    Stage(1, True),
    Stage(2, False),
    Stage(3, True),
    Stage(4, False),
    Stage(5, True),
    Stage(6, False),
)
S = (F0, R1, F2, R3, F4, R5, F6)


def test_stages_alternate_from_a_freeing_first() -> None:
    assert FIRST == F0
    assert [FIRST.next(), FIRST.next().next()] == [R1, F2]
    assert F4.previous() == R3 and R3.previous() == F2
    assert ladder(F6) == list(S) and ladder(FIRST) == [F0]
    assert [freeing(k) for k in range(4)] == [F0, F2, F4, F6]
    assert [chunk_start(k) for k in range(3)] == [F0, F2, F4]
    assert sorted([F4, R1, F0, R3]) == [F0, R1, R3, F4]


@pytest.mark.parametrize("stage", S)
@pytest.mark.parametrize("retain", [False, True])
def test_stage_steps_land_on_the_asked_kind(stage: Stage, retain: bool) -> None:
    up, down = at_or_after(stage, retain), at_or_before(stage, retain)
    assert up.retain is retain and down.retain is retain
    assert up in (stage, stage.next()) and down in (stage, stage.previous())
    assert (up == stage) is (stage.retain is retain) and (down == stage) is (stage.retain is retain)


def test_a_stage_renumbered_from_a_freeing_origin_keeps_its_kind() -> None:
    assert R5.shifted(F2) == R3 and F6.shifted(F4) == F2 and F2.shifted(F2) == FIRST


def test_a_stage_renumbered_from_a_retaining_origin_fails() -> None:
    with pytest.raises(ValueError, match="`origin` must be a freeing stage"):
        R3.shifted(R1)


def test_a_ladder_to_a_stage_of_another_numbering_fails() -> None:
    with pytest.raises(ValueError, match="`last` must be a stage numbered from FIRST"):
        ladder(Stage(2, True))


def test_late_numbering_defers_and_early_numbering_hurries() -> None:
    # a chain 0 -> 1 -> 2 -> 3: 1 is used again by a later pass, the others not
    g = graph({0: [1], 1: [2], 2: [3]}, {})
    members, retained = [0, 1, 2, 3], {0: False, 1: True, 2: False, 3: False}
    late = number_stages(g, members, retained, set(), set(members), late=True, lower={})
    early = number_stages(g, members, retained, set(), set(members), late=False, lower={})
    assert late == {0: F0, 1: R1, 2: F2, 3: F2}
    assert early == {0: F0, 1: R1, 2: F2, 3: F2}
    bounded = number_stages(g, members, retained, set(), set(members), late=False, lower={2: F4})
    assert bounded == {0: F0, 1: R1, 2: F4, 3: F4}


def test_late_numbering_starts_at_a_freeing_stage_and_puts_stateless_nodes_anywhere() -> None:
    # 0 -> 1 -> 2 -> 3, all used again by a later pass but 3; 1 keeps nothing (a view)
    g = graph({0: [1], 1: [2], 2: [3]}, {}, views=[1])
    members, retained = [0, 1, 2, 3], {0: True, 1: True, 2: True, 3: False}
    late = number_stages(g, members, retained, {1}, set(members), late=True, lower={})
    assert late == {0: R1, 1: R1, 2: R1, 3: F2}
    early = number_stages(g, members, retained, {1}, set(members), late=False, lower={1: F2})
    assert early == {0: R1, 1: F2, 2: R3, 3: F4}


def test_a_stage_of_stateless_nodes_only_folds_into_the_next() -> None:
    assert fold_stateless_stages({0: F0, 1: R1, 2: F2}, {0}) == {0: R1, 1: R1, 2: F2}
    assert fold_stateless_stages({0: F0, 1: R1, 2: F2}, {1}) == {0: F0, 1: F2, 2: F2}
    assert fold_stateless_stages({0: F0, 1: F2}, {0}) == {0: F0, 1: F2}  # no stage R1 to fold into


def test_the_views_of_one_tensor_move_up_so_that_one_edge_is_cut() -> None:
    # ops a, b, c (R1) each send gradient through a view (F2) into t (F2): three cut edges, one once pulled
    a, b, c, va, vb, vc, t = range(7)
    g = graph({a: [va], b: [vb], c: [vc], va: [t], vb: [t], vc: [t]}, {}, views=[va, vb, vc])
    stage = {a: R1, b: R1, c: R1, va: F2, vb: F2, vc: F2, t: F2}
    pulled = pull_stateless(g, range(7), stage, {va, vb, vc}, {})
    assert pulled == {**stage, va: R1, vb: R1, vc: R1}
    assert pull_stateless(g, range(7), stage, {va, vb, vc}, dict.fromkeys((va, vb, vc), F2)) == stage  # bounds


def test_a_stateless_node_moves_only_into_a_stage_that_has_a_call() -> None:
    # v's predecessor a is at F0, its chunk starts at R1, which has no node: a move there (a tie: b's edge into t
    # is cut already) would add an engine call
    a, b, v, t = range(4)
    g = graph({a: [v], b: [t], v: [t]}, {}, views=[v])
    stage = {a: F0, b: F0, v: F2, t: F2}
    assert pull_stateless(g, range(4), stage, {v}, {v: R1}) == stage
    assert pull_stateless(g, range(4), stage, {v}, {}) == {**stage, v: F0}


def test_a_stateless_node_that_would_cut_more_edges_stays() -> None:
    # a (R1) -> add (F2) -> t1, t2 (F2): pulled up, the add would leave two cut edges instead of one
    a, add, t1, t2 = range(4)
    g = graph({a: [add], add: [t1, t2]}, {}, views=[add])
    stage = {a: R1, add: F2, t1: F2, t2: F2}
    assert pull_stateless(g, range(4), stage, {add}, {}) == stage


def test_a_node_feeding_a_capture_from_a_later_stage_is_a_conflict_resolved_by_merging() -> None:
    # a (stage F0) feeds j directly and through p (stage R1): the call of stage F0 would execute p too
    a, p, j = 0, 1, 2
    g = graph({a: [j, p], p: [j]}, {})
    stage = {a: F0, p: R1, j: F2}
    assert find_conflict(g, stage, set()) == (F0, R1, j)
    retained = dict.fromkeys(stage, False)
    resolved = resolve(g, stage, set(), retained, set(), move=False)
    assert resolved == {a: F0, p: F0, j: F2}
    assert find_conflict(g, resolved, set()) is None
    retained[p] = True  # the merged call retains when one of its nodes must
    assert resolve(g, stage, set(), retained, set(), move=False) == {a: R1, p: R1, j: F2}


def test_a_conflict_is_resolved_by_moving_the_nodes_that_feed_only_the_capture() -> None:
    # r (stage F0) feeds u and p; u (F0) feeds only j, which p (R1) feeds too: F0 would execute p
    r, u, p, j = 0, 1, 2, 3
    g = graph({r: [u, p], u: [j], p: [j]}, {})
    stage = {r: F0, u: F0, p: R1, j: F2}
    retained = {r: False, u: False, p: True, j: False}
    assert find_conflict(g, stage, set()) == (F0, R1, j)
    moved = resolve(g, stage, set(), retained, set(), move=True)
    assert moved == {r: F0, u: F2, p: R1, j: F2}  # u goes with j: F0 captures the edges into u and p
    assert find_conflict(g, moved, set()) is None
    assert resolve(g, stage, set(), retained, set(), move=False) == {r: R1, u: R1, p: R1, j: F2}


def _chain_pass(k: int, chunk_of: dict[int, int] | None = None) -> tuple[PassStages, list[int]]:
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    passes = merge_routes(found)
    need = needs(g, found, passes)
    last = last_use(need, order_passes(g, need, 2))
    inputs = PassInputs(index=k, routes=passes.routes[k], groups=(NAMES[k],), roots=ROOTS, owners=found.owners)
    return stage_pass(g, inputs, need, last, chunk_of or {}), last


@pytest.mark.parametrize("chunk_of", [None, {4: 1}, {4: 2}])
def test_the_text_encoder_pass_retains_through_the_unet_and_frees_its_own_part(chunk_of) -> None:
    # with its weight's op in a later chunk, the stages in between have no node: no call for them
    staged, _ = _chain_pass(0, chunk_of)
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
