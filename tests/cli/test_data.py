"""The demo's data: shapes, determinism, pictures matching their captions, tokens."""

from __future__ import annotations

import pytest
import torch

from gradroute.cli.data import COLOURS, IMAGE_SIZE, MAX_TOKENS, POSITIONS, SHAPES, VOCAB, make_batch, tokenize
from gradroute.cli.noise import SCHEDULE


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
