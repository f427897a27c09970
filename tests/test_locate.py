"""``Router(static_graph=...)``: later backwards follow paths to the plan's nodes instead of walking the graph.

Every routed gradient is compared with a fresh forward and ``torch.autograd.grad`` per loss; the counters of the
router's plan cache only show which path a backward took (walked or located).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import gradroute
from gradroute._graph import walk
from gradroute._locate import follow, paths
from tests._reference import assert_grads_match, reference_grads, route_into_grad

D = torch.float64


def _nets() -> tuple[nn.Module, nn.Module]:
    tenc = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)).to(D)
    unet = nn.Sequential(nn.Linear(6, 6), nn.SiLU(), nn.Linear(6, 3)).to(D)
    return tenc, unet


def _forward(tenc: nn.Module, unet: nn.Module, ckpt: str = "none", branch: bool = False, free_tenc: bool = False):
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)
    target = torch.linspace(0, 1, 15, dtype=D).reshape(5, 3)
    mask = (torch.arange(15).reshape(5, 3) % 2).to(D)

    def run() -> dict[str, torch.Tensor]:
        h = tenc(x)
        if free_tenc:  # another backward frees the text encoder's nodes, away from the losses
            torch.autograd.grad(h.sum(), list(tenc.parameters()))
        if branch:
            h = h.sin()  # another graph below the losses
        out = gradroute.checkpoint(unet, h) if ckpt == "gradroute" else unet(h)
        loss = (out - target).pow(2)
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return run


def _params(*modules: nn.Module) -> list[torch.Tensor]:
    return [p for m in modules for p in m.parameters()]


@pytest.mark.parametrize("ckpt", ["none", "gradroute"])
@pytest.mark.parametrize("every", [True, 2, 3])
def test_static_graph_routes_exactly_on_walked_and_located_backwards(ckpt, every):
    tenc, unet = _nets()
    forward = _forward(tenc, unet, ckpt)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet, static_graph=every)
    steps = after = 0
    while after < 6:  # nothing is located while the measured choice measures
        for p in _params(tenc, unet):
            p.grad = None
        router.backward(**forward())
        assert_grads_match(_params(tenc, unet), expected, rtol=1e-10, atol=1e-12)
        steps += 1
        after += not router.autotuning
        assert steps < 50
    assert router._cache.located > 0  # some were located, not walked


def test_static_graph_grads_exact_and_grad_untouched():
    tenc, unet = _nets()
    forward = _forward(tenc, unet)
    # no measured choice: its trials walk (the backwards located are counted)
    router = gradroute.Router(tenc=tenc, unet=unet, static_graph=True, autotune=False)
    for _ in range(4):
        out = router.grads(**forward())
        for name, module in (("tenc", tenc), ("unet", unet)):
            ref = torch.autograd.grad(forward()[name], list(module.parameters()))
            for g, r in zip(out[name], ref):
                torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in _params(tenc, unet))
    assert router._cache.located == 2


@pytest.mark.parametrize("every", [2, 100])
def test_static_graph_changed_graph_fails_before_any_gradient_is_written(every):
    """Found by the periodic walk (``every=2``: this backward walks) or on the paths (``every=100``: the new
    ``sin`` node sits on the path from the losses to the cut)."""
    tenc, unet = _nets()
    router = gradroute.Router(tenc=tenc, unet=unet, static_graph=every, autotune=False)  # located from the third
    for _ in range(3):
        router.backward(**_forward(tenc, unet)())
    for p in _params(tenc, unet):
        p.grad = None
    with pytest.raises(RuntimeError, match=r"`static_graph` was set, but the autograd graph of the losses routed to"):
        router.backward(**_forward(tenc, unet, branch=True)())
    assert all(p.grad is None for p in _params(tenc, unet))


def _widened(tenc: nn.Module, extra: nn.Module, unet: nn.Module, widen: bool):
    """The losses, with the text encoder's output passed through ``extra`` too when ``widen``: a parameter of
    the ``tenc`` group that the first graphs do not reach, off every path a plan follows."""
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)
    target = torch.linspace(0, 1, 15, dtype=D).reshape(5, 3)

    def run() -> dict[str, torch.Tensor]:
        h = tenc(x)
        if widen:
            h = h + extra(h)
        loss = (unet(h) - target).pow(2)
        return {"tenc": loss.mean(), "unet": loss[:3].mean()}

    return run


@pytest.mark.parametrize("method", ["backward", "grads"])
def test_static_graph_plan_of_one_call_per_route_stays_exact_when_the_graph_changes_off_the_paths(method):
    tenc, unet = _nets()
    extra = nn.Linear(6, 6).to(D)
    groups = {"tenc": [*tenc.parameters(), *extra.parameters()], "unet": list(unet.parameters())}
    router = gradroute.Router(
        groups, static_graph=100, autotune=False, plan_options=gradroute.PlanOptions(split=False)
    )  # no periodic walk in this test
    for _ in range(3):  # walked, confirmed, located
        route_into_grad(router, method, _widened(tenc, extra, unet, widen=False)(), _params(tenc, extra, unet))
    assert router._cache.located == 1
    for p in _params(tenc, extra, unet):
        p.grad = None
    forward = _widened(tenc, extra, unet, widen=True)
    expected = reference_grads(forward, groups)
    route_into_grad(router, method, forward(), _params(tenc, extra, unet))
    assert router._cache.located == 2  # followed, not walked: the change was not seen
    assert_grads_match(_params(tenc, extra, unet), expected, rtol=1e-10, atol=1e-12)


def test_static_graph_group_frozen_since_never_takes_another_groups_gradient():
    # the plan's call for `tenc` has no parameters left to backpropagate into: it must not run without any
    tenc, unet = _nets()
    forward = _forward(tenc, unet)
    router = gradroute.Router(
        tenc=tenc, unet=unet, static_graph=100, autotune=False, plan_options=gradroute.PlanOptions(split=False)
    )
    for _ in range(3):
        router.backward(**forward())
    tenc.requires_grad_(False)
    for p in _params(tenc, unet):
        p.grad = None
    expected = reference_grads(forward, {"unet": list(unet.parameters())}, names=["unet"])
    with contextlib.suppress(RuntimeError):  # torch refuses an input that does not require grad
        router.backward(**forward())
    assert all(p.grad is None for p in tenc.parameters())
    for p in unet.parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, expected[id(p)], rtol=1e-10, atol=1e-12)


def test_static_graph_loss_backpropagated_twice_fails_before_any_gradient_is_written():
    tenc, unet = _nets()
    forward = _forward(tenc, unet)
    router = gradroute.Router(tenc=tenc, unet=unet, static_graph=True)
    for _ in range(2):
        router.backward(**forward())
    losses = forward()
    router.backward(**losses)  # located
    before = [p.grad.clone() for p in _params(tenc, unet)]
    with pytest.raises(gradroute.GraphFreedError, match=r"a loss routed to `tenc`, `unet`: .* already freed"):
        router.backward(**losses)
    for p, b in zip(_params(tenc, unet), before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)


def test_static_graph_graph_freed_away_from_the_losses_leaves_empty_gradients_empty():
    # a located backward probes only a few nodes, those the plan's last engine call runs (here the resumed pass
    # into the text encoder, which finds it freed before any call); else the engine meets a freed node, possibly
    # after other calls wrote gradients, which were None before and are None again
    tenc, unet = _nets()
    router = gradroute.Router(tenc=tenc, unet=unet, static_graph=True, autotune=False)
    for _ in range(3):
        for p in _params(tenc, unet):
            p.grad = None
        router.backward(**_forward(tenc, unet)())
    located = router._cache.located
    for p in _params(tenc, unet):
        p.grad = None
    with pytest.raises(gradroute.GraphFreedError, match=r"`tenc`.* already freed"):
        router.backward(**_forward(tenc, unet, free_tenc=True)())
    assert router._cache.located == located + 1
    assert all(p.grad is None for p in _params(tenc, unet))


def test_static_graph_off_by_default_walks_every_backward():
    tenc, unet = _nets()
    router = gradroute.Router(tenc=tenc, unet=unet)
    for branch in (False, True, False, True):  # a graph that changes is fine without the promise
        router.backward(**_forward(tenc, unet, branch=branch)())
    assert router._cache.located == 0


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-3, ValueError), ("yes", TypeError), (2.5, TypeError)])
def test_static_graph_bad_value_fails(value, error):
    with pytest.raises(error, match=r"`static_graph` must be"):
        gradroute.Router(a=nn.Linear(2, 2), static_graph=value)


def test_follow_finds_the_same_nodes_in_a_new_graph_and_refuses_another():
    tenc, unet = _nets()
    losses = _forward(tenc, unet)()
    roots = [losses["tenc"].grad_fn, losses["unet"].grad_fn]
    g = walk(roots, {})
    wanted = [len(g.nodes) - 1, len(g.nodes) // 2]
    p = paths(g, roots, wanted)
    again = _forward(tenc, unet)()
    g2 = walk([again["tenc"].grad_fn, again["unet"].grad_fn], {})
    found = follow(p, [again["tenc"].grad_fn, again["unet"].grad_fn])
    assert found is not None
    for j in wanted:
        assert found[j] is g2.nodes[j]
    other = _forward(tenc, unet, branch=True)()
    assert follow(p, [other["tenc"].grad_fn, other["unet"].grad_fn]) is None


# ---------------------------------------------------------------------- following without a promise (the default)


def _chain(tenc: nn.Module, unet: nn.Module, extra: nn.Module, change: str = "none"):
    """The losses of the chain; ``change`` gives another graph of the same groups: ``"branch"`` (another op
    below the losses), ``"widen"`` (``extra``, a ``tenc`` parameter the first graphs do not reach),
    ``"gradroute"`` (the unet checkpointed), ``"detached"`` (the ``tenc`` loss reaches no ``tenc`` parameter),
    ``"reentrant"`` (the text encoder's last layers in a reentrant ``torch.utils.checkpoint`` segment)."""
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)
    target = torch.linspace(0, 1, 15, dtype=D).reshape(5, 3)

    def run() -> dict[str, torch.Tensor]:
        if change == "reentrant":  # away from the losses, off the paths that are followed
            h = torch.utils.checkpoint.checkpoint(tenc[1:], tenc[0](x), use_reentrant=True)
        else:
            h = tenc(x)
        if change == "branch":
            h = h.sin()
        elif change == "widen":
            h = h + extra(h)
        elif change == "detached":
            h = h.detach().requires_grad_()
        out = gradroute.checkpoint(unet, h) if change == "gradroute" else unet(h)
        loss = (out - target).pow(2)
        return {"tenc": loss.mean(), "unet": loss[:3].mean()}

    return run


