"""Router semantics on concrete topologies, each against independent per-loss forwards (float64)."""

from __future__ import annotations

import gc
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradroute
from tests._reference import assert_grads_match, assert_routed_exact, reference_grads

D = torch.float64


def mlp(i: int, o: int, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(i, hidden), nn.Tanh(), nn.Linear(hidden, o)).to(D)


def seed_losses(tenc: nn.Module, unet: nn.Module, x, target, mask):
    def forward():
        pred = unet(tenc(x))
        loss = nn.functional.mse_loss(pred, target, reduction="none")
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return forward


def all_params(*modules: nn.Module) -> list[torch.Tensor]:
    return [p for m in modules for p in m.parameters()]


@pytest.fixture
def chain():
    tenc, unet = mlp(4, 6), mlp(6, 3)
    x, target = torch.randn(5, 4, dtype=D), torch.randn(5, 3, dtype=D)
    mask = (torch.rand(5, 3) > 0.5).to(D)
    return tenc, unet, seed_losses(tenc, unet, x, target, mask)


def test_mlp_chain_exact(chain):
    tenc, unet, forward = chain
    router = gradroute.Router(tenc=tenc, unet=unet)
    expected = reference_grads(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})
    router.backward(**forward())
    assert_grads_match(all_params(tenc, unet), expected)


def test_mapping_form_equals_keywords(chain):
    tenc, unet, forward = chain
    router = gradroute.Router({"tenc": tenc, "unet": list(unet.parameters())})
    expected = reference_grads(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})
    router.backward(dict(forward()))
    assert_grads_match(all_params(tenc, unet), expected)


def test_accumulates_into_existing_grads(chain):
    tenc, unet, forward = chain
    router = gradroute.Router(tenc=tenc, unet=unet)
    for p in all_params(tenc, unet):
        p.grad = torch.randn_like(p)
    base = {id(p): p.grad.clone() for p in all_params(tenc, unet)}
    expected = reference_grads(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})
    router.backward(**forward())
    assert_grads_match(all_params(tenc, unet), expected, base=base)


def test_unnamed_group_untouched(chain):
    tenc, unet, forward = chain
    router = gradroute.Router(tenc=tenc, unet=unet)
    expected = reference_grads(forward, {"tenc": list(tenc.parameters())}, names=["tenc"])
    router.backward(tenc=forward()["tenc"])
    assert_grads_match(list(tenc.parameters()), expected)
    assert all(p.grad is None for p in unet.parameters())


def test_grads_returns_and_leaves_grad_untouched(chain):
    tenc, unet, forward = chain
    router = gradroute.Router(tenc=tenc, unet=unet)
    expected = reference_grads(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})
    out = router.grads(**forward())
    assert set(out) == {"tenc", "unet"}
    for name, module in (("tenc", tenc), ("unet", unet)):
        for p, g in zip(module.parameters(), out[name]):
            torch.testing.assert_close(g, expected[id(p)], rtol=1e-10, atol=1e-12)
            assert p.grad is None


def test_three_networks_three_losses():
    a, b, c = mlp(3, 5), mlp(5, 5), mlp(5, 2)
    x = torch.randn(4, 3, dtype=D)

    def forward():
        ha = a(x)
        hb = b(ha)
        hc = c(hb)
        return {"a": hc.pow(2).mean(), "b": (hc.sin() + hb.mean()).sum(), "c": hc.cos().mean()}

    router = gradroute.Router(a=a, b=b, c=c)
    groups = {"a": list(a.parameters()), "b": list(b.parameters()), "c": list(c.parameters())}
    expected = reference_grads(forward, groups)
    plan = router.plan(**forward())
    assert plan.kept_nodes == 0
    router.backward(**forward())
    assert_grads_match(all_params(a, b, c), expected)


