"""The demo's tiny text encoder and UNet: shapes, determinism, the routed losses, checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradroute.cli.data import IMAGE_SIZE, MAX_TOKENS, make_batch
from gradroute.cli.models import TinyTextEncoder, TinyUNet, forward_losses, make_models, route_losses


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_models_shapes():
    tenc, unet = make_models(seed=0, width=8)
    b = make_batch(3, gen())
    h = tenc(b["tokens"])
    assert h.shape == (3, MAX_TOKENS, 16)
    assert unet(b["noisy"], b["timesteps"], h).shape == (3, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert isinstance(tenc, TinyTextEncoder) and isinstance(unet, TinyUNet)
    assert sum(isinstance(m, torch.nn.TransformerEncoderLayer) for m in tenc.modules()) == 2


def test_make_models_is_deterministic_and_leaves_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    a = make_models(seed=1, width=8)
    assert torch.equal(torch.rand(2), expected)
    b = make_models(seed=1, width=8)
    c = make_models(seed=2, width=8)
    for ma, mb, mc in zip(a, b, c):
        pa, pb, pc = list(ma.parameters()), list(mb.parameters()), list(mc.parameters())
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))
        assert not all(torch.equal(x, z) for x, z in zip(pa, pc))


@pytest.mark.parametrize("width", [0, 12, 4])
def test_make_models_bad_width_fails(width):
    with pytest.raises(ValueError, match="`width` must be a positive multiple of 8"):
        make_models(width=width)


def test_unet_heads_not_dividing_width_fails():
    with pytest.raises(ValueError, match="`heads` must divide `width`"):
        TinyUNet(width=8, heads=3)


def test_route_losses_are_the_unmasked_and_masked_mean_squared_error():
    b = make_batch(3, gen(4))
    pred = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64)
    lt, lu = route_losses(pred, b)
    err = (pred.float() - b["noise"]) ** 2
    torch.testing.assert_close(lt, F.mse_loss(pred.float(), b["noise"]), rtol=1e-6, atol=0)
    n = err.numel()
    torch.testing.assert_close(lu, (err * b["masks"]).sum() / n, rtol=1e-5, atol=0)


def _grads(tenc, unet, batch):
    lt, _lu = forward_losses(tenc, unet, batch)
    gt = torch.autograd.grad(lt, list(tenc.parameters()))
    _lt2, lu2 = forward_losses(tenc, unet, batch)
    gu = torch.autograd.grad(lu2, list(unet.parameters()))
    return gt + gu


def test_checkpointing_gives_the_same_gradients():
    tenc, unet = make_models(seed=0, width=8)
    b = make_batch(2, gen())
    plain = _grads(tenc, unet, b)
    tenc.gradient_checkpointing = unet.gradient_checkpointing = True
    ckpt = _grads(tenc, unet, b)
    for x, y in zip(plain, ckpt):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_both_losses_reach_both_models():
    # the demo is about routing: each loss must reach the other model's parameters too
    tenc, unet = make_models(seed=0, width=8)
    b = make_batch(2, gen())
    for k in range(2):
        loss = forward_losses(tenc, unet, b)[k]
        grads = torch.autograd.grad(loss, [*tenc.parameters(), *unet.parameters()], allow_unused=True)
        n_tenc = len(list(tenc.parameters()))
        assert any(g is not None and g.abs().sum() > 0 for g in grads[:n_tenc])
        assert any(g is not None and g.abs().sum() > 0 for g in grads[n_tenc:])
