"""Step 7 on a hand-built graph: the passes' calls interleaved."""

from __future__ import annotations

from gradroute._planner.needs import needs
from gradroute._planner.order import last_use, order_passes
from gradroute._planner.passes import merge_routes
from gradroute._planner.reach import reach
from gradroute._planner.schedule import schedule
from gradroute._planner.stage import PassInputs, stage_pass

from ._chain import NAMES, ROOTS, chain


def test_the_unet_pass_runs_between_the_text_encoder_calls() -> None:
    # the retaining text-encoder call must come before the UNet call that frees node 2; then the UNet's call
    # (its nodes made later than the text encoder's) goes before the text encoder's freeing call
    g, params = chain()
    found = reach(g, params, ROOTS, merge_shared=True)
    passes = merge_routes(found)
    need = needs(g, found, passes)
    order = order_passes(g, need, 2)
    last = last_use(need, order)
    per_pass = [
        stage_pass(g, PassInputs(k, passes.routes[k], (NAMES[k],), ROOTS, found.owners), need, last, {}) for k in order
    ]
    scheduled = schedule(g, per_pass, ROOTS)
    assert [(c.groups, c.retain) for c in scheduled.calls] == [
        (("tenc",), True),
        (("unet",), False),
        (("tenc",), False),
    ]
    assert scheduled.kept == 0
    assert [sorted(m) for m in scheduled.members] == [[0, 2], [1, 2], [4]]