def test_shared_parameter_in_two_groups_gets_sum():
    shared = nn.Linear(4, 4).to(D)
    head_a, head_b = nn.Linear(4, 1).to(D), nn.Linear(4, 1).to(D)
    x = torch.randn(6, 4, dtype=D)

    def forward():
        h = shared(x).tanh()
        return {"a": head_a(h).pow(2).mean(), "b": head_b(h).sin().mean()}

    groups = {
        "a": [*head_a.parameters(), *shared.parameters()],
        "b": [*head_b.parameters(), *shared.parameters()],
    }
    router = gradroute.Router(groups)
    expected = reference_grads(forward, groups)
    router.backward(**forward())
    assert_grads_match(all_params(shared, head_a, head_b), expected)
    # grads() reports each group's own gradient, not the sum
    out = router.grads(**forward())
    for name in ("a", "b"):
        ref = torch.autograd.grad(forward()[name], groups[name])
        for g, r in zip(out[name], ref):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_tied_weights_inside_one_group():
    emb = nn.Embedding(10, 6).to(D)
    body = mlp(6, 6)
    tokens = torch.randint(0, 10, (3, 5))

    def forward():
        h = body(emb(tokens))
        logits = h @ emb.weight.t()  # output head tied to the embedding
        loss = logits.logsumexp(-1).mean()
        return {"emb": loss, "body": (h.pow(2).mean() + loss)}

    groups = {"emb": list(emb.parameters()), "body": list(body.parameters())}
    router = gradroute.Router(groups)
    expected = reference_grads(forward, groups)
    router.backward(**forward())
    assert_grads_match(all_params(emb, body), expected)


def test_multitask_heads_merge_into_one_pass():
    trunk = mlp(4, 6)
    heads = {k: nn.Linear(6, 1).to(D) for k in ("a", "b", "c")}
    x = torch.randn(5, 4, dtype=D)

    def forward():
        h = trunk(x)
        return {k: head(h).pow(2).mean() for k, head in heads.items()}

    groups = {k: list(h.parameters()) for k, h in heads.items()}
    router = gradroute.Router(groups)
    plan = router.plan(**forward())
    assert len(plan.passes) == 1 and len(plan.calls) == 1
    assert not plan.calls[0].retain
    assert not any(plan.leaks.values())
    expected = reference_grads(forward, groups)
    router.backward(**forward())
    assert_grads_match([p for h in heads.values() for p in h.parameters()], expected)
    assert all(p.grad is None for p in trunk.parameters())


def test_disjoint_graphs_need_no_retain():
    actor, critic = mlp(3, 2), mlp(5, 1)
    s, a_data, target = torch.randn(6, 3, dtype=D), torch.randn(6, 2, dtype=D), torch.randn(6, 1, dtype=D)

    def forward():
        q = critic(torch.cat([s, a_data], 1))
        q_pi = critic(torch.cat([s, actor(s)], 1))
        return {"critic": (q - target).pow(2).mean(), "actor": -q_pi.mean()}

    groups = {"critic": list(critic.parameters()), "actor": list(actor.parameters())}
    router = gradroute.Router(groups)
    plan = router.plan(**forward())
    assert not any(c.retain for c in plan.calls)
    assert plan.leaks["actor"] == ("critic",)
    expected = reference_grads(forward, groups)
    router.backward(**forward())
    assert_grads_match(all_params(actor, critic), expected)


def test_list_of_losses_is_summed(chain):
    tenc, unet, _ = chain
    x, target = torch.randn(5, 4, dtype=D), torch.randn(5, 3, dtype=D)

    def forward():
        pred = unet(tenc(x))
        return {"tenc": [pred.pow(2).mean(), (pred - target).abs().mean()], "unet": [pred.mean(), pred.std()]}

    assert_routed_exact(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})


def test_dropout_same_rng():
    tenc = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Tanh()).to(D)
    unet = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 3)).to(D)
    x, mask = torch.randn(8, 4, dtype=D), (torch.rand(8, 3) > 0.5).to(D)

    def forward():
        torch.manual_seed(123)
        loss = unet(tenc(x)).pow(2)
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    assert_routed_exact(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})


