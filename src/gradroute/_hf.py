"""Hugging Face model libraries: their activation checkpointing pointed at :func:`gradroute.checkpoint`.

NOTE [Why a helper for transformers]
1. diffusers' public switch takes the checkpoint function
   (``ModelMixin.enable_gradient_checkpointing(gradient_checkpointing_func=...)``): :func:`enable_checkpointing`
   calls it with :func:`gradroute.checkpoint`.
2. transformers' public switch (``activation_checkpointing_enable(activation_checkpointing_kwargs=...)`` and its
   deprecated alias ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``) always wraps
   ``torch.utils.checkpoint.checkpoint`` and forwards only keyword arguments, so it cannot take another function.
   The function is set by ``PreTrainedModel._set_gradient_checkpointing(enable, gradient_checkpointing_func,
   every_n_layers)``: private, but the one the public switch calls in every release from 4.35 on.
   :func:`enable_checkpointing` is the one place gradroute calls it, and the tests run it (checked with
   transformers 5.23 and 5.24).
3. Otherwise it does what the public switch does, minus ``enable_input_require_grads``: only reentrant
   checkpointing needs that, and ``gradroute.checkpoint`` is not reentrant.

NOTE [Cut points of diffusers' UNets]
diffusers' switch checkpoints the layers inside its UNet blocks (resnets, transformer blocks), while the
tensors its skip connections carry leave from un-checkpointed modules (downsamplers, the transformer models'
residual adds). Without cuts there, the router cannot interleave its passes through those segments and
recomputes them once per engine call, like torch's checkpoint (NOTE [Shared or per-call recomputation] in
_planner/per_call.py). So :func:`enable_checkpointing` also makes cut points of the layers of every
diffusers block (the members of its ``resnets``, ``attentions``, ``downsamplers`` and ``upsamplers``
lists) and of ``conv_in`` and ``time_embedding``:

1. A cut point only gives each consumer of the module's output a view of that output: the gradients are
   added in the same order as without it (NOTE [A view per consumer] in _checkpoint/_views.py, rules 2-3),
   so a plain backward is bitwise unchanged.
2. A module that already has the cut-point hook is not given a second one (calling twice changes nothing).
3. transformers' encoder and decoder layers need none: each layer's output is a segment's output already,
   and nothing else consumes the residual stream between them.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

#: the lists of layers of a diffusers block (``UNetMidBlock2DCrossAttn``, ``CrossAttnDownBlock2D``, ...)
_DIFFUSERS_LAYER_LISTS = ("resnets", "attentions", "downsamplers", "upsamplers")
#: a diffusers UNet's modules before its blocks whose outputs several blocks consume
_DIFFUSERS_STEMS = ("conv_in", "time_embedding")


def _unwrap(model: Any) -> Any:
    """The model inside DDP (``.module``, as after ``accelerator.prepare``) and peft (``get_base_model()``)."""
    for _ in range(4):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            break
    return model


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "(not installed)"


def enable_checkpointing(model: nn.Module, *, every_n_layers: int = 1) -> None:
    """Turn on a transformers or diffusers model's activation checkpointing, with :func:`gradroute.checkpoint`.

    The model's own switch decides which blocks are checkpointed (transformers: its decoder or encoder
    layers; diffusers: its blocks); each block's segment is then recomputed once per routed backward instead of
    once per engine call. For a diffusers model it also makes cut points (:func:`gradroute.cut_points`) of its
    blocks' layers (resnets, attentions, down- and upsamplers) and of ``conv_in`` and ``time_embedding``, so
    that the router interleaves its passes through the UNet's segments despite the skip connections; without a
    router the gradients are bitwise those of torch's checkpoint. A DDP wrapper (``accelerator.prepare``) or a
    peft model is looked through.

    Args:
        model: a ``transformers.PreTrainedModel`` or a ``diffusers.ModelMixin`` (possibly wrapped).
        every_n_layers: transformers only (5.16+): checkpoint every n-th layer.

    Raises:
        TypeError: not a model of either library, or a transformers model whose checkpointing uses the format
            before transformers 4.35.
        ValueError: a model that does not support checkpointing; ``every_n_layers`` < 1 or given for a model
            that does not take it.

    Examples:
        >>> import gradroute, transformers
        >>> config = transformers.CLIPTextConfig(vocab_size=99, hidden_size=8, intermediate_size=16,
        ...     num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8, bos_token_id=0,
        ...     eos_token_id=1, pad_token_id=1)
        >>> tenc = transformers.CLIPTextModel(config)
        >>> gradroute.enable_checkpointing(tenc)
        >>> sum(getattr(m, "gradient_checkpointing", False) is True for m in tenc.modules())  # encoder + 2 layers
        3
    """
    from ._checkpoint import checkpoint

    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(f"`every_n_layers` must be an int >= 1, got {every_n_layers!r}")
    inner = _unwrap(model)
    diffusers_switch = getattr(inner, "enable_gradient_checkpointing", None)
    set_func = getattr(inner, "_set_gradient_checkpointing", None)
    if callable(set_func) and hasattr(inner, "supports_gradient_checkpointing") and hasattr(inner, "config"):
        if not inner.supports_gradient_checkpointing:
            raise ValueError(f"`model` ({type(inner).__name__}) does not support activation checkpointing")
        params = inspect.signature(set_func).parameters
        if "gradient_checkpointing_func" not in params:
            raise TypeError(
                f"`model` ({type(inner).__name__}) uses transformers' checkpointing format from before 4.35 "
                "(`_set_gradient_checkpointing(module, value)`), which takes no checkpoint function"
            )
        kwargs: dict[str, Any] = {"enable": True, "gradient_checkpointing_func": checkpoint}
        if "every_n_layers" in params:
            kwargs["every_n_layers"] = every_n_layers
        elif every_n_layers != 1:
            raise ValueError(
                f"`every_n_layers` needs transformers 5.16 or later, got {every_n_layers!r} with transformers "
                f"{_transformers_version()} (whose models checkpoint every layer)"
            )
        set_func(**kwargs)
        return
    if callable(diffusers_switch) and "gradient_checkpointing_func" in inspect.signature(diffusers_switch).parameters:
        if every_n_layers != 1:
            raise ValueError(f"`every_n_layers` is for transformers models, not {type(inner).__name__}")
        diffusers_switch(gradient_checkpointing_func=checkpoint)
        _set_cut_points(inner)
        return
    raise TypeError(
        f"`model` must be a transformers PreTrainedModel or a diffusers ModelMixin, got {type(model).__name__}; "
        "for other modules use gradroute.checkpoint or gradroute.checkpoint_modules"
    )


def diffusers_cut_points(model: nn.Module) -> list[nn.Module]:
    """The modules of a diffusers model whose outputs the router needs to cut at (NOTE [Cut points of
    diffusers' UNets]): every layer of its blocks, and ``conv_in`` and ``time_embedding`` where it has them."""
    found: dict[int, nn.Module] = {}
    for name in _DIFFUSERS_STEMS:
        stem = getattr(model, name, None)
        if isinstance(stem, nn.Module):
            found[id(stem)] = stem
    for block in model.modules():
        for name in _DIFFUSERS_LAYER_LISTS:
            layers = getattr(block, name, None)
            if isinstance(layers, nn.ModuleList):
                found.update((id(m), m) for m in layers)
    return list(found.values())


def _set_cut_points(model: nn.Module) -> None:
    from ._checkpoint import cut_points
    from ._checkpoint._views import view_outputs

    todo = [m for m in diffusers_cut_points(model) if view_outputs not in m._forward_hooks.values()]
    cut_points(*todo)
