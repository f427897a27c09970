"""The whole pipeline on a hand-built graph, and the plan it describes."""

from __future__ import annotations

import dataclasses

import pytest

from gradroute import PlanOptions
from gradroute._planner import Checkpoints, analyse
from gradroute._planner.describe import describe
from gradroute._planner.passes import merge_routes
from gradroute._planner.per_call import PerCall
from gradroute._planner.reach import reach

from ._chain import NAMES, ROOTS, chain


def test_analyse_plans_the_chain() -> None:
    g, params = chain()
    planned = analyse(g, NAMES, params, ROOTS, merge_shared=True, options=PlanOptions())
    plan = planned.plan
    assert plan.passes == (("tenc",), ("unet",))
    assert [(c.index, c.groups, c.retain) for c in plan.calls] == [
        (1, ("tenc",), True),
        (2, ("unet",), False),
        (3, ("tenc",), False),
    ]
    assert plan.leaks == {"tenc": ("unet",), "unet": ("tenc",)}
    assert (plan.kept_nodes, plan.graph_nodes, plan.notes) == (0, 6, ())
    assert planned.shared == (2,)
    assert planned.per_call == () and planned.unreached == ()
    assert planned.leaf_routes == {3: 0b11, 5: 0b11}


def test_analyse_reads_the_segments_it_is_given() -> None:
    g, params = chain()
    # nodes 2 and 4 (sequence numbers 4 and 2) in one segment, 100 bytes each: a retaining call holds them
    segments = Checkpoints(segments=lambda nodes: [(2, 5)], node_bytes=lambda node: 100)
    planned = analyse(g, NAMES, params, ROOTS, merge_shared=True, options=PlanOptions(held_factor=0.0))
    assert planned.plan.notes == ()
    planned = analyse(
        g, NAMES, params, ROOTS, merge_shared=True, options=PlanOptions(held_factor=0.0), checkpoints=segments
    )
    assert planned.per_call == (2, 4)
    assert len(planned.plan.notes) == 1 and planned.plan.notes[0].startswith("1 gradroute.checkpoint segment(s)")


@pytest.mark.parametrize(("chunks", "segments", "n_notes"), [(0, 0, 0), (2, 0, 1), (0, 1, 1), (3, 2, 2)])
def test_describe_notes_shared_chunks_and_per_call_segments(chunks: int, segments: int, n_notes: int) -> None:
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    plan = describe(
        NAMES,
        found,
        merge_routes(found),
        (0, 1),
        [],
        kept=0,
        graph_nodes=6,
        chunks=chunks,
        per_call=PerCall(nodes=(), segments=segments),
    )
    assert len(plan.notes) == n_notes
    if chunks:
        assert plan.notes[0].startswith(f"{chunks} chunk(s) of gradroute.checkpoint segments are shared")
    assert dataclasses.is_dataclass(plan) and plan.reach == {
        "tenc": {"tenc": 1, "unet": 1},
        "unet": {"tenc": 1, "unet": 1},
    }