def test_batchnorm():
    tenc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU()).to(D)
    unet = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(D)
    x, mask = torch.randn(10, 4, dtype=D), (torch.rand(10, 2) > 0.5).to(D)

    def forward():
        loss = unet(tenc(x)).pow(2)
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    assert_routed_exact(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})


@pytest.mark.parametrize("where", ["tenc", "unet", "both"])
def test_activation_checkpointing_non_reentrant(where):
    tenc, unet = mlp(4, 6), mlp(6, 3)
    x, target, mask = torch.randn(5, 4, dtype=D), torch.randn(5, 3, dtype=D), (torch.rand(5, 3) > 0.5).to(D)

    def run(m, h, on):
        return checkpoint(m, h, use_reentrant=False) if on else m(h)

    def forward():
        h = run(tenc, x, where in ("tenc", "both"))
        loss = (run(unet, h, where in ("unet", "both")) - target).pow(2)
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    assert_routed_exact(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})


class _SaveProbe(torch.autograd.Function):
    """y = x * x; saves a private copy of x and records a weakref to it."""

    refs: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        saved = x.detach().clone()
        _SaveProbe.refs.append(weakref.ref(saved))
        ctx.save_for_backward(saved)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        return 2 * saved * g


def _probe_chain():
    tenc, unet = mlp(4, 6), mlp(6, 3)
    x, target, mask = torch.randn(5, 4, dtype=D), torch.randn(5, 3, dtype=D), (torch.rand(5, 3) > 0.5).to(D)

    def forward():
        h = _SaveProbe.apply(tenc[0](x))  # only the tenc pass goes here
        h = tenc[2](tenc[1](h))
        u = _SaveProbe.apply(unet[0](h))  # shared by both passes
        loss = (unet[2](unet[1](u)) - target).pow(2)
        loss = _SaveProbe.apply(loss)  # right below the losses
        return {"tenc": loss.mean(), "unet": (loss * mask).mean()}

    return tenc, unet, forward


def test_custom_function_in_chain():
    tenc, unet, forward = _probe_chain()
    assert_routed_exact(forward, {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())})


def test_saved_tensors_released_while_losses_held():
    tenc, unet, forward = _probe_chain()
    router = gradroute.Router(tenc=tenc, unet=unet)
    _SaveProbe.refs.clear()
    losses = forward()
    assert len(_SaveProbe.refs) == 3 and all(r() is not None for r in _SaveProbe.refs)
    router.backward(**losses)
    gc.collect()
    alive = [k for k, r in enumerate(_SaveProbe.refs) if r() is not None]
    assert alive == [], f"saved tensors still alive after backward: {alive}"
    assert losses["tenc"].requires_grad  # the caller still holds the losses


def _probe_gan():
    """A generator and a discriminator; probed tensors saved on the real images' path (the discriminator's pass only)
    and below the fakes (the generator's pass only)."""
    gen, disc = mlp(3, 4), mlp(4, 1)
    z, real = torch.randn(6, 3, dtype=D), torch.randn(6, 4, dtype=D)

    def forward():
        fake = _SaveProbe.apply(gen(z))
        d_real = disc(_SaveProbe.apply(real + 0))  # the real images' activations: the discriminator's pass only
        d_fake = disc(fake)
        loss_d = nn.functional.softplus(d_fake).mean() + nn.functional.softplus(-d_real).mean()
        return {"gen": nn.functional.softplus(-d_fake).mean(), "disc": loss_d}

    return {"gen": list(gen.parameters()), "disc": list(disc.parameters())}, forward


def _probe_sd():
    tenc, unet, forward = _probe_chain()
    return {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}, forward


@pytest.mark.parametrize("keep_graph", [False, True])
@pytest.mark.parametrize("make", [_probe_sd, _probe_gan], ids=["sd", "gan"])
def test_default_keeps_nothing_alive_while_a_logging_list_holds_every_loss(make, keep_graph):
    # through the measured choice's trials and after: what a routed backward leaves must not outlive it while the
    # caller holds the losses; Autotune(keep_graph=True) may (one engine call per pass), and says so
    groups, forward = make()
    router = gradroute.Router(groups, autotune=gradroute.Autotune(trials=2, keep_graph=keep_graph))
    held, alive_steps = [], []
    for step in range(10):
        _SaveProbe.refs.clear()
        losses = forward()
        held.append(losses)
        router.backward(**losses)
        router.zero_grad()
        gc.collect()
        if any(r() is not None for r in _SaveProbe.refs):
            alive_steps.append(step)
    assert (alive_steps == []) != keep_graph, alive_steps