def _one_call_per_route(**kw):
    """The nets and a router whose plan is one engine call per route capturing nothing (exact on any graph)."""
    tenc, unet = _nets()
    extra = nn.Linear(6, 6).to(D)
    groups = {"tenc": [*tenc.parameters(), *extra.parameters()], "unet": list(unet.parameters())}
    kw.setdefault("plan_options", gradroute.PlanOptions(split=False))
    return tenc, unet, extra, groups, gradroute.Router(groups, autotune=False, **kw)


def _under_ddp(groups, d_tenc, d_unet):
    """The router of :func:`_one_call_per_route` with each group naming the DDP that holds it."""
    named = {"tenc": gradroute.Group(groups["tenc"], ddp=d_tenc), "unet": gradroute.Group(groups["unet"], ddp=d_unet)}
    return gradroute.Router(named, autotune=False, plan_options=gradroute.PlanOptions(split=False))


def _routed_exactly(router, forward, groups, steps: int, method: str = "backward") -> None:
    """``steps`` routed backwards of ``forward`` (``router.backward`` or ``router.grads``), each from empty
    gradients, each against the reference."""
    expected = reference_grads(forward, groups)
    params = [p for ps in groups.values() for p in ps]
    for _ in range(steps):
        for p in params:
            p.grad = None
        route_into_grad(router, method, forward(), params)
        assert_grads_match(params, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ckpt", ["none", "gradroute"])
def test_default_follows_a_graph_walked_eight_times_in_a_row_whose_plan_is_exact_on_any_graph(ckpt):
    tenc, unet, extra, groups, router = _one_call_per_route()
    forward = _chain(tenc, unet, extra, "gradroute" if ckpt == "gradroute" else "none")
    _routed_exactly(router, forward, groups, steps=8)
    assert router._cache.located == 0  # walked eight times
    _routed_exactly(router, forward, groups, steps=31)
    assert router._cache.located == 31  # followed
    _routed_exactly(router, forward, groups, steps=2)
    assert router._cache.located == 32  # the 32nd walks again, then following goes on


@pytest.mark.parametrize(
    ("static_graph", "options"),
    [(None, gradroute.PlanOptions()), (False, gradroute.PlanOptions(split=False))],
    ids=["plan depends on the graph", "static_graph=False"],
)
def test_default_walks_every_backward_where_the_plan_depends_on_the_graph_or_static_graph_is_false(
    static_graph, options
):
    tenc, unet, extra, groups, router = _one_call_per_route(static_graph=static_graph, plan_options=options)
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=12)
    assert router._cache.located == 0


