"""Per-consumer views and cut points: the router cuts and interleaves its passes through shared segments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradroute

from .._reference import assert_grads_match, reference_grads
from ._helpers import D, Net, backward_sampling_live, counting, sd_tiny


class _Reuses(nn.Module):
    """Hands one tensor to several ops, to one call twice (``query is key`` fast paths), and writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True).double()
        self.lin = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a, _ = self.attn(h, h, h, need_weights=False)  # self-attention: the fused projection path
        y = h * 2
        y.add_(a)
        return torch.tanh(y) + h


@pytest.mark.parametrize("chunk", [None, 3])
def test_segment_ops_see_the_same_tensors_and_route_exactly(chunk: int | None) -> None:
    # a segment that hands one tensor to several ops and to one call three times (nn.MultiheadAttention takes
    # its fused path only when ``query is key is value``: the forward and the recomputation must agree) and
    # writes in place; with tiny chunks the planner tries to cut it everywhere
    options = gradroute.PlanOptions() if chunk is None else gradroute.PlanOptions(chunk=chunk)
    tenc, unet = nn.Linear(D, D).double(), _Reuses()
    x = torch.randn(2, 3, D, dtype=torch.float64)

    def forward() -> dict[str, torch.Tensor]:
        out = gradroute.checkpoint(unet, tenc(x)) ** 2
        return {"tenc": out.mean(), "unet": out[..., :2].sum()}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    gradroute.Router(tenc=tenc, unet=unet, plan_options=options).backward(**forward())
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_routed_calls_interleave_per_segment_and_free_each_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradroute.cli.data import make_batch
    from gradroute.cli.models import make_models, route_losses

    f64 = torch.float64
    tenc, unet = (m.to(f64) for m in make_models(seed=0, width=8))
    for m in (tenc, unet):
        m.gradient_checkpointing = True
        m.checkpoint_fn = gradroute.checkpoint
    batch = {
        k: v.to(f64) if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in make_batch(3, torch.Generator().manual_seed(0)).items()
    }

    def forward() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        loss_tenc, loss_unet = route_losses(unet(batch["noisy"], batch["timesteps"], tenc(batch["tokens"])), batch)
        return {"tenc": loss_tenc, "unet": loss_unet}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    plan = router.plan(**losses)
    unet_calls = [c for c in plan.calls if c.groups == ("unet",)]
    assert plan.kept_nodes == 0 and len(unet_calls) >= 4  # one per shared segment, not one for the whole UNet

    live = backward_sampling_live(monkeypatch, router, losses)
    # each segment's shared recomputation is freed by the UNet call that follows the text-encoder call that
    # made it, before the segment after the next is recomputed (all 6 would stay alive without interleaving)
    assert max(live) <= 2, live
    assert live[-1] == 0
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_routed_calls_interleave_inside_one_segment_and_free_it_chunk_by_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the whole unet is one segment: the passes through it are cut every few nodes (the second consumer of
    # each residual stream gets a view of its own), so the recomputation is freed as the unet pass goes down
    tenc, unet = Net(D, 1).double(), Net(D, 12).double()

    def forward() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        x, target = torch.randn(5, D, generator=g, dtype=torch.float64), torch.randn(5, D, generator=g)
        torch.manual_seed(3)
        loss = (gradroute.checkpoint(unet, tenc(x, None), None) - target.double()) ** 2
        return {"tenc": loss.mean(), "unet": loss[:, :3].mean()}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    plan = router.plan(**losses)
    assert plan.kept_nodes == 0 and sum(c.groups == ("unet",) for c in plan.calls) >= 3
    assert any("chunk(s) of gradroute.checkpoint segments" in n for n in plan.notes), plan.notes  # printed

    for b in unet.blocks:
        b.storages.clear()  # (the reference's backwards recomputed too)
    made = [b.storages for b in unet.blocks]
    live = backward_sampling_live(monkeypatch, router, losses, lambda: sum(not s.expired() for st in made for s in st))
    assert sum(map(len, made)) == 2 * 12  # one recomputation
    after_first = [n for n in live if n]
    # all 24 made at once, then freed in several steps (without chunks: all until one unet call frees them;
    # dropout's outputs are dropped as soon as a call has used them and made again for the next: remade tensors)
    assert 12 <= after_first[0] <= 24 and len(set(after_first)) >= 3 and live[-1] == 0, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_checkpoint_modules_lets_the_router_interleave_diffusers_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    tenc, unet, forward = sd_tiny(gradroute.checkpoint)
    ls = forward()
    collapsed = len(gradroute.Router(tenc=tenc, unet=unet).plan(**ls).calls)
    del ls
    unet.disable_gradient_checkpointing()
    gradroute.checkpoint_modules(*unet.down_blocks, unet.mid_block, *unet.up_blocks)
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    plan = router.plan(**losses)
    # diffusers' skip connections leave from un-checkpointed ops, which merges the per-layer segments;
    # whole blocks as segments separate again
    assert plan.kept_nodes == 0 and len(plan.calls) > collapsed + 3
    live = backward_sampling_live(monkeypatch, router, losses)
    assert max(live) <= 2 and live[-1] == 0, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)