def test_whole_retained_passes_would_keep_tensors_alive():
    """The reason for cutting: the textbook pruned passes keep nodes only the first pass visits."""
    tenc, unet, forward = _probe_chain()
    _SaveProbe.refs.clear()
    losses = forward()
    losses["tenc"].backward(inputs=list(tenc.parameters()), retain_graph=True)
    losses["unet"].backward(inputs=list(unet.parameters()))
    gc.collect()
    assert _SaveProbe.refs[0]() is not None  # the tenc-only node was visited by the retaining pass only


def test_routed_backward_leaves_the_cycle_collector_alone():
    # the collector is process-wide: a routed backward must not switch it off for every other thread
    tenc, unet, forward = _probe_chain()
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    seen: list[bool] = []
    losses["unet"].grad_fn.register_prehook(lambda grad_outputs: seen.append(gc.isenabled()))
    assert gc.isenabled()
    router.backward(**losses)
    assert seen and all(seen)
    assert gc.isenabled()


def test_repeated_iterations_with_changing_graph():
    tenc, unet = mlp(4, 6), mlp(6, 3)
    router = gradroute.Router(tenc=tenc, unet=unet)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    for it in range(4):
        x = torch.randn(3 + it, 4, dtype=D)

        def forward(x=x, it=it):
            h = tenc(x)
            if it % 2:
                h = h.relu() + tenc(x).sin()  # a different graph every other iteration
            out = unet(h)
            return {"tenc": out.pow(2).mean(), "unet": out[:, :1].abs().mean() * (it + 1)}

        for p in all_params(tenc, unet):
            p.grad = None
        expected = reference_grads(forward, groups)
        router.backward(**forward())
        assert_grads_match(all_params(tenc, unet), expected)


def test_same_loss_routed_to_two_groups(chain):
    tenc, unet, forward = chain
    router = gradroute.Router(tenc=tenc, unet=unet)
    loss = forward()["tenc"]
    router.backward(tenc=loss, unet=loss)
    ref = torch.autograd.grad(forward()["tenc"], all_params(tenc, unet))
    for p, g in zip(all_params(tenc, unet), ref):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_loss_is_a_leaf_parameter():
    w = nn.Parameter(torch.tensor(2.0, dtype=D))
    router = gradroute.Router(w=[w])
    router.backward(w=w)
    torch.testing.assert_close(w.grad, torch.tensor(1.0, dtype=D))


def test_frozen_module_parameters_are_left_out():
    m = mlp(3, 3)
    m[0].weight.requires_grad_(False)
    router = gradroute.Router(m=m)
    assert len(router.groups["m"].params) == 3
    router.backward(m=m(torch.randn(2, 3, dtype=D)).sum())
    assert m[0].weight.grad is None and m[2].weight.grad is not None


def test_allow_unreached():
    a, b = mlp(3, 3), mlp(3, 3)
    x = torch.randn(2, 3, dtype=D)
    router = gradroute.Router(a=a, b=b, allow_unreached=["b"])
    router.backward(a=a(x).sum(), b=a(x).sum())
    assert all(p.grad is None for p in b.parameters())
    assert all(p.grad is not None for p in a.parameters())


# ---------------------------------------------------------------------- bad input


def _router_and_losses():
    tenc, unet = mlp(4, 6), mlp(6, 3)
    x = torch.randn(5, 4, dtype=D)
    out = unet(tenc(x))
    return gradroute.Router(tenc=tenc, unet=unet), out, tenc, unet


def _untouched(*modules: nn.Module) -> bool:
    return all(p.grad is None for m in modules for p in m.parameters())


