"""Segments picked for recomputation once per call, from the bytes shared recomputations would hold."""

from __future__ import annotations

from typing import Any

import pytest

from gradroute._planner.per_call import PerCall, recompute_per_call

from ._graphs import graph


def _bytes(sizes: dict[int, int]) -> Any:
    return lambda node: sizes.get(node._sequence_nr(), 0)


@pytest.mark.parametrize(("factor", "expected"), [(0.0, PerCall((1, 2, 3, 4), 2)), (2.0, PerCall())])
def test_segments_held_across_calls_beyond_the_budget_are_picked(factor: float, expected: PerCall) -> None:
    # two segments (sequence numbers [1, 3) and [3, 5)), each node 10 bytes; call 0 goes through both (it
    # recomputes them), call 1 frees them: 40 bytes held after call 0, twice the largest segment's 20
    g = graph({0: [1], 1: [2], 2: [3], 3: [4]}, {})
    calls = [[0, 1, 2, 3, 4], [1, 2, 3, 4]]
    out = recompute_per_call(g, calls, [(1, 3), (3, 5)], _bytes({1: 10, 2: 10, 3: 10, 4: 10}), factor)
    assert out == expected


def test_the_segment_holding_the_most_goes_first() -> None:
    g = graph({0: [1], 1: [2], 2: [3], 3: [4]}, {})
    calls = [[0, 1, 2, 3, 4], [1, 2, 3, 4]]
    # by sequence number: segment [1, 3) (nodes 4 and 3) holds 60 bytes, [3, 5) (nodes 2 and 1) 20
    sizes = {1: 30, 2: 30, 3: 10, 4: 10}
    out = recompute_per_call(g, calls, [(1, 3), (3, 5)], _bytes(sizes), 1.0)
    assert out == PerCall((3, 4), 1)  # 80 held > the budget of 60: dropping the 60-byte segment suffices


def test_nothing_without_segments_or_bytes() -> None:
    g = graph({0: [1]}, {})
    assert recompute_per_call(g, [[0, 1]], [], _bytes({}), 0.0) == PerCall()
    assert recompute_per_call(g, [[0, 1], [1]], [(0, 2)], _bytes({}), 0.0) == PerCall()