def test_cut_points_let_diffusers_per_layer_segments_share_one_recomputation(monkeypatch: pytest.MonkeyPatch) -> None:
    counts: dict[str, list[int]] = {"tenc": [], "unet": []}
    tenc, unet, forward = sd_tiny(counting(gradroute.checkpoint, counts))
    from gradroute.cli.workloads.sd15 import unet_cut_points

    handles = gradroute.cut_points(*unet_cut_points(unet))
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    expected = reference_grads(forward, groups)
    counts["tenc"].clear()
    counts["unet"].clear()
    router = gradroute.Router(tenc=tenc, unet=unet)
    losses = forward()
    notes = router.plan(**losses).notes
    assert not any("recomputed once per call" in n for n in notes), notes  # interleaved, not torch's plan
    live = backward_sampling_live(monkeypatch, router, losses)
    assert counts["unet"] == [1] * len(counts["unet"]) and counts["tenc"] == [1, 1], counts  # once each
    assert max(live) <= 2 and live[-1] == 0, live
    assert_grads_match(groups["tenc"] + groups["unet"], expected, rtol=1e-9, atol=1e-12)

    for h in handles:
        h.remove()
    notes = gradroute.Router(tenc=tenc, unet=unet).plan(**forward()).notes
    assert any("recomputed once per call" in n for n in notes), notes  # without them: torch's plan


def test_every_segment_tensor_in_an_ops_arguments_gets_a_view_of_its_own():
    """In a tuple, a list (``torch.cat``), keyword arguments and a named tuple: each occurrence its own node."""
    from collections import namedtuple

    from gradroute._checkpoint._views import _own_views, consumer_views

    made = torch.randn(2, 3, requires_grad=True) * 2  # not a leaf (a leaf stays itself)
    x = consumer_views(made)
    pair = namedtuple("pair", "a b")
    args = (x, [x, 2.0], {"other": x, "n": 3}, pair(x, None), torch.ones(1), "s")
    out = _own_views(args)
    found = [out[0], *out[1][:1], out[2]["other"], out[3].a]
    assert all(type(t) is torch.Tensor for t in found)  # plain tensors: the ops return plain ones
    assert len({t.grad_fn for t in found}) == 4  # a view each
    assert all(t.grad_fn.next_functions[0][0] is made.grad_fn for t in found)  # of the plain tensor, not an alias
    assert all(torch.equal(t, x) for t in found)
    assert out[1][1] == 2.0 and out[2]["n"] == 3 and out[3].b is None and out[4] is args[4] and out[5] == "s"
    assert type(out[3]) is pair