def test_unknown_group_fails():
    router, out, tenc, unet = _router_and_losses()
    with pytest.raises(ValueError, match=r"unknown group `vae`; groups are: tenc, unet"):
        router.backward(tenc=out.mean(), vae=out.sum())
    assert _untouched(tenc, unet)


def test_group_without_parameters_fails():
    with pytest.raises(ValueError, match=r"group `empty` \(Identity\) has no parameters"):
        gradroute.Router(empty=nn.Identity())
    with pytest.raises(ValueError, match=r"group `empty` has no parameters \(got an empty list\)"):
        gradroute.Router(empty=[])


def test_group_with_frozen_parameters_fails():
    m = mlp(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"group `m` \(Sequential\) has no parameters that require grad"):
        gradroute.Router(m=m)
    with pytest.raises(ValueError, match=r"group `w`: parameter 0 \(shape \(2, 2\)\) does not require grad"):
        gradroute.Router(w=[torch.zeros(2, 2)])


def test_group_non_leaf_fails():
    w = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"group `w`: tensor 0 \(shape \(2,\)\) is not a leaf"):
        gradroute.Router(w=[w * 2])


@pytest.mark.parametrize("spec", [3, "tenc", torch.zeros(2, requires_grad=True)])
def test_group_wrong_type_fails(spec):
    with pytest.raises(TypeError, match=r"group `g`"):
        gradroute.Router(g=spec)


def test_group_name_given_twice_fails():
    m = mlp(2, 2)
    with pytest.raises(ValueError, match=r"group `m` is given twice"):
        gradroute.Router({"m": m}, m=m)


def test_no_groups_fails():
    with pytest.raises(ValueError, match="at least one group"):
        gradroute.Router()


def test_loss_name_given_twice_fails():
    router, out, tenc, unet = _router_and_losses()
    with pytest.raises(ValueError, match=r"loss for group `tenc` is given twice"):
        router.backward({"tenc": out.mean()}, tenc=out.sum())
    assert _untouched(tenc, unet)


def test_no_losses_fails():
    router, *_ = _router_and_losses()
    with pytest.raises(ValueError, match=r"`backward` needs at least one loss"):
        router.backward()


def test_non_scalar_loss_fails():
    router, out, tenc, unet = _router_and_losses()
    with pytest.raises(ValueError, match=r"loss for group `unet` must be a scalar, got shape \(5, 3\)"):
        router.backward(tenc=out.mean(), unet=out)
    assert _untouched(tenc, unet)


def test_loss_without_grad_fails():
    router, out, tenc, unet = _router_and_losses()
    with pytest.raises(ValueError, match=r"loss for group `tenc` does not require grad"):
        router.backward(tenc=out.detach().mean(), unet=out.mean())
    assert _untouched(tenc, unet)


@pytest.mark.parametrize("value", [1.0, None, {"x": 1}])
def test_loss_wrong_type_fails(value):
    router, out, tenc, unet = _router_and_losses()
    with pytest.raises(TypeError, match=r"loss for group `tenc` must be a scalar Tensor or a list of them"):
        router.backward(tenc=value, unet=out.mean())
    assert _untouched(tenc, unet)


def test_loss_list_with_non_tensor_fails():
    router, out, tenc, unet = _router_and_losses()
    with pytest.raises(TypeError, match=r"loss for group `tenc` \(item 1\) must be a Tensor, got float"):
        router.backward(tenc=[out.mean(), 2.0])
    with pytest.raises(ValueError, match=r"loss for group `tenc` is an empty list"):
        router.backward(tenc=[])
    assert _untouched(tenc, unet)


def test_losses_not_a_mapping_fails():
    router, out, *_ = _router_and_losses()
    with pytest.raises(TypeError, match=r"`losses` must be a mapping of group name -> loss, got Tensor"):
        router.backward(out.mean())  # type: ignore[arg-type]


