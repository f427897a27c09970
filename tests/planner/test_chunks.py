"""Shared checkpoint segments cut into chunks at clean lines (hand-built graphs, sequence numbers given)."""

from __future__ import annotations

import pytest

from gradroute._planner.chunks import chunk_shared_segments, segment_of

from ._graphs import graph


def test_segment_of_finds_the_range_holding_a_sequence_number() -> None:
    ranges, starts = [(2, 5), (7, 9)], [2, 7]
    assert [segment_of(s, ranges, starts) for s in range(10)] == [-1, -1, 0, 0, 0, -1, -1, 1, 1, -1]


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (1, {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}),
        (2, {1: 1, 2: 1, 3: 2, 4: 2, 5: 3}),
        (5, {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}),
    ],
)
def test_a_chain_is_cut_every_chunk_nodes_from_the_top(chunk: int, expected: dict[int, int]) -> None:
    # loss 0 -> 1 -> 2 -> 3 -> 4 -> 5; nodes 1..5 (sequence numbers 5..1) form one segment both passes need
    g = graph({0: [1], 1: [2], 2: [3], 3: [4], 4: [5]}, {})
    needed_by = [0b01] + [0b11] * 5
    assert chunk_shared_segments(g, needed_by, [(1, 6)], chunk) == expected


def test_no_cut_between_the_consumers_of_one_tensor() -> None:
    # node 5's output is consumed by nodes 1 and 4 (a residual stream): no clean line between them
    g = graph({0: [1], 1: [2, 5], 2: [3], 3: [4], 4: [5]}, {})
    needed_by = [0b01] + [0b11] * 5
    assert chunk_shared_segments(g, needed_by, [(1, 6)], 1) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2}


def test_nothing_when_no_segment_is_shared() -> None:
    g = graph({0: [1], 1: [2]}, {})
    assert chunk_shared_segments(g, [0b01, 0b01, 0b01], [(1, 3)], 1) == {}
    assert chunk_shared_segments(g, [0b01, 0b11, 0b11], [], 1) == {}
