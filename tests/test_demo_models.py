"""The demo's embedded models and data: shapes, determinism, data matching its captions, the noise schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gradroute._demo_models import (
    COLOURS,
    IMAGE_SIZE,
    MAX_TOKENS,
    POSITIONS,
    SCHEDULE,
    SHAPES,
    VOCAB,
    NoiseSchedule,
    TinyTextEncoder,
    TinyUNet,
    forward_losses,
    make_batch,
    make_models,
    route_losses,
    tokenize,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- data


def test_batch_keys_shapes_and_dtypes():
    b = make_batch(5, gen())
    assert set(b) == {"tokens", "images", "masks", "captions", "timesteps", "noise", "noisy"}
    assert b["tokens"].shape == (5, MAX_TOKENS) and b["tokens"].dtype == torch.long
    assert b["images"].shape == (5, 3, IMAGE_SIZE, IMAGE_SIZE) and b["images"].dtype == torch.float32
    assert b["masks"].shape == (5, 1, IMAGE_SIZE, IMAGE_SIZE)
    assert b["noise"].shape == b["noisy"].shape == b["images"].shape
    assert b["timesteps"].shape == (5,) and b["timesteps"].dtype == torch.long
    assert len(b["captions"]) == 5
    assert b["images"].min() >= -1 and b["images"].max() <= 1
    assert set(b["masks"].unique().tolist()) <= {0.0, 1.0}
    assert int(b["timesteps"].min()) >= 0 and int(b["timesteps"].max()) < SCHEDULE.num_steps


@pytest.mark.parametrize("seed", [0, 3])
def test_batch_is_deterministic_for_the_generator(seed):
    a, b = make_batch(6, gen(seed)), make_batch(6, gen(seed))
    assert a["captions"] == b["captions"]
    for k in ("tokens", "images", "masks", "timesteps", "noise", "noisy"):
        assert torch.equal(a[k], b[k]), k
    c = make_batch(6, gen(seed + 100))
    assert not torch.equal(a["noise"], c["noise"])


def test_batch_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_batch(4, gen())
    assert torch.equal(torch.rand(3), expected)


def test_images_match_their_captions():
    b = make_batch(64, gen(1))
    for k, caption in enumerate(b["captions"]):
        words = caption.split()
        colour, shape, position = words[0], words[1], " ".join(words[2:])
        assert colour in COLOURS and shape in SHAPES and position in POSITIONS
        mask = b["masks"][k, 0].bool()
        assert 20 < int(mask.sum()) < 400, caption
        # every pixel inside the mask has the caption's colour
        rgb = torch.tensor(COLOURS[colour]) * 2 - 1
        inside = b["images"][k][:, mask]
        torch.testing.assert_close(inside, rgb[:, None].expand_as(inside), rtol=0, atol=1e-6)
        # the mask's centre of mass is near the caption's position
        ys, xs = mask.nonzero(as_tuple=True)
        cx, cy = POSITIONS[position]
        assert abs(float(xs.float().mean()) + 0.5 - cx) < 4.5, caption
        assert abs(float(ys.float().mean()) + 0.5 - cy) < 4.5, caption


def test_noisy_is_the_schedule_applied_to_images_and_noise():
    b = make_batch(4, gen(2))
    abar = SCHEDULE.alphas_cumprod[b["timesteps"]].view(-1, 1, 1, 1).double()
    expected = abar.sqrt() * b["images"].double() + (1 - abar).sqrt() * b["noise"].double()
    torch.testing.assert_close(b["noisy"].double(), expected, rtol=1e-6, atol=1e-6)


def test_tokenize_round_trip_and_padding():
    ids = tokenize(["red circle top left", "blue square center"])
    assert ids.shape == (2, MAX_TOKENS)
    assert [VOCAB[i] for i in ids[0].tolist()] == ["red", "circle", "top", "left"]
    assert [VOCAB[i] for i in ids[1].tolist()] == ["blue", "square", "center", "<pad>"]


def test_tokenize_unknown_word_fails():
    with pytest.raises(ValueError, match="'purple'"):
        tokenize(["purple circle center"])


def test_tokenize_too_long_caption_fails():
    with pytest.raises(ValueError, match="at most 4"):
        tokenize(["red circle top left corner"])


def test_make_batch_zero_batch_size_fails():
    with pytest.raises(ValueError, match="`batch_size`"):
        make_batch(0, gen())


# ---------------------------------------------------------------------------------------------- models


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


# ---------------------------------------------------------------------------------------------- schedule


def test_schedule_is_decreasing_in_unit_interval():
    a = NoiseSchedule(50).alphas_cumprod
    assert a.shape == (50,)
    assert bool((a[1:] < a[:-1]).all())
    assert 0 < float(a[-1]) < 0.01 and 0.99 < float(a[0]) <= 1


def test_predict_x0_inverts_add_noise():
    s = NoiseSchedule(100)
    x0 = torch.rand(4, 3, 8, 8) * 1.8 - 0.9
    noise = torch.randn(4, 3, 8, 8)
    t = torch.tensor([0, 10, 50, 90])
    torch.testing.assert_close(s.predict_x0(s.add_noise(x0, noise, t), noise, t), x0, rtol=0, atol=2e-4)


def test_sample_is_deterministic_and_uses_the_model():
    s = NoiseSchedule(100)
    calls = []

    def eps(x, t):
        calls.append(int(t[0]))
        return torch.zeros_like(x)

    a = s.sample(eps, (2, 3, 4, 4), gen(1), steps=5)
    b = s.sample(eps, (2, 3, 4, 4), gen(1), steps=5)
    assert torch.equal(a, b) and a.shape == (2, 3, 4, 4)
    assert calls[:5] == [99, 74, 50, 25, 0]
    assert a.min() >= -1 and a.max() <= 1 and math.isfinite(float(a.sum()))


@pytest.mark.parametrize("steps", [1, 0, 2.5])
def test_schedule_bad_num_steps_fails(steps):
    with pytest.raises(ValueError, match="`num_steps`"):
        NoiseSchedule(steps)