def test_loss_reaching_none_of_its_group_fails():
    router, out, tenc, unet = _router_and_losses()
    h = tenc(torch.randn(2, 4, dtype=D))
    with pytest.raises(ValueError, match=r"loss for group `unet` reaches none of that group's 4 parameters"):
        router.backward(tenc=out.mean(), unet=h.mean())
    assert _untouched(tenc, unet)


@pytest.mark.parametrize("earlier", [False, True], ids=["grad_none_undone", "grad_there_probed"])
def test_freed_graph_fails_plainly(earlier):
    router, out, tenc, unet = _router_and_losses()
    loss = out.pow(2).mean()
    loss.backward()
    before = _grads_before(earlier, tenc, unet)
    with pytest.raises(gradroute.GraphFreedError, match=r"already freed by an earlier backward"):
        router.backward(tenc=loss, unet=loss)
    assert_grads_match(all_params(tenc, unet), {}, base=before)


def test_backward_twice_on_same_losses_fails_plainly(chain):
    tenc, unet, forward = chain
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    router.backward(**losses)
    grads = [p.grad.clone() for p in all_params(tenc, unet)]
    with pytest.raises(gradroute.GraphFreedError, match=r"run a new forward for every backward"):
        router.backward(**losses)
    for p, g in zip(all_params(tenc, unet), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_allow_unreached_unknown_name_fails():
    with pytest.raises(ValueError, match=r"`allow_unreached` names unknown group `vae`"):
        gradroute.Router(a=mlp(2, 2), allow_unreached=["vae"])


def test_freed_check_does_not_unpack_checkpointed_tensors():
    """Probing for a freed graph must not run saved-tensor hooks (a checkpoint would recompute)."""
    tenc, unet = mlp(4, 6), mlp(6, 3)
    calls = []

    def segment(h):
        calls.append(1)
        return unet(h)

    x = torch.randn(5, 4, dtype=D)
    out = checkpoint(segment, tenc(x), use_reentrant=False)
    router = gradroute.Router(tenc=tenc, unet=unet)
    router.plan(tenc=out.mean(), unet=out.pow(2).mean())
    assert len(calls) == 1  # the forward only
    router.backward(tenc=out.mean(), unet=out.pow(2).mean())
    assert len(calls) == 3  # torch's checkpoint recomputes once per engine call that enters the segment


def test_groups_not_a_mapping_fails():
    with pytest.raises(TypeError, match=r"`groups` must be a mapping of name -> group, got list"):
        gradroute.Router([mlp(2, 2)])  # type: ignore[arg-type]


def _grads_before(earlier: bool, *modules: nn.Module) -> dict[int, torch.Tensor | None]:
    """Set every ``.grad`` to a gradient of an earlier micro-batch (``earlier``) or to None; returns copies by
    ``id``, as ``assert_grads_match``'s ``base``."""
    for k, p in enumerate(p for m in modules for p in m.parameters()):
        p.grad = torch.full_like(p, 0.5 + k) if earlier else None
    return {id(p): None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()}


# the engine reports a freed node in the call that runs it, naming that call's groups; the probe names the
# losses whose graphs reach it (NOTE [Undoing a failed routed backward])
_FREED_IN_PART = r"(a loss routed to `tenc`, `unet`|loss for group `tenc`): .* already freed"


@pytest.mark.parametrize("earlier", [False, True], ids=["grad_none_undone", "grad_there_probed"])
def test_graph_freed_in_part_fails_with_every_gradient_as_before(earlier):
    """Another backward freed the nodes the losses share below `tenc`."""
    router, _, tenc, unet = _router_and_losses()
    h = tenc(torch.randn(5, 4, dtype=D))
    out = unet(h)
    h.exp().sum().backward()
    before = _grads_before(earlier, tenc, unet)
    with pytest.raises(gradroute.GraphFreedError, match=_FREED_IN_PART):
        router.backward(tenc=out.mean(), unet=out.pow(2).mean())
    assert_grads_match(all_params(tenc, unet), {}, base=before)


@pytest.mark.parametrize("earlier", [False, True], ids=["grad_none_undone", "grad_there_probed"])
def test_graph_freed_only_where_the_first_saved_tensor_is_absent_fails_with_every_gradient_as_before(earlier):
    """The freed nodes' first saved tensor is an optional one never defined (a layer norm without weight or
    bias): the probe looks past it."""
    router, _, tenc, unet = _router_and_losses()
    h = tenc(torch.randn(5, 4, dtype=D))
    normed = nn.functional.layer_norm(h, (h.shape[1],))
    torch.autograd.grad(normed.sum(), h)  # frees the layer norm's node only
    out = unet(normed)
    before = _grads_before(earlier, tenc, unet)
    with pytest.raises(gradroute.GraphFreedError, match=_FREED_IN_PART):
        router.backward(tenc=out.mean(), unet=out.pow(2).mean())
    assert_grads_match(all_params(tenc, unet), {}, base=before)


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_graph_freed_in_part_with_a_parameter_hook_fails_before_the_hook_runs(hook):
    """A parameter's hook runs when its gradient is made or written, which emptying ``.grad`` cannot take back:
    the graph is probed before the first engine call."""
    router, _, tenc, unet = _router_and_losses()
    h = tenc(torch.randn(5, 4, dtype=D))
    out = unet(h)
    h.exp().sum().backward()
    _grads_before(False, tenc, unet)
    ran: list[str] = []
    getattr(next(unet.parameters()), hook)(lambda _: ran.append(hook))
    with pytest.raises(gradroute.GraphFreedError, match=r"a loss routed to `tenc`, `unet`: .* already freed"):
        router.backward(tenc=out.mean(), unet=out.pow(2).mean())
    assert ran == [] and _untouched(tenc, unet)


@pytest.mark.parametrize("earlier", [False, True], ids=["grad_none", "grad_there"])
def test_routed_backward_failing_in_the_engine_leaves_empty_gradients_empty(earlier):
    """A tensor hook raising inside the text encoder's pass, after the unet's pass wrote its gradients: those
    are emptied again when every ``.grad`` was None before; added ones are not taken back (README)."""
    router, _, tenc, unet = _router_and_losses()
    inner = tenc[0](torch.randn(5, 4, dtype=D))
    inner.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("a hook failed")))
    out = unet(tenc[1:](inner))
    before = _grads_before(earlier, tenc, unet)
    with pytest.raises(RuntimeError, match="a hook failed"):
        router.backward(tenc=out.mean(), unet=out.pow(2).mean())
    if not earlier:
        assert_grads_match(all_params(tenc, unet), {}, base=before)
    else:  # the unet's pass ran first and added its gradients
        assert any(not torch.equal(p.grad, before[id(p)]) for p in unet.parameters())


