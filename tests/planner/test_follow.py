"""``Router(static_graph=...)``: later backwards follow paths to the plan's nodes instead of walking the graph;
by default every backward walks.

Every routed gradient is compared with a fresh forward and ``torch.autograd.grad`` per loss; ``Router.graph_counts``
only shows which way a backward took (walked or followed).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import gradroute
from gradroute._graph import walk
from gradroute._planner.follow import paths, trace
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
    assert router.graph_counts.followed > 0  # some were located, not walked


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
    assert router.graph_counts.followed == 2


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
    assert router.graph_counts.followed == 1
    for p in _params(tenc, extra, unet):
        p.grad = None
    forward = _widened(tenc, extra, unet, widen=True)
    expected = reference_grads(forward, groups)
    route_into_grad(router, method, forward(), _params(tenc, extra, unet))
    assert router.graph_counts.followed == 2  # followed, not walked: the change was not seen
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
    located = router.graph_counts.followed
    for p in _params(tenc, unet):
        p.grad = None
    with pytest.raises(gradroute.GraphFreedError, match=r"`tenc`.* already freed"):
        router.backward(**_forward(tenc, unet, free_tenc=True)())
    assert router.graph_counts.followed == located + 1
    assert all(p.grad is None for p in _params(tenc, unet))


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
    found = trace(p, [again["tenc"].grad_fn, again["unet"].grad_fn])
    assert found is not None
    for j in wanted:
        assert found[j] is g2.nodes[j]
    other = _forward(tenc, unet, branch=True)()
    assert trace(p, [other["tenc"].grad_fn, other["unet"].grad_fn]) is None


# ---------------------------------------------------------------------- the default walks every backward


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


@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize("change", ["branch", "widen", "gradroute"])
@pytest.mark.parametrize(
    "options", [gradroute.PlanOptions(), gradroute.PlanOptions(split=False)], ids=["cut", "split=False"]
)
def test_default_stays_exact_when_a_graph_seen_many_times_changes(options, change, method):
    # 20 backwards of one graph, then another graph of the same groups: every backward walks, so each is exact
    tenc, unet, extra, groups, router = _one_call_per_route(plan_options=options)
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=20, method=method)
    _routed_exactly(router, _chain(tenc, unet, extra, change), groups, steps=3, method=method)
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=2, method=method)
    assert router.graph_counts.followed == 0


@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize(
    ("change", "error"),
    [
        ("detached", r"loss for group `tenc` reaches none of that group's"),
        ("reentrant", r"reentrant torch.utils.checkpoint segment"),
    ],
)
def test_default_refuses_at_once_after_a_graph_seen_many_times(change, error, method):
    # what a walk refuses is refused on the step it first appears, with every .grad as it was
    tenc, unet, extra, groups, router = _one_call_per_route()
    _routed_exactly(router, _chain(tenc, unet, extra), groups, steps=20, method=method)
    params = [p for ps in groups.values() for p in ps]
    for p in params:
        p.grad = None
    with pytest.raises(ValueError, match=error):
        route_into_grad(router, method, _chain(tenc, unet, extra, change)(), params)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("static_graph", [False, True])
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
    assert (router.graph_counts.followed > 0) == bool(static_graph)
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
    assert router.graph_counts.followed > 0
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
    assert router.graph_counts.followed == 2
    assert all(p.grad is None for p in [*a.parameters(), *b.parameters()])


def test_static_graph_follows_nothing_under_ddp(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tenc, unet, extra, groups, _ = _one_call_per_route()
        d_tenc, d_unet = DDP(tenc), DDP(unet)
        named = {n: gradroute.Group(ps, ddp=d) for (n, ps), d in zip(groups.items(), (d_tenc, d_unet), strict=True)}
        router = gradroute.Router(named, autotune=False, static_graph=True)
        _routed_exactly(router, _chain(d_tenc, d_unet, extra), groups, steps=12)
        assert router.graph_counts.followed == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which", ["a parameter", "a group"])
@pytest.mark.parametrize("method", ["backward", "grads"])
@pytest.mark.parametrize(
    "options", [gradroute.PlanOptions(), gradroute.PlanOptions(split=False)], ids=["cut", "split=False"]
)
@pytest.mark.parametrize("static_graph", [False, True])
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


def _mlp(i: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, 16), nn.Tanh(), nn.Linear(16, o)).to(D)


def _reference_step(router, forward, groups) -> None:
    """One routed backward of ``forward`` from empty gradients, against per-loss references (a parameter in
    several groups gets the sum)."""
    params = list({id(p): p for ps in groups.values() for p in ps}.values())
    expected = reference_grads(forward, groups)
    for p in params:
        p.grad = None
    router.backward(**forward())
    assert_grads_match(params, expected, rtol=1e-10, atol=1e-12)


def test_default_exact_when_two_sources_take_turns_over_a_tied_embedding_and_an_adapter_joins_late():
    # token batches (through a tied embedding) take turns with feature batches; an adapter joins the text
    # encoder's path at step 50: it must get its gradient on every token step from then on
    torch.manual_seed(0)
    emb, adapter = nn.Embedding(20, 8).to(D), nn.Linear(8, 8).to(D)
    tenc, unet = _mlp(8, 8), _mlp(8, 6)
    groups = {
        "tenc": [*emb.parameters(), *adapter.parameters(), *tenc.parameters()],
        "unet": [*emb.parameters(), *unet.parameters()],
    }
    router = gradroute.Router(groups)

    def losses(step: int):
        def run() -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(step)
            t = torch.randn(4, 6, generator=g, dtype=D)
            if step >= 14 and step % 2 == 0:
                e = emb(torch.randint(0, 20, (4, 3), generator=g)).mean(1)
                if step >= 50:
                    e = e + torch.tanh(adapter(e))
                y = unet(tenc(e) + 0.1 * e)
            else:
                y = unet(tenc(torch.randn(4, 8, generator=g, dtype=D)))
            err = (y - t).pow(2)
            return {"tenc": err.mean(), "unet": err[:2].mean()}

        return run

    for step in range(60):
        _reference_step(router, losses(step), groups)


def test_default_exact_when_a_graph_alternates_with_another():
    # a branch on every other step (a regulariser, an R1 penalty): every step against the reference
    torch.manual_seed(0)
    tenc, unet = _mlp(8, 8), _mlp(8, 8)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    router = gradroute.Router(groups)

    def losses(step: int):
        def run() -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(step)
            pred = unet(tenc(torch.randn(4, 8, generator=g, dtype=D)))
            if step >= 14 and step % 2 == 0:
                pred = pred * 1.5
            err = (pred - torch.randn(4, 8, generator=g, dtype=D)).pow(2)
            return {"tenc": err.mean(), "unet": err[:2].mean()}

        return run

    for step in range(40):
        _reference_step(router, losses(step), groups)
