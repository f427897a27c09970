"""``gradroute.enable_checkpointing``: transformers' and diffusers' own checkpointing switched to gradroute's.

transformers has no public way to pass a checkpoint function, so the helper uses the private
``_set_gradient_checkpointing``; run this file against the two newest transformers releases when either changes
(docs/integrations.md says how).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

import gradroute
from tests._reference import assert_grads_match, reference_grads
from tests.integration._recipes import micro_batches


def switched(model: torch.nn.Module) -> list[Any]:
    """``(enabled, function)`` of every module that carries a ``gradient_checkpointing`` switch."""
    return [
        (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
        for m in model.modules()
        if hasattr(m, "gradient_checkpointing")
    ]


def test_enable_checkpointing_routes_exactly_through_both_libraries() -> None:
    import text_to_image
    import tiny

    tenc, unet, noise_scheduler = tiny.models()
    gradroute.enable_checkpointing(tenc)
    gradroute.enable_checkpointing(unet)
    for model in (tenc, unet):
        states = switched(model)
        assert states and all(on is True and fn is gradroute.checkpoint for on, fn in states)
    batch = next(micro_batches(2))
    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}

    def forward() -> dict[str, torch.Tensor]:
        loss_tenc, loss_unet = text_to_image.compute_losses(tenc, unet, noise_scheduler, batch)
        return {"tenc": loss_tenc, "unet": loss_unet}

    expected = reference_grads(forward, groups)
    router = gradroute.Router(groups)
    losses = forward()
    assert router.plan(losses).calls  # the plan is made through the checkpointed segments
    router.backward(losses)
    assert_grads_match([*groups["tenc"], *groups["unet"]], expected, rtol=1e-5, atol=1e-7)


def test_enable_checkpointing_every_n_layers_and_peft() -> None:
    import tiny
    from peft import LoraConfig, get_peft_model

    tenc, _, _ = tiny.models()
    lora = get_peft_model(tenc, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    installed = importlib.metadata.version("transformers")
    if tuple(int(v) for v in installed.split(".")[:2]) < (5, 16):  # its models take no `every_n_layers`
        with pytest.raises(ValueError, match=rf"needs transformers 5.16 or later, got 2 with transformers {installed}"):
            gradroute.enable_checkpointing(lora, every_n_layers=2)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in tenc.modules())  # nothing switched on
        return
    gradroute.enable_checkpointing(lora, every_n_layers=2)
    layers = [m for name, m in tenc.named_modules() if name.rsplit(".", 1)[-1].isdigit()]  # the encoder's layers
    assert len(layers) == 2
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert all(layer._gradient_checkpointing_func is gradroute.checkpoint for layer in layers)


def test_enable_checkpointing_not_a_model_fails() -> None:
    with pytest.raises(TypeError, match="`model` must be a transformers PreTrainedModel or a diffusers ModelMixin"):
        gradroute.enable_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("every", [0, 1.5, True])
def test_enable_checkpointing_bad_every_n_layers_fails(every: Any) -> None:
    import tiny

    with pytest.raises(ValueError, match="`every_n_layers` must be an int >= 1"):
        gradroute.enable_checkpointing(tiny.models()[0], every_n_layers=every)


def test_enable_checkpointing_every_n_layers_on_diffusers_fails() -> None:
    import tiny

    with pytest.raises(ValueError, match="`every_n_layers` is for transformers models, not UNet2DConditionModel"):
        gradroute.enable_checkpointing(tiny.models()[1], every_n_layers=2)


def test_enable_checkpointing_unsupported_model_fails() -> None:
    import tiny

    tenc = tiny.models()[0]
    tenc.supports_gradient_checkpointing = False
    with pytest.raises(ValueError, match=r"`model` \(CLIPTextModel\) does not support activation checkpointing"):
        gradroute.enable_checkpointing(tenc)