def test_complex_loss_fails():
    router, out, tenc, unet = _router_and_losses()
    loss = torch.view_as_complex(out[:, :2].contiguous()).sum()
    with pytest.raises(TypeError, match=r"loss for group `unet` must be a real floating-point scalar, got dtype"):
        router.backward(tenc=out.mean(), unet=loss)
    assert _untouched(tenc, unet)


@pytest.mark.parametrize("value", [5, None, 2.5, [1], b"tenc"])
def test_allow_unreached_of_wrong_type_fails(value):
    with pytest.raises(TypeError, match=r"`allow_unreached` must (be True, False or an iterable|hold group names)"):
        gradroute.Router(tenc=mlp(2, 2), allow_unreached=value)


@pytest.mark.parametrize(
    "bad", [{"scaler": 3}, {"accumulate": 0}, {"allow_unreached": ["vae"]}, {"plan_options": 1}, {"other": 5}]
)
def test_construction_never_renames_the_callers_group(bad):
    group = gradroute.Group(mlp(2, 2), name="mine")
    with pytest.raises((TypeError, ValueError)):
        gradroute.Router(tenc=group, **bad)
    assert group.name == "mine"
    router = gradroute.Router(tenc=group)
    other = gradroute.Router(unet=group)  # one Group in two routers: each names its own copy
    assert group.name == "mine"
    assert router.groups["tenc"].name == "tenc" and other.groups["unet"].name == "unet"