@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize("change", ["branch", "widen", "gradroute"])
def test_default_following_stays_exact_when_the_graph_changes_and_plans_the_new_graph(change, method):
    tenc, unet, extra, groups, router = _one_call_per_route()
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=10, method=method)
    located = router._cache.located
    # followed until the periodic walk (no error: nothing was promised), exact all the same
    _routed_exactly(router, _chain(tenc, unet, extra, change), groups, steps=40, method=method)
    assert router._cache.located > located
    assert len(router._cache) == 2  # the new graph has its own analysis


@pytest.mark.parametrize("method", ["backward", "grads"])
def test_default_following_a_loss_that_stopped_reaching_its_group_fails_with_every_gradient_empty(method):
    tenc, unet, extra, groups, router = _one_call_per_route()
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=10, method=method)
    located = router._cache.located
    for p in _params(tenc, extra, unet):
        p.grad = None
    with pytest.raises(ValueError, match=r"loss for group `tenc` reaches none of that group's 6 parameters"):
        route_into_grad(router, method, _chain(tenc, unet, extra, "detached")(), _params(tenc, extra, unet))
    assert router._cache.located == located + 1  # followed: refused after the engine calls, as the walk would
    assert all(p.grad is None for p in _params(tenc, extra, unet))


class _DropsSecond(torch.autograd.Function):
    """``a * b`` whose backward returns None for ``b``: valid autograd; ``b`` is connected but gets nothing."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@pytest.mark.parametrize("method", ["backward", "grads"])
def test_default_following_a_group_connected_only_through_a_dropped_gradient_is_not_refused(method):
    # the walk finds `tenc`'s loss connected to its parameters and routes (they get no gradient): so does a
    # followed backward, which sees no gradient arrive and walks to tell an unreached group from this
    tenc, unet, _extra, groups, router = _one_call_per_route()
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)

    def forward() -> dict[str, torch.Tensor]:
        loss = unet(tenc(x)).pow(2).mean()
        return {"tenc": _DropsSecond.apply(unet[2].bias.sum(), loss), "unet": loss * 1.0}

    _routed_exactly(router, forward, groups, steps=12, method=method)
    assert router._cache.located > 0
    assert all(p.grad is None for p in groups["tenc"])


def test_default_following_a_loss_that_stopped_reaching_its_own_parameters_is_refused_when_groups_share_one():
    # `shared` is in both groups: the unet's call writes its gradient, which says nothing about the tenc loss
    tenc, unet = _nets()
    shared = nn.Linear(6, 6).to(D)
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)
    groups = {"tenc": [*tenc.parameters(), *shared.parameters()], "unet": [*unet.parameters(), *shared.parameters()]}
    router = gradroute.Router(groups, autotune=False, plan_options=gradroute.PlanOptions(split=False))

    def forward(changed: bool = False):
        def run() -> dict[str, torch.Tensor]:
            b = shared(tenc(x))
            out = unet(b)
            side = unet(b.detach()) if changed else out
            return {"tenc": side.pow(2).mean(), "unet": out[:3].pow(2).mean()}

        return run

    _routed_exactly(router, forward(), groups, steps=10)
    located = router._cache.located
    assert located > 0
    params = _params(tenc, shared, unet)
    for p in params:
        p.grad = None
    with pytest.raises(ValueError, match=r"loss for group `tenc` reaches none of that group's 6 parameters"):
        router.backward(**forward(changed=True)())
    assert router._cache.located == located + 1
    assert all(p.grad is None for p in params)


def test_default_an_entry_dropped_from_the_plan_cache_is_not_followed():
    tenc, unet, _extra, _groups, router = _one_call_per_route()
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)

    def losses(n_unet: int = 1) -> dict:
        loss = unet(tenc(x)).pow(2)
        return {"tenc": loss.mean(), "unet": [loss[: k + 1].mean() for k in range(n_unet)]}

    for _ in range(10):
        router.backward(**losses())
        router.zero_grad()
    assert router._cache.located > 0
    for n in range(2, 10):  # eight other call shapes fill the cache (8 entries): the first is dropped
        router.backward(**losses(n))
        router.zero_grad()
    located = router._cache.located
    router.backward(**losses())
    assert router._cache.located == located  # walked and planned anew


def test_default_plan_printout_under_ddp_does_not_say_backwards_follow(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tenc, unet, extra, groups, _ = _one_call_per_route()
        d_tenc, d_unet = DDP(tenc), DDP(unet)
        router = _under_ddp(groups, d_tenc, d_unet)
        forward = _chain(d_tenc, d_unet, extra)
        _routed_exactly(router, forward, groups, steps=10)
        notes = [n for n in router.plan(**forward()).notes if n.startswith("walk:")]
        assert len(notes) == 1 and "Router(static_graph=True)" in notes[0] and "follow the paths" not in notes[0]
    finally:
        dist.destroy_process_group()


def test_default_with_gradients_to_add_to_walks_and_refuses_a_loss_that_stopped_reaching_its_group_at_once():
    # the default follows only where every .grad is empty: an accumulation window's later backwards walk and probe
    tenc, unet, extra, _groups, router = _one_call_per_route()
    for _ in range(10):
        router.backward(**_chain(tenc, unet, extra)())
    assert router._cache.located == 0
    before = [p.grad.clone() for p in _params(tenc, unet)]
    with pytest.raises(ValueError, match=r"loss for group `tenc` reaches none of that group's 6 parameters"):
        router.backward(**_chain(tenc, unet, extra, "detached")())
    for p, b in zip(_params(tenc, unet), before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)


def test_default_following_a_graph_that_gained_a_reentrant_checkpoint_fails_naming_it():
    tenc, unet, extra, groups, router = _one_call_per_route()
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=10)
    for p in _params(tenc, extra, unet):
        p.grad = None
    located = router._cache.located
    with pytest.raises(ValueError, match=r"reentrant torch.utils.checkpoint segment \(use_reentrant=True\)") as e:
        router.backward(**_chain(tenc, unet, extra, "reentrant")())
    assert router._cache.located == located + 1  # followed: the engine refused it first
    assert isinstance(e.value.__cause__, RuntimeError)
    assert all(p.grad is None for p in _params(tenc, extra, unet))
    with pytest.raises(ValueError, match=r"reentrant torch.utils.checkpoint segment"):
        router.backward(**_chain(tenc, unet, extra, "reentrant")())
    assert router._cache.located == located + 1  # the next backward walked


def _segment_off_the_calls(change: str):
    """A router of groups `a` (with `e`) and `b`, and a forward whose `e` moves, with ``change``, into a reentrant
    ``torch.utils.checkpoint`` segment whose only input is a leaf of no group: no engine call of the plan runs it
    (``"reentrant"``); ``"reentrant, detached"`` keeps `e` out of the segment (it runs ``sin``) and detaches `a`'s
    loss from `a`'s parameters as well."""
    a, b = _nets()
    e = nn.Linear(4, 4).to(D)
    z = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4).requires_grad_()
    x = torch.linspace(0, 1, 20, dtype=D).reshape(5, 4)
    groups = {"a": [*a.parameters(), *e.parameters()], "b": list(b.parameters())}
    router = gradroute.Router(groups, autotune=False, plan_options=gradroute.PlanOptions(split=False))

    def forward(changed: bool) -> dict[str, torch.Tensor]:
        inner = torch.sin if change == "reentrant, detached" else e
        side = torch.utils.checkpoint.checkpoint(inner, z, use_reentrant=True) if changed else e(z)
        h = a(x + side)
        if changed and change == "reentrant, detached":
            h = h.detach() + side.sum()
        loss = b(h).pow(2)
        return {"a": loss.mean(), "b": loss[:3].mean()}

    return router, forward, groups


