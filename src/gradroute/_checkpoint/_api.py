"""The public functions: ``checkpoint``, ``checkpoint_modules`` and ``cut_points`` (user guide: docs/checkpointing.md).

How the planner uses the segments: NOTE [Interleaving shared segments] (``_planner/chunks.py``) and NOTE [Shared or
per-call recomputation] (``_planner/per_call.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from .._compat import (
    device_module,
    get_autocast_kwargs,
    get_device_states,
    infer_device_type,
    next_sequence_nr,
    noop_context_fn,
    set_device_states,
    tree_map,
)
from ._advice import cover
from ._frame import Frame, SaveInputs
from ._hooks import ForwardHooks
from ._registry import this_thread
from ._views import compiled, consumer_views, plain, view_outputs

_DETERMINISM = ("default", "none")


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them once per routed backward.

    A drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)``, with the
    same keyword arguments. Outside :meth:`gradroute.Router.backward` / :meth:`~gradroute.Router.grads` it
    behaves the same (one recomputation per backward call), with bitwise the same gradients. Inside one,
    all engine calls of the router call share one recomputation of the segment; each recomputed tensor is
    freed with the autograd node that saved it, at the latest when the router call returns; the router
    interleaves its calls chunk by chunk so that a recomputation is freed as the passes go down the segment
    (docs/checkpointing.md). The tensors it
    takes and returns hand every op that consumes them a view of their own (for the planner's cuts; the
    gradients are added in the same order as without them: docs/checkpointing.md, "Exactness").

    With ``torch.compile``: traced inside a compiled model, it is ``torch.utils.checkpoint.checkpoint``
    (which the compiler knows; each engine call then recomputes, as with torch's). A compiled module or
    function as ``fn`` (or one inside it) works: it gets plain tensors, and is recomputed once per routed
    backward but without remade tensors. Routed calls retain graphs, so compiled backwards need
    ``torch._functorch.config.donated_buffer = False`` (see examples/README.md).

    Args:
        fn: the segment to checkpoint.
        *args: its positional arguments; tensors among them are kept for the recomputation.
        use_reentrant: ``None`` or ``False`` (accepted for compatibility with callers that pass it).
        preserve_rng_state: replay the CPU and device RNG state in the recomputation (dropout).
        context_fn: returns two context managers, entered around the forward and around the recomputation.
        determinism_check: ``"default"`` compares shape, dtype and device of every recomputed saved tensor
            with the original; ``"none"`` skips that.
        debug: not supported (``True`` raises); use ``torch.utils.checkpoint.checkpoint(debug=True)``.
        early_stop: stop the recomputation once every saved tensor has been recomputed.
        **kwargs: keyword arguments of ``fn`` (kept alive until the graph is freed, not saved).

    Returns:
        What ``fn`` returns.

    Raises:
        ValueError: ``use_reentrant=True``, ``debug=True`` or an unknown ``determinism_check``.
        RuntimeError: ``fn`` initialised the device, so its RNG state could not be saved before it ran.

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> router = gradroute.Router(tenc=tenc, unet=unet)
        >>> x, target, mask = torch.randn(8, 4), torch.randn(8, 4), torch.rand(8, 4) > 0.5
        >>> pred = gradroute.checkpoint(unet, tenc(x))
        >>> loss = torch.nn.functional.mse_loss(pred, target, reduction="none")
        >>> router.backward(tenc=loss.mean(), unet=(loss * mask).mean())  # unet recomputed once, not twice
        >>> unet[0].weight.grad.shape
        torch.Size([4, 4])
    """
    _check_options(use_reentrant, debug, determinism_check)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():  # traced by torch.compile: torch's checkpoint, which it knows how to trace
        options: dict[str, Any] = {} if context_fn is noop_context_fn else {"context_fn": context_fn}
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **options, **kwargs
        )
    device_type = infer_device_type(*args)
    had_device = _device_initialized(device_type)
    replay, forward_context = _replayer(fn, args, kwargs, device_type, preserve_rng_state, context_fn)
    frame = Frame(replay, early_stop, determinism_check == "default", this_thread())
    out = _run_forward(frame, fn, args, kwargs, forward_context)
    if preserve_rng_state and not had_device and _device_initialized(device_type):
        raise RuntimeError(
            "gradroute.checkpoint: the device was initialized inside the checkpointed function, so its RNG "
            "state could not be saved; initialize it (e.g. torch.cuda.init()) before the forward"
        )
    return out


def _check_options(use_reentrant: bool | None, debug: bool, determinism_check: str) -> None:
    if use_reentrant:
        raise ValueError(
            "gradroute.checkpoint is the non-reentrant kind: `use_reentrant` must be False or None, got "
            f"{use_reentrant!r}"
        )
    if debug:
        raise ValueError(
            "`debug=True` is not supported by gradroute.checkpoint; debug with "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False, debug=True)"
        )
    if determinism_check not in _DETERMINISM:
        raise ValueError(f"`determinism_check` must be one of {list(_DETERMINISM)}, got {determinism_check!r}")


def _device_initialized(device_type: str) -> bool:
    return bool(getattr(device_module(device_type), "_initialized", False))


