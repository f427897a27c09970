"""Every private torch API gradroute touches, in one place: which releases have it, what gradroute does without.

gradroute supports torch 2.5 to 2.15 (``pyproject.toml``; 2.4 is refused at import, see ``MIN_TORCH``); every
minor release is tested by ``make test-matrix`` (README, "Supported versions"). The rest of the package takes
torch's private names from here only, so that a torch release that moves or drops one is handled (or refused
with a clear error) in this file.

NOTE [Private torch APIs]
Where a public API does the job it is used instead (autocast state: ``torch.is_autocast_enabled(device)``,
``torch.get_autocast_dtype``, ``torch.is_autocast_cache_enabled``, not ``torch.utils.checkpoint``'s
``_get_autocast_kwargs``, whose keyword changed from ``device`` (2.4) to ``device_type`` (2.5)). The rest:

==========================================  ============  ======================================================
API                                         releases      without it
==========================================  ============  ======================================================
``SavedTensor.data`` / ``.unpack_hook`` /  [1]_          freed-graph probe through ``register_hooks`` (below);
``.unpack()`` (all three: ``SAVED_DATA``)
                                                          checkpoint bytes per node from sequence numbers;
                                                          torch's own checkpoint nodes not recognised [2]_
``SavedTensor.register_hooks``,             all           -
``node._raw_saved_*``, the class
``torch._C._autograd.SavedTensor``
``torch._C._autograd._get_sequence_nr``,    all           -
``Node._sequence_nr()``
``torch._C._current_graph_task_id``,        all           -
``torch._C._current_autograd_node``
``torch._C._get_graph_exec_group``          2.10+ [6]_    no ``GraphExecGroup`` can be in effect: keyed by the
                                                          engine's graph task, as torch's checkpoint then did
``torch._C._DisableAutocast``               all           -
``torch.autograd.graph._engine_run_backward``  all        ``torch.autograd.backward``/``grad`` (their checks,
                                                          repeated per engine call)
``Variable._execution_engine``              all           -
``.queue_callback``
``torch.utils.checkpoint`` internals:       all           -
``_infer_device_type``, ``_get_device_module``,
``_Holder``
``torch.utils._python_dispatch``,           all           -
``torch.utils._pytree.tree_map``,
``torch.multiprocessing.reductions.StorageWeakRef``,
``OpOverload._schema``,
``UntypedStorage._cdata``, ``Tensor._version``,
``Tensor._backward_hooks``,
``Tensor._post_accumulate_grad_hooks``,
``torch._C.DisableTorchFunctionSubclass``
``torch._dynamo.eval_frame.OptimizedModule``  all         (read only once ``torch._dynamo`` is imported: nothing
                                                          can be compiled before)
``torch._functorch.config.donated_buffer``  all           nothing to turn off (no donated buffers)
``DistributedDataParallel``                  all           (a wrapper routed inside its forward is found only
``._active_ddp_module``                                   when named or built into a group)
``GradScaler._found_inf_per_device``,       all           ``found_inf`` checks the unscaled gradients;
``._per_optimizer_states``, ``._scale``,                  the stage check is skipped; the scale and growth
``._growth_tracker``, ``._init_scale``,                   tracker are saved through ``state_dict()`` (a host
``Optimizer._step_supports_amp_scaling``                  sync); a failed unscale is undone from copies
(with ``.found_inf``/``.grad_scale``)
FSDP2 (``fully_shard``) internals:
``torch.distributed._composable_state``     all           -
FSDPState/FSDPParam module                  2.6+ [3]_     2.5: ``torch.distributed._composable.fsdp``
``FSDPState._fsdp_param_groups``            2.10+         ``_fsdp_param_group`` (one group per state)
``FSDPParam._unsharded_param``              all           -
``torch.distributed.fsdp.fully_shard``      2.6+ [5]_     2.5: ``torch.distributed._composable.fsdp`` (whose
                                                          FSDP2 runs on CUDA only)
torch.compile internals (``gradroute.compile``):
``torch._C._will_engine_execute_node``,     all [4]_      ``gradroute.compile`` is ``torch.compile``: exact,
``torch._dynamo.backends`` (``aot_autograd``,             compiled backwards not pruned, and the plan says why
``boxed_nop``), ``torch._functorch.partitioners``,        (``compiler_internals_missing`` names what is
``torch._inductor.compile_fx`` (``compile_fx``,           missing)
``compile_fx_inner``), ``torch._inductor.config``,
``torch._TorchCompileInductorWrapper``,
``torch._guards`` (``TracingContext``,
``CompileContext``), AOTAutograd's
``get_aot_compilation_context``,
``CompiledFunction._aot_id``,
``fw_metadata.bw_donated_idxs``
``torch._functorch.config``                 all           (keys missing in a release are not patched)
``.enable_autograd_cache`` / ``.force_autograd_cache``
==========================================  ============  ======================================================

.. [1] all three from 2.12 (tested: 2.12.1, 2.13.0, 2.15.0); 2.5 to 2.9 have none, 2.10 and 2.11 have ``.data``
   and ``.unpack_hook`` without ``.unpack``. The README's table ("Supported versions", column "has") lists
   every tested release.
.. [2] the plan's note that ``torch.utils.checkpoint`` segments are recomputed once per call is not given;
   the gradients and the calls are the same.
.. [3] ``torch.distributed.fsdp._fully_shard._fsdp_state``.
.. [4] measured per release by ``make test-matrix`` (``tools/prune_probe.py``): the README table's column
   "prunes compiled regions".
.. [5] FSDP2 runs on the CPU (gloo) from torch 2.7; 2.6's fails there in its first forward (its all-gather
   calls ``Stream.record_event``, which a CPU stream lacks), in torch, before gradroute is involved.
.. [6] not in 2.5 to 2.9 (tested: 2.5.1 to 2.9.1), in 2.10.0 and every later release tested.

NOTE [Freed-graph probe without SavedTensor.data]
The router refuses a loss whose graph an earlier backward freed before it touches anything, by looking at
the raw saved tensors near the loss without unpacking them (unpacking runs saved-tensor hooks: a
checkpoint would recompute). Without ``SavedTensor.data`` the state is read from
``SavedTensor.register_hooks``, the documented way to hook a saved tensor after the fact: it raises on a
freed one ("after it has been freed") and on one that has hooks ("already been set"), and leaves both as
they were. On a live one without hooks it succeeds: that tensor then goes through an identity pair of
hooks that keep it as it was saved and check its version at unpack time, as the engine does for tensors
without hooks. The probe stops at the first live tensor, so at most one tensor per routed loss is hooked so.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.utils.checkpoint as _torch_ckpt
from torch._C._autograd import _get_sequence_nr
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointError, get_device_states, noop_context_fn, set_device_states

__all__ = [
    "SAVED_ATTRS",
    "SAVED_DATA",
    "SAVED_TENSOR",
    "CheckpointError",
    "StorageWeakRef",
    "TorchDispatchMode",
    "TorchPlaceholder",
    "active_ddp_module",
    "aot_eager_backend",
    "aot_id_being_compiled",
    "aot_id_of",
    "backward_hooks",
    "boxed_nop",
    "compile_contexts",
    "compiler_internals_missing",
    "current_autograd_node",
    "current_graph_exec_group",
    "current_graph_task_id",
    "device_module",
    "disable_torch_function_subclass",
    "engine_run_backward",
    "engine_will_execute",
    "found_inf",
    "found_inf_tensor",
    "fsdp_param_groups",
    "fsdp_states",
    "fully_shard",
    "get_autocast_kwargs",
    "get_device_states",
    "grad_and_hooks",
    "grad_and_hooks_names",
    "inductor_compile",
    "inductor_compile_inner",
    "inductor_config_patch",
    "inductor_patches",
    "infer_device_type",
    "is_optimized_module",
    "next_sequence_nr",
    "no_autocast",
    "no_autograd_cache",
    "no_backward_donation",
    "no_donated_buffers",
    "node_sequence_nr",
    "noop_context_fn",
    "op_schema",
    "queue_engine_callback",
    "saved_attrs",
    "saved_data",
    "saved_items",
    "saved_state",
    "scale_init",
    "scale_tensors",
    "scale_uninitialised",
    "scaler_states",
    "set_device_states",
    "set_scaler_states",
    "skips_on_device",
    "storage_id",
    "target_schema",
    "tree_map",
    "unsharded_param",
    "version",
]

TORCH_VERSION = torch.__version__.split("+")[0]

#: the oldest torch gradroute supports: the first whose autograd engine starts a backward from a
#: ``GradientEdge`` (``torch.autograd.grad(outputs=edge, grad_outputs=g)``); every pass the router cuts resumes
#: from one, and so does the hand-off of captured gradients to ``AccumulateGrad`` (``_execute``)
MIN_TORCH = (2, 5)


def _release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


if _release(TORCH_VERSION) < MIN_TORCH:
    raise ImportError(
        f"gradroute needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later, but torch {TORCH_VERSION} is installed: "
        "the router resumes its cut passes from a torch.autograd.graph.GradientEdge "
        "(torch.autograd.grad(outputs=edge, ...)), which torch 2.5 added. "
        f'Upgrade torch: pip install "torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}"'
    )

# ---------------------------------------------------------------------------------------------- saved tensors

#: whether ``torch._C._autograd.SavedTensor`` exposes ``.data`` (what the pack hook returned), ``.unpack_hook``
#: and ``.unpack()`` (the router tells a never-defined optional tensor from a released one by unpacking it);
#: torch 2.10 and 2.11 have ``.data`` without ``.unpack``: gradroute then takes the path of the releases before
SAVED_DATA: bool = all(hasattr(torch._C._autograd.SavedTensor, a) for a in ("data", "unpack_hook", "unpack"))
#: the class of a raw saved tensor (``node._raw_saved_self``); a hot loop compares ``type(item)`` to it
SAVED_TENSOR: Any = torch._C._autograd.SavedTensor

_RAW_SAVED = "_raw_saved_"
#: node class -> :func:`saved_attrs` of its nodes, filled by it (a hot loop may look a class up here first)
SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def saved_attrs(node: Any) -> tuple[str, ...]:
    """The names of an autograd node's raw saved-tensor attributes (``_raw_saved_*``), cached per node class.

    Reading them (``node._raw_saved_self``) gives the ``SavedTensor`` without unpacking it, so no
    saved-tensor hook (e.g. a checkpoint's recomputation) runs.
    """
    cls = type(node)
    names = SAVED_ATTRS.get(cls)
    if names is None:
        names = SAVED_ATTRS[cls] = tuple(a for a in dir(node) if a.startswith(_RAW_SAVED))
    return names


def saved_items(node: Any) -> list[Any] | None:
    """A node's raw saved tensors (``SavedTensor``, None for a saved None), or None once torch reports the node
    freed (lists of saved tensors raise when read after a backward freed them)."""
    out: list[Any] = []
    for name in saved_attrs(node):
        try:
            raw = getattr(node, name)
        except RuntimeError:  # freed by an earlier backward
            return None
        out.extend(raw if isinstance(raw, (list, tuple)) else (raw,))
    return out


def saved_data(item: Any) -> Any:
    """What the saved-tensor pack hook returned for ``item`` (the tensor itself without hooks; None once freed).

    Raises:
        RuntimeError: on a torch without ``SavedTensor.data`` (check :data:`SAVED_DATA` first).
    """
    if not SAVED_DATA:
        raise RuntimeError(
            f"torch {TORCH_VERSION} does not expose what a saved-tensor hook packed (SavedTensor.data, "
            "newer torch releases); gradroute uses its fallback (internal error, please report)"
        )
    return item.data


def saved_state(item: Any) -> Literal["live", "freed", "none"]:
    """Whether a raw saved tensor still holds its value (``"live"``), was freed by a backward (``"freed"``),
    or saved None (``"none"``); its hooks do not run (see NOTE [Freed-graph probe without SavedTensor.data])."""
    if SAVED_DATA:
        if item.data is not None or item.unpack_hook is not None:
            return "live"
        return "none" if _unpacks_to_none(item) else "freed"
    return _state_by_register(item)


def _unpacks_to_none(item: Any) -> bool:
    """Whether an empty saved tensor is an optional tensor never defined (``unpack()`` gives None) rather than
    one a backward released (``unpack()`` raises): with ``SavedTensor.data`` only unpacking tells them apart."""
    try:
        item.unpack()
    except RuntimeError:
        return False
    return True


def _state_by_register(item: Any) -> Literal["live", "freed", "none"]:
    """:func:`saved_state` without ``SavedTensor.data``: what ``register_hooks`` says about ``item``."""
    try:
        item.register_hooks(_probe_pack, _probe_unpack)
    except RuntimeError as e:
        message = str(e)
        if "after it has been freed" in message:
            return "freed"
        if "with value None" in message:
            return "none"
        if "already been set" in message:
            return "live"
        raise
    return "live"


def _probe_pack(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x, x._version


def _probe_unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    x, saved = packed
    if x._version != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{x.type()} {list(x.shape)}] is at version {x._version}; expected version {saved} instead"
        )
    return x


# ------------------------------------------------------------------------------------------- autograd engine


#: ``torch.autograd.backward``'s and ``torch.autograd.grad``'s own entry into the engine, without their argument
#: checks (the executor calls the engine once per planned call), or None
engine_run_backward: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)


def next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread gets."""
    return int(_get_sequence_nr())


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (creation order on its thread)."""
    return int(node._sequence_nr())


def current_graph_task_id() -> int:
    """The id of the engine call running on this thread, -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


def current_autograd_node() -> Any:
    """The autograd node being executed on this thread, None outside a backward."""
    return torch._C._current_autograd_node()


def current_graph_exec_group() -> Any:
    """The ``torch.utils.checkpoint.GraphExecGroup`` in effect, None if none (or the release has none)."""
    get = getattr(torch._C, "_get_graph_exec_group", None)
    return get() if get is not None else None


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the engine call running now finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def backward_hooks(t: torch.Tensor) -> dict[Any, Any] | None:
    """The ``Tensor.register_hook`` hooks of ``t`` (its private dict), None if it has none."""
    return t._backward_hooks


#: ``t -> (t.grad, t's register_hook hooks, its register_post_accumulate_grad_hook hooks)``, the hooks as their
#: private dicts or None, in one C call (a loop over every routed parameter on each backward calls it)
grad_and_hooks_names = ("grad", "_backward_hooks", "_post_accumulate_grad_hooks")
"""A tensor's gradient and its two dicts of gradient hooks (None when it has none), by attribute name."""
grad_and_hooks: Callable[[torch.Tensor], tuple[Any, Any, Any]] = operator.attrgetter(*grad_and_hooks_names)


no_autocast: Callable[[], Any] = getattr(torch._C, "_DisableAutocast", contextlib.nullcontext)
"""Context manager: autocast off for the ops inside (what autocast's own cast ops run under)."""


# --------------------------------------------------------------------------------- tensors, ops, dispatch


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place op)."""
    return int(t._version)


def storage_id(t: torch.Tensor) -> int:
    """What identifies ``t``'s storage while it lives (its address; two live storages never share it)."""
    return int(t.untyped_storage()._cdata)


