"""PRIVATE TORCH APIS: every private or internal PyTorch name the checkpoint package touches, and nothing else.

The rest of the package imports these names from here only, so a PyTorch upgrade that moves one of them is
fixed in this file (and this file can move into ``gradroute._compat`` as a whole). Checked against torch 2.13.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointError,
    _get_autocast_kwargs,
    _get_device_module,
    _infer_device_type,
    get_device_states,
    noop_context_fn,
    set_device_states,
)

__all__ = [
    "CheckpointError",
    "StorageWeakRef",
    "TorchDispatchMode",
    "TorchPlaceholder",
    "current_autograd_node",
    "current_graph_exec_group",
    "current_graph_task_id",
    "device_module",
    "disable_torch_function_subclass",
    "get_autocast_kwargs",
    "get_device_states",
    "infer_device_type",
    "is_optimized_module",
    "next_sequence_nr",
    "no_autocast",
    "noop_context_fn",
    "op_schema",
    "queue_engine_callback",
    "set_device_states",
    "storage_id",
    "tree_map",
    "version",
]

#: torch's non-reentrant checkpoint saves these in its segments' nodes (``torch.utils.checkpoint._Holder``;
#: absent in some versions)
TorchPlaceholder: type | None = getattr(torch.utils.checkpoint, "_Holder", None)

#: the autograd sequence number the next node created in this thread gets (per thread, see NOTE [Segment
#: registry per thread] in ``_registry.py``)
next_sequence_nr: Callable[[], int] = _get_sequence_nr

#: the devices' autocast and CPU autocast state as keyword arguments of ``torch.amp.autocast``
get_autocast_kwargs = _get_autocast_kwargs
#: the device type of a segment's tensor inputs (``"cuda"``, ...; ``"cpu"`` when there are none)
infer_device_type = _infer_device_type
#: ``torch.cuda`` and friends, for a device type
device_module = _get_device_module

#: switches autocast off (the recorded cheap ops ran below autocast, on tensors it had already cast)
no_autocast: Callable[[], Any] = getattr(torch._C, "_DisableAutocast", contextlib.nullcontext)

#: inside ``__torch_function__`` of a tensor subclass: run ops as on plain tensors
disable_torch_function_subclass: Callable[[], Any] = torch._C.DisableTorchFunctionSubclass


def current_graph_task_id() -> int:
    """The engine call (graph task) running in this thread, or -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


def current_graph_exec_group() -> Any:
    """The ``torch.utils.checkpoint.GraphExecGroup`` in effect (absent in older torch: None)."""
    get_group = getattr(torch._C, "_get_graph_exec_group", None)
    return get_group() if get_group is not None else None


def current_autograd_node() -> Any:
    """The autograd node whose backward is running in this thread (None outside a backward)."""
    return torch._C._current_autograd_node()


def queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the engine call in progress finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def is_optimized_module(fn: Any) -> bool:
    """Whether ``fn`` is what ``torch.compile`` made of a function or module (or a module it compiled in place)."""
    return (
        hasattr(fn, "_torchdynamo_orig_callable")
        or isinstance(fn, torch._dynamo.eval_frame.OptimizedModule)
        or getattr(fn, "_compiled_call_impl", None) is not None
    )


def storage_id(t: torch.Tensor) -> int:
    """The address of a tensor's storage (stable while the storage lives)."""
    return int(t.untyped_storage()._cdata)


def version(t: torch.Tensor) -> int:
    """A tensor's version counter (bumped by each in-place op)."""
    return int(t._version)


def op_schema(func: Any) -> Any:
    """The schema of an ATen op overload (``torch._C.FunctionSchema``: ``is_mutable``, ``returns``)."""
    return func._schema