@pytest.mark.parametrize("change", ["reentrant", "reentrant, detached"])
def test_default_following_a_reentrant_segment_no_engine_call_runs_is_refused_with_every_gradient_empty(change):
    # the engine skips the segment (it leads to no call's inputs); the parameters it hides get no gradient,
    # which makes the router walk, find it and refuse it, as a walking router does
    router, forward, groups = _segment_off_the_calls(change)
    _routed_exactly(router, lambda: forward(False), groups, steps=10)
    params = [p for ps in groups.values() for p in ps]
    for p in params:
        p.grad = None
    located = router._cache.located
    with pytest.raises(ValueError, match=r"reentrant torch.utils.checkpoint segment \(use_reentrant=True\)"):
        router.backward(**forward(True))
    assert router._cache.located == located + 1  # followed: refused after its engine calls
    assert all(p.grad is None for p in params)
    with pytest.raises(ValueError, match=r"reentrant torch.utils.checkpoint segment"):
        router.backward(**forward(True))
    assert router._cache.located == located + 1  # the next backward walked


@pytest.mark.parametrize("autotune", [False, True])
def test_default_following_a_parameter_that_gets_no_gradient_is_walked_for_once_per_graph(autotune):
    # `unused` requires grad and no loss reaches it: the first followed backward walks to tell (with the plan
    # options the measured choice kept, so that the walk finds the followed plan), later ones do not
    tenc, unet, extra, groups, _router = _one_call_per_route()
    unused = nn.Linear(2, 2).to(D)
    groups = {"tenc": [*groups["tenc"], *unused.parameters()], "unet": groups["unet"]}
    options = gradroute.PlanOptions() if autotune else gradroute.PlanOptions(split=False)
    router = gradroute.Router(groups, autotune=autotune, plan_options=options)
    forward = _chain(tenc, unet, extra)
    for _ in range(40):
        if router._cache.located:
            break
        _routed_exactly(router, forward, groups, steps=1)
    assert router._cache.located == 1
    hits = router._cache.hits
    _routed_exactly(router, forward, groups, steps=20)
    assert router._cache.located == 21
    assert router._cache.hits == hits  # no walk after the first followed backward's