def op_schema(func: Any) -> Any:
    """An ``OpOverload``'s schema (``torch._C.FunctionSchema``)."""
    return func._schema


def target_schema(target: Any) -> Any | None:
    """The schema of an FX node's call target, None for a target that is no op (a Python function)."""
    return getattr(target, "_schema", None)


#: context manager (the class itself: no Python call around it, it runs once per op on a segment's tensors):
#: ``__torch_function__`` of tensor subclasses off (plain ``torch.Tensor`` behaviour)
disable_torch_function_subclass: Any = torch._C.DisableTorchFunctionSubclass


def is_optimized_module(fn: Any) -> bool:
    """Whether ``fn`` is code compiled by ``torch.compile``: a compiled function or module, or a module whose
    ``compile()`` was called (nothing can be, before ``torch._dynamo`` is imported)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return (
        hasattr(fn, "_torchdynamo_orig_callable")
        or (optimized is not None and isinstance(fn, optimized))
        or getattr(fn, "_compiled_call_impl", None) is not None
    )


def no_donated_buffers() -> contextlib.AbstractContextManager[Any]:
    """Context manager: AOTAutograd donates no saved activations to compiled backwards (routed passes retain).

    ``torch._functorch.config.donated_buffer`` exists in every supported release (README table, column "has");
    where it is missing, nothing is donated.
    """
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "donated_buffer"):
        return contextlib.nullcontext()
    return functorch_config.patch(donated_buffer=False)


# ----------------------------------------------------------------------------------- torch.utils.checkpoint

#: what torch's non-reentrant checkpoint saves in its segments' nodes
TorchPlaceholder: type | None = getattr(_torch_ckpt, "_Holder", None)


def infer_device_type(*args: Any) -> str:
    """The device type a checkpointed function's tensor arguments live on, as torch's checkpoint infers it."""
    return str(_torch_ckpt._infer_device_type(*args))


def device_module(device_type: str) -> Any:
    """``torch.cuda`` for ``"cuda"``, and so on (``torch.utils.checkpoint``'s lookup)."""
    return _torch_ckpt._get_device_module(device_type)


def get_autocast_kwargs(device_type: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The autocast state in effect for ``device_type`` (None if autocast is not available for it) and for
    the CPU, as keyword arguments of ``torch.amp.autocast``; public APIs only."""
    cache = torch.is_autocast_cache_enabled()

    def state(dt: str) -> dict[str, Any]:
        return {"enabled": torch.is_autocast_enabled(dt), "dtype": torch.get_autocast_dtype(dt), "cache_enabled": cache}

    device = state(device_type) if torch.amp.is_autocast_available(device_type) else None
    return device, state("cpu")


# ------------------------------------------------------------------------------------------------ GradScaler


def found_inf(scaler: Any, optimizer: Any) -> bool | None:
    """Whether ``scaler.step(optimizer)`` will skip the step (the record ``unscale_`` left), None if unknown."""
    record = getattr(scaler, "_found_inf_per_device", None)
    if record is None:
        return None
    return bool(sum(float(v) for v in record(optimizer).values()))


def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` whose forward is running (the innermost), or None."""
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def found_inf_tensor(scaler: Any, optimizer: Any) -> torch.Tensor | None:
    """The record ``unscale_`` left for ``optimizer``, summed on the scale's device without a host sync (what
    ``GradScaler.step`` hands a fused optimizer as ``found_inf``); None if unknown or empty."""
    record = getattr(scaler, "_found_inf_per_device", None)
    scale = getattr(scaler, "_scale", None)
    if record is None or not isinstance(scale, torch.Tensor):
        return None
    values = list(record(optimizer).values())
    if not values:
        return None
    # a copy: ``update()`` adds the other optimizers' records into the first one's tensor in place
    total = values[0].to(scale.device, non_blocking=True, copy=True)
    for v in values[1:]:
        total = total + v.to(scale.device, non_blocking=True)
    return total  # type: ignore[no-any-return]


def scale_tensors(scaler: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``GradScaler._scale`` and ``._growth_tracker`` (changed in place by ``update()``), None where missing."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor):
        return scale, tracker
    return None


def scale_init(scaler: Any) -> float | None:
    """``GradScaler._init_scale``: the scale it starts from (``load_state_dict`` sets it too), None if missing."""
    value = getattr(scaler, "_init_scale", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` reads ``found_inf``/``grad_scale`` attributes and skips its update on the
    device (``_step_supports_amp_scaling``: torch's fused Adam, AdamW, SGD), as ``GradScaler.step`` uses it."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    step = optimizer.step
    return _without_grad_scaler(getattr(step, "__func__", step))


@functools.lru_cache(maxsize=64)
def _without_grad_scaler(step: Any) -> bool:
    """Whether ``step`` (an optimizer's step function) takes no ``grad_scaler`` argument (the deprecated protocol);
    cached per function: read on every ``Router.step``."""
    try:
        return "grad_scaler" not in inspect.signature(step).parameters
    except (TypeError, ValueError):  # pragma: no cover - a step without a signature
        return False


def scaler_states(scaler: Any) -> dict[int, Any] | None:
    """``GradScaler._per_optimizer_states`` (``id(optimizer)`` -> its stage and found-inf record this
    iteration), None where the scaler has no such record."""
    states = getattr(scaler, "_per_optimizer_states", None)
    return states if isinstance(states, dict) else None


def set_scaler_states(scaler: Any, states: dict[int, Any]) -> None:
    """Replace ``GradScaler._per_optimizer_states`` (to put a failed step's records back)."""
    scaler._per_optimizer_states = states


def scale_uninitialised(scaler: Any) -> bool:
    """Whether the scaler has not made its scale tensor yet (``GradScaler._scale`` is None until ``scale()``)."""
    return getattr(scaler, "_scale", 0) is None


# ------------------------------------------------------------------------------------------------ FSDP2


def _fsdp_state_type() -> type | None:
    for name in ("torch.distributed.fsdp._fully_shard._fsdp_state", "torch.distributed._composable.fsdp._fsdp_state"):
        try:
            module = __import__(name, fromlist=["FSDPState"])
        except ImportError:
            continue
        return getattr(module, "FSDPState", None)
    return None


def fsdp_states() -> Iterator[tuple[torch.nn.Module, Any]] | None:
    """``(module, FSDPState)`` of every live FSDP2 state; None if this torch's FSDP2 internals are unknown."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return None
    state_type = _fsdp_state_type()
    if state_type is None:
        return None

    def states() -> Iterator[tuple[torch.nn.Module, Any]]:
        for module, ref in list(_module_state_mapping.items()):
            state = ref() if isinstance(ref, weakref.ref) else ref
            if isinstance(state, state_type):
                yield module, state

    return states()


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups (one per state before torch 2.10)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def unsharded_param(fsdp_param: Any) -> torch.Tensor | None:
    """The unsharded parameter an ``FSDPParam``'s forward uses (one tensor reused across iterations); None
    before the first forward."""
    t = getattr(fsdp_param, "_unsharded_param", None)
    return t if isinstance(t, torch.Tensor) else None


def fully_shard() -> Callable[..., Any]:
    """FSDP2's ``fully_shard`` (public from torch 2.6; ``torch.distributed._composable.fsdp`` in 2.5)."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard as fn  # type: ignore[no-redef]
    return fn


# ------------------------------------------------------------------------- torch.compile (gradroute.compile)
# What gradroute.compile (``_compile``) needs to wrap a backend's backward compiler and specialise the compiled
# backward per engine call. Missing any of it (see ``compiler_internals_missing``), gradroute.compile falls back
# to plain torch.compile (exact, not pruned) and the plan says so.


def compiler_internals_missing() -> str | None:
    """Why this torch cannot specialise compiled backwards (the first missing private API), or None."""
    for name in ("_current_autograd_node", "_will_engine_execute_node"):
        if not hasattr(torch._C, name):
            return f"torch {TORCH_VERSION} has no torch._C.{name}"
    try:
        from torch._dynamo.backends.common import aot_autograd  # noqa: F401
        from torch._dynamo.backends.debugging import boxed_nop  # noqa: F401
        from torch._functorch._aot_autograd.logging_utils import get_aot_compilation_context  # noqa: F401
        from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: F401
        from torch._guards import compile_context, tracing  # noqa: F401
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: F401

        torch._TorchCompileInductorWrapper  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"torch {TORCH_VERSION}: {e}"
    return None


def engine_will_execute(fn: Any) -> bool:
    """Whether the running graph task executes the autograd node ``fn``.

    Raises:
        RuntimeError: from torch, for a leaf that ``torch.autograd.grad`` captures (torch does not answer).
    """
    return bool(torch._C._will_engine_execute_node(fn))


def aot_eager_backend(fw_compiler: Callable[..., Any], bw_compiler: Callable[..., Any]) -> Callable[..., Any]:
    """The ``aot_eager`` backend (AOTAutograd, eager kernels) with its forward and backward compilers replaced."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )


def boxed_nop(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """``aot_eager``'s compiler: ``gm`` run as it is, boxed calling convention."""
    from torch._dynamo.backends.debugging import boxed_nop as nop

    return nop(gm, example_inputs)


def inductor_patches(mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> dict[str, Any]:
    """The inductor config patches ``torch.compile(mode=, options=, dynamic=)`` applies."""
    return dict(torch._TorchCompileInductorWrapper(mode, options, dynamic).config)  # type: ignore[attr-defined]


def inductor_config_patch(patches: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Context manager: ``torch._inductor.config`` patched with ``patches``."""
    from torch._inductor import config

    return config.patch(patches)


def inductor_compile(
    gm: torch.fx.GraphModule, example_inputs: Any, inner_compile: Callable[..., Any], patches: dict[str, Any]
) -> Any:
    """Inductor's backend (``compile_fx``) with its per-graph compiler replaced by ``inner_compile``."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def inductor_compile_inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's per-graph compiler (``compile_fx_inner``; ``kwargs["is_backward"]`` tells a backward graph)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def no_autograd_cache() -> contextlib.AbstractContextManager[Any]:
    """Context manager: AOTAutograd's cache off (on a hit it loads a backward without calling its compiler).

    ``enable_autograd_cache`` / ``force_autograd_cache`` are patched where this release has them.
    """
    import torch._functorch.config as functorch_config

    keys = ("enable_autograd_cache", "force_autograd_cache")
    return functorch_config.patch({k: False for k in keys if hasattr(functorch_config, k)})


def compile_contexts() -> Callable[[], contextlib.ExitStack]:
    """What re-enters, later, the tracing and compile contexts (``torch._guards``) in effect now."""
    from torch._guards import CompileContext, TracingContext, compile_context, tracing

    tc, cc = TracingContext.try_get(), CompileContext.try_get()

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(tracing(tc))
        stack.enter_context(compile_context(cc))
        return stack

    return enter


def no_backward_donation() -> None:
    """The backward being compiled now takes no donated buffers (``fw_metadata.bw_donated_idxs`` emptied)."""
    from torch._guards import TracingContext

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    if meta is not None and hasattr(meta, "bw_donated_idxs"):
        meta.bw_donated_idxs = []


def aot_id_being_compiled() -> int | None:
    """The AOTAutograd id of the graph being compiled now (from its compilation context), or None."""
    from torch._functorch._aot_autograd.logging_utils import get_aot_compilation_context

    names = get_aot_compilation_context()[0]
    head = names[0].split("_", 1)[0] if names else ""
    return int(head) if head.isdigit() else None


def aot_id_of(node: Any) -> int | None:
    """The AOTAutograd id of a ``CompiledFunctionBackward`` node's region (``CompiledFunction._aot_id``)."""
    return getattr(getattr(node, "_forward_cls", None), "_aot_id", None)