def _replayer(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
) -> tuple[Callable[..., None], Any]:
    """``fn`` on new inputs with the RNG state (if preserved) and the autocast state of now, under
    ``context_fn``'s recomputation context; and its forward context (made after the states were taken)."""
    device_autocast, cpu_autocast = get_autocast_kwargs(device_type=device_type)
    cpu_state = torch.get_rng_state() if preserve_rng_state else None
    devices: list[int] = []
    device_states: list[torch.Tensor] = []
    had_device = _device_initialized(device_type)
    if preserve_rng_state and had_device:
        devices, device_states = get_device_states(*args)
    forward_context, recompute_context = context_fn()

    def replay(*inputs: Any) -> None:
        with torch.random.fork_rng(devices=devices, enabled=preserve_rng_state, device_type=device_type):
            if cpu_state is not None:
                torch.set_rng_state(cpu_state)
                if had_device:
                    set_device_states(devices, device_states, device_type=device_type)
            device_ac = (
                torch.amp.autocast(device_type=device_type, **device_autocast)
                if device_autocast is not None
                else contextlib.nullcontext()
            )
            with device_ac, torch.amp.autocast("cpu", **cpu_autocast), recompute_context:
                fn(*inputs, **kwargs)

    return replay, forward_context


def _run_forward(
    frame: Frame, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], forward_context: Any
) -> Any:
    """The segment's original forward: placeholders saved, inputs kept, its sequence numbers recorded."""
    start = next_sequence_nr()
    # a compiled function cannot take the views' subclass (and is one autograd node: one edge per input anyway)
    fn_compiled = compiled(fn)
    args, kwargs = tree_map(plain if fn_compiled else consumer_views, (args, kwargs))
    frame.fn, frame.compiled = fn, True if fn_compiled else None  # a compiled submodule: looked up when asked
    frame.args = list(args)
    tensors = []
    for pos, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            frame.tensor_pos.append(pos)
            frame.args[pos] = None
            tensors.append(a)
    if tensors:
        # the dummy makes the saver an autograd node even when no input requires grad
        dummy = torch.empty(0, requires_grad=True)
        frame.saver = SaveInputs.apply(dummy, *tensors)
    with ForwardHooks(frame), forward_context:
        out = fn(*args, **kwargs)
    frame.forward_done = True
    frame.registry.record(start, next_sequence_nr(), frame)
    return tree_map(consumer_views, out)


def checkpoint_modules(*modules: torch.nn.Module) -> None:
    """Run each module's whole forward under :func:`checkpoint`, one segment per module.

    Coarser than a library's own switch (which checkpoints the layers inside a block), but every tensor
    that leaves a segment then hands each consumer a view of its own: the router can cut and interleave its
    calls between the segments even where a block's outputs feed skip connections (diffusers' UNet blocks),
    so each shared recomputation is freed before the next is made. Module hooks run outside the segment.

    Args:
        *modules: the modules to checkpoint (e.g. ``*unet.down_blocks, unet.mid_block, *unet.up_blocks``).

    Raises:
        TypeError: an argument is not an ``nn.Module``.

    Examples:
        >>> import torch, gradroute
        >>> body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        >>> gradroute.checkpoint_modules(body[0], body[2])
        >>> body(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> body[0].weight.grad.shape
        torch.Size([4, 4])
    """
    _check_modules(modules)
    cover(modules)
    for m in modules:
        m.forward = functools.partial(checkpoint, m.forward)  # type: ignore[method-assign]


def cut_points(*modules: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Let the router cut its passes at these modules' outputs: every op that consumes one gets its own view.

    The router interleaves its passes through shared :func:`checkpoint` segments only where it can cut
    between them, and a tensor that plain code hands to ops on both sides of a segment leaves no cut there
    (a ``GradientEdge`` captures the sum of everything flowing into a node). diffusers' UNet with its own
    per-layer switch is such a case: its skip connections leave from un-checkpointed modules (downsamplers,
    transformer models). The planner then recomputes those segments once per pass, like torch, to keep the
    peak at the floor. Marking the UNet blocks' submodules as cut points gives each consumer of their outputs
    an autograd node of its own, so the passes interleave layer by layer and share one recomputation. Nothing
    changes outside a routed backward but one view per consuming op. Module forward hooks.

    Args:
        *modules: the modules whose outputs may be cut (e.g. every resnet, transformer model, down- and
            upsampler of ``unet.down_blocks``, ``unet.mid_block`` and ``unet.up_blocks``).

    Returns:
        The forward hooks' handles (``handle.remove()`` undoes it).

    Raises:
        TypeError: an argument is not an ``nn.Module``.

    Examples:
        >>> import torch, gradroute
        >>> body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        >>> handles = gradroute.cut_points(body[0])
        >>> y = body[0](torch.randn(2, 4, requires_grad=True))
        >>> (y * 2 + y).sum().backward()  # two consumers of y, each through a view of its own
        >>> for handle in handles:
        ...     handle.remove()
    """
    _check_modules(modules)
    cover(modules)
    return [m.register_forward_hook(view_outputs) for m in modules]


def _check_modules(modules: tuple[Any, ...]) -> None:
    for k, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"`modules` item {k} must be an nn.Module, got {type(m).__name__}")