def test_default_following_stops_where_the_walk_after_a_missing_gradient_finds_another_graph():
    # every other backward drops `extra` (a change off the followed paths): the walk its missing gradient makes
    # finds the other graph, and the backwards walk from then on (as for any graph found changed), exact
    tenc, unet, extra, groups, router = _one_call_per_route()
    _routed_exactly(router, _chain(tenc, unet, extra, "widen"), groups, steps=9)
    assert router._cache.located == 1
    for step in range(40):
        _routed_exactly(router, _chain(tenc, unet, extra, "none" if step % 2 == 0 else "widen"), groups, steps=1)
    assert router._cache.located == 2  # the first backward without `extra` only


def _shared_emb():
    """Groups `a` (`emb`, `head_a`, frozen after the router is made) and `b` (`emb`, `head_b`), a router whose plan is
    one engine call per route, and an input."""
    emb, head_a, head_b = (nn.Linear(4, k).to(D) for k in (4, 1, 1))
    groups = {"a": [*emb.parameters(), *head_a.parameters()], "b": [*emb.parameters(), *head_b.parameters()]}
    router = gradroute.Router(groups, autotune=False, plan_options=gradroute.PlanOptions(split=False))
    head_a.requires_grad_(False)
    return emb, head_a, head_b, groups, router, torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)


