"""Stand-ins for what the real training scripts load: tiny models built from configs, and a synthetic dataset.

diffusers' scripts call ``CLIPTextModel.from_pretrained``, ``UNet2DConditionModel.from_pretrained`` and
``DDPMScheduler.from_pretrained`` and read images and captions; the recipes call :func:`models` and
:func:`dataset` instead, so they run on a CPU in seconds with nothing downloaded. The noise and the timesteps,
which the real scripts draw inside the loop, come with each example here, so that a test can replay them.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, TOKENS, HIDDEN, CHANNELS, SIZE = 64, 8, 16, 4, 8


def models(seed: int = 0) -> tuple[Any, Any, Any]:
    """``(text_encoder, unet, noise_scheduler)``: a 2-layer CLIP text encoder and a 2-level UNet (about 40k weights)."""
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=TOKENS,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=1,
            )
        )
        unet = UNet2DConditionModel(
            sample_size=SIZE,
            in_channels=CHANNELS,
            out_channels=CHANNELS,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=HIDDEN,
            attention_head_dim=2,
            norm_num_groups=4,
        )
    return text_encoder, unet, DDPMScheduler(num_train_timesteps=100)


def dataset(n: int = 8, seed: int = 0) -> torch.utils.data.Dataset:
    """Dicts with ``model_input`` (latents), ``input_ids``, ``noise``, ``timesteps`` and a 0/1 ``mask``."""
    gen = torch.Generator().manual_seed(seed)
    columns = {
        "model_input": torch.randn(n, CHANNELS, SIZE, SIZE, generator=gen),
        "input_ids": torch.randint(2, VOCAB, (n, TOKENS), generator=gen),
        "noise": torch.randn(n, CHANNELS, SIZE, SIZE, generator=gen),
        "timesteps": torch.randint(0, 100, (n,), generator=gen),
        "mask": (torch.rand(n, 1, SIZE, SIZE, generator=gen) > 0.5).float(),
    }
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]  # type: ignore[return-value]