def test_default_following_refuses_a_group_of_shared_parameters_routed_alone():
    # `a` trains only `emb`, which `b` shares; `b` is not routed, so `emb`'s missing gradient tells
    emb, head_a, head_b, _groups, router, x = _shared_emb()
    z = torch.zeros(5, 4, dtype=D, requires_grad=True)  # keeps `head_a`'s input requiring grad

    def forward(detached: bool = False) -> dict[str, torch.Tensor]:
        e = emb(x)
        h = (e.detach() if detached else e) + z * 0
        return {"a": (head_a(h) + head_b(x)).pow(2).mean()}

    _routed_exactly(router, forward, {"a": list(emb.parameters())}, steps=10)
    located = router._cache.located
    assert located > 0
    for p in emb.parameters():
        p.grad = None
    with pytest.raises(ValueError, match=r"loss for group `a` reaches none of that group's 4 parameters"):
        router.backward(**forward(detached=True))
    assert router._cache.located == located + 1
    assert all(p.grad is None for p in emb.parameters())


class _HookFailed(Exception):
    pass


def test_default_followed_backward_that_fails_half_way_leaves_empty_gradients_empty_and_the_next_walks():
    tenc, unet, extra, groups, router = _one_call_per_route()
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)
    calls = []

    def forward(fail: bool = False) -> dict[str, torch.Tensor]:
        mid = unet[0](tenc(x))
        if fail:  # both engine calls pass here: the second raises, after the first wrote its gradients

            def hook(grad: torch.Tensor) -> torch.Tensor:
                calls.append(1)
                if len(calls) == 2:
                    raise _HookFailed
                return grad

            mid.register_hook(hook)
        loss = unet[2](unet[1](mid)).pow(2)
        return {"tenc": loss.mean(), "unet": loss[:3].mean()}

    _routed_exactly(router, forward, groups, steps=10)
    located = router._cache.located
    for p in _params(tenc, extra, unet):
        p.grad = None
    with pytest.raises(_HookFailed):
        router.backward(**forward(fail=True))
    assert len(calls) == 2
    assert router._cache.located == located + 1  # it was followed
    assert all(p.grad is None for p in _params(tenc, extra, unet))
    _routed_exactly(router, forward, groups, steps=1)
    assert router._cache.located == located + 1  # the next one walked


@pytest.mark.parametrize("static_graph", [None, True])
def test_followed_backward_of_losses_backpropagated_twice_fails_before_adding_to_any_gradient(static_graph):
    # `a`'s graph keeps no tensors, and its engine call runs first: without a probe past the losses (whose nodes
    # keep none either), it would add to `a.grad` before `b`'s call met the freed graph. With gradients to add
    # to, only `static_graph` follows; the default walks and probes the whole graph
    a = nn.Parameter(torch.linspace(-1, 1, 6, dtype=D))
    b = nn.Parameter(torch.linspace(0, 2, 6, dtype=D))
    router = gradroute.Router(
        a=[a], b=[b], autotune=False, static_graph=static_graph, plan_options=gradroute.PlanOptions(split=False)
    )

    def forward() -> dict[str, torch.Tensor]:
        h = (a + b).sum()  # AddBackward0 and SumBackward0 keep no tensors
        return {"a": h + 1, "b": h * h + 1}

    assert [c.groups for c in router.plan(**forward()).calls] == [("a",), ("b",)]
    for _ in range(10):  # gradients add up: every backward probes
        router.backward(**forward())
    losses = forward()
    router.backward(**losses)
    assert (router._cache.located > 0) == bool(static_graph)
    before = [a.grad.clone(), b.grad.clone()]
    with pytest.raises(gradroute.GraphFreedError, match=r"already freed"):
        router.backward(**losses)
    for p, g in zip([a, b], before):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


@pytest.mark.parametrize("short_term", [False, True])
def test_static_graph_losses_backpropagated_twice_where_the_first_call_retains_fail_before_adding_to_any_gradient(
    short_term,
):
    # the nodes nearest the losses that keep tensors include `reg`'s square, run only by the text encoder's call,
    # which retains: the first routed backward leaves it alive. The freed check probes the last call's nodes
    # (`short_term`: the shortest of its paths, to `q`, keeps no tensor; a longer one does)
    tenc, unet = _nets()
    reg = nn.Parameter(torch.linspace(-1, 1, 6, dtype=D))
    q = nn.Parameter(torch.linspace(0, 1, 3, dtype=D))
    x = torch.linspace(-1, 1, 20, dtype=D).reshape(5, 4)
    groups = {"tenc": [*tenc.parameters(), reg], "unet": [*unet.parameters(), q]}
    options = gradroute.PlanOptions(split=False)
    router = gradroute.Router(groups, autotune=False, static_graph=True, plan_options=options)

    def forward() -> dict[str, torch.Tensor]:
        out = unet(tenc(x))
        extra = reg.pow(2).sum()  # made last: the engine runs it first
        return {"tenc": out.pow(2).mean() + extra, "unet": out[:3].mean() + (q.sum() if short_term else 0)}

    for _ in range(3):
        router.backward(**forward())
    losses = forward()
    router.backward(**losses)
    assert router._cache.located > 0
    params = [*_params(tenc, unet), reg, *([q] if short_term else [])]
    before = [p.grad.clone() for p in params]
    with pytest.raises(gradroute.GraphFreedError, match=r"already freed"):
        router.backward(**losses)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0)


def test_static_graph_plan_of_no_engine_call_is_followed():
    # every loss reaches only the other group's parameters (allowed): the plan has no engine call
    a, b = nn.Linear(3, 3).to(D), nn.Linear(3, 3).to(D)
    x = torch.linspace(-1, 1, 6, dtype=D).reshape(2, 3)
    router = gradroute.Router(a=a, b=b, allow_unreached=True, autotune=False, static_graph=True)
    for _ in range(4):
        router.backward(a=b(x).pow(2).mean(), b=a(x).pow(2).mean())
    assert router._cache.located == 2
    assert all(p.grad is None for p in [*a.parameters(), *b.parameters()])


def test_default_following_does_not_walk_for_a_group_whose_own_parameters_were_frozen_since():
    # `a` trains only the shared `emb` now, which gets a gradient: no parameter left without one, no walk
    emb, head_a, head_b, groups, router, x = _shared_emb()

    def forward() -> dict[str, torch.Tensor]:
        h = emb(x)
        return {"a": (head_a(h) + head_b(h)).pow(2).mean(), "b": head_b(h).pow(2).mean()}

    trained = {name: [p for p in ps if p.requires_grad] for name, ps in groups.items()}
    _routed_exactly(router, forward, trained, steps=10)
    located, hits = router._cache.located, router._cache.hits
    _routed_exactly(router, forward, trained, steps=20)
    assert router._cache.located == located + 20
    assert router._cache.hits == hits  # no walk looked anything up


def test_default_follows_nothing_under_ddp(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tenc, unet, extra, groups, _ = _one_call_per_route()
        d_tenc, d_unet = DDP(tenc), DDP(unet)
        router = _under_ddp(groups, d_tenc, d_unet)
        _routed_exactly(router, _chain(d_tenc, d_unet, extra), groups, steps=12)
        assert router._cache.located == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which", ["a parameter", "a group"])
@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize(
    "options", [gradroute.PlanOptions(), gradroute.PlanOptions(split=False)], ids=["cut", "split=False"]
)
@pytest.mark.parametrize("static_graph", [False, None, True])
def test_parameters_frozen_between_forward_and_backward_get_no_gradient_as_in_a_plain_backward(
    static_graph, options, method, which
):
    # the graph still holds their AccumulateGrad nodes; the engine refuses them as inputs, a plain backward skips
    # them (and an engine call left with no inputs would write every leaf)
    tenc, unet = _nets()
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    router = gradroute.Router(groups, static_graph=static_graph, autotune=False, plan_options=options)
    forward = _forward(tenc, unet)
    params = _params(tenc, unet)
    _routed_exactly(router, forward, groups, steps=12, method=method)
    frozen = [tenc[0].weight] if which == "a parameter" else groups["tenc"]
    kept = {id(p) for p in params} - {id(p) for p in frozen}
    trained = [p for p in params if id(p) in kept]
    losses = forward()
    for p in frozen:
        p.requires_grad_(False)
    try:
        left = {n: [p for p in ps if id(p) in kept] for n, ps in groups.items()}
        expected = reference_grads(forward, left, names=[n for n, ps in left.items() if ps])
        for p in params:
            p.grad = None
        route_into_grad(router, method, losses, params)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    assert all(p.grad is None for p in frozen)
    assert_grads_match(trained, expected, rtol=1e-10, atol=1e-12)
