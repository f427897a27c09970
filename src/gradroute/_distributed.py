"""DDP and FSDP2 under the router: which tensors the routed passes target, and the wrappers' sync switches.

Why routed passes are exact under ``DistributedDataParallel`` (torch 2.4+; checked with gloo, 2 processes):

* DDP's reducer hooks every parameter's ``AccumulateGrad`` node (a post hook). A hook marks the parameter
  ready; when every parameter of a bucket is ready, the bucket is all-reduced; when every bucket is done,
  ``finalize_backward`` is queued on the engine call running at that moment and the averaged bucket is copied
  back into ``.grad`` at the end of that call.
* The router runs several engine calls for one forward. Each call executes the ``AccumulateGrad`` nodes of
  its own targets only (``inputs=``), so every parameter is marked ready exactly once per backward, in
  whichever call accumulates it: no "marked ready twice", and a bucket that mixes parameters of two groups is
  all-reduced in the later of their calls. (Gradients captured by a call that cuts the graph reach their
  ``AccumulateGrad`` nodes through one more engine call, ``_execute``, so their hooks fire too.) The value
  read into the bucket is the parameter's full ``.grad``, so micro-batches accumulated under ``no_sync`` are
  included, as with a plain backward.
* Whether a backward synchronizes is decided by DDP's *forward* (``require_backward_grad_sync`` read in
  ``_post_forward``, which arms the reducer), not by the backward: a ``no_sync()`` around the backward alone
  still all-reduces. For gradient accumulation the flag must therefore be set before the next micro-batch's
  forward: :class:`GradSync` does that when the router closes a micro-batch.
* ``static_graph=True`` does not fit several engine calls: on the first iteration DDP queues its delayed
  all-reduce on the first engine call that crosses its output (``_DDPSink``), which ends before the later
  routed passes have produced their gradients; those parameters are then recorded as unused for good. It is
  refused. ``find_unused_parameters=True`` works.

FSDP2 (``fully_shard``): the registered parameters are sharded DTensors, but the forward runs on the
unsharded parameters (``FSDPParam._unsharded_param``, one tensor object reused across iterations) and the
graph's ``AccumulateGrad`` nodes hold those. :func:`live_params` maps a group's sharded parameters to them, so
the routed passes target what the graph holds; FSDP2's own hooks (pre-backward unshard on the module outputs,
post-backward reduce-scatter on the module inputs and in the root's end-of-backward callback) then move the
unsharded gradients into the sharded ``.grad`` as after a plain backward.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._compat import active_ddp_module, fsdp_param_groups, fsdp_states, unsharded_param
from ._types import Route

_FSDP_INTERNALS = (
    "gradroute maps FSDP2's sharded parameters to the unsharded tensors its forward uses through FSDP2 "
    "internals (torch.distributed._composable_state._module_state_mapping, FSDPParam.sharded_param and "
    "_unsharded_param), which this torch version does not have"
)


def _dtensor_type() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` was imported (no DTensor can exist otherwise), else None."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def _fsdp_params() -> dict[int, Any] | None:
    """``id(sharded parameter) -> FSDPParam`` for every live FSDP2 state; None if the internals are missing."""
    states = fsdp_states()
    if states is None:
        return None
    out: dict[int, Any] = {}
    for _, state in states:
        for group in fsdp_param_groups(state):
            for fp in group.fsdp_params:
                out[id(fp.sharded_param)] = fp
    return out


def live_params(params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors that hold ``params``' gradients in the autograd graph of the current forward.

    A plain parameter is itself. A parameter sharded by FSDP2's ``fully_shard`` (a DTensor) is replaced by the
    unsharded parameter its forward used; a DTensor FSDP2 does not manage (tensor parallel) is itself. Costs
    one dictionary lookup unless ``torch.distributed.tensor`` was imported.

    Raises:
        RuntimeError: DTensor parameters with a torch whose FSDP2 internals gradroute does not know.
    """
    if not has_dtensor(params):
        return params
    mapping = _fsdp_params()
    if mapping is None:
        raise RuntimeError(_FSDP_INTERNALS)
    out = []
    for p in params:
        fp = mapping.get(id(p))  # keyed by live sharded parameters: no other tensor's id
        if fp is None:
            out.append(p)
            continue
        unsharded = unsharded_param(fp)
        # before the first forward there is no unsharded parameter yet (and no graph that could reach it)
        out.append(unsharded if unsharded is not None else p)
    return tuple(out)


def has_dtensor(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor (fixed for given tensors: :func:`live_params` is needed for those
    only)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in params)


def fsdp2_unsharded(routes: Sequence[Route], params: Mapping[str, tuple[torch.Tensor, ...]]) -> bool:
    """Whether any route targets FSDP2's unsharded parameters: :func:`live_params` replaced some of its group's
    (``params``: group name -> the group's own parameters).

    FSDP2 reduce-scatters a module's gradients at the end of the first engine call that computes any of them,
    so the planner must keep each pass through such a module in one call (no interleaving).
    """
    return any(r.params is not params[r.name] for r in routes)


def _ddp_class() -> type | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def find_ddp(groups: Iterable[Any], *, modules: bool = True) -> list[Any]:
    r"""The ``DistributedDataParallel`` modules that hold any of the parameters of ``groups`` (``Group``\ s).

    DDP keeps no registry and leaves no mark on the parameters or the module it wraps, so the wrappers are
    found where the router can see them, without scanning the process's objects: a group's ``ddp``; the module
    a group was built from and its submodules (a group built from the wrapper); the wrapper whose forward is
    running (``DistributedDataParallel._active_ddp_module``: losses routed inside its forward, as Lightning
    does). ``modules=False`` looks at the running wrapper only. Empty unless ``torch.distributed`` is
    initialized.
    """
    ddp_class: Any = _ddp_class()
    if ddp_class is None:
        return []
    groups = list(groups)
    found: dict[int, Any] = {}
    for g in groups if modules else ():
        source = g.source() if g.source is not None else None
        candidates = [g.ddp, *(source.modules() if source is not None else ())]
        for m in candidates:
            if isinstance(m, ddp_class):
                found.setdefault(id(m), m)
    active: Any = active_ddp_module()
    if isinstance(active, ddp_class) and id(active) not in found:
        ids = {id(p) for g in groups for p in g.params}
        if any(id(p) in ids for p in active.module.parameters()):
            found[id(active)] = active
    return list(found.values())


def find_fsdp(params: Iterable[torch.Tensor]) -> list[torch.nn.Module]:
    """The FSDP2 modules (``fully_shard``) whose own parameter groups hold any of ``params`` (sharded)."""
    states = fsdp_states() if _dtensor_type() is not None else None
    if states is None:
        return []
    ids = {id(p) for p in params}
    found: dict[int, torch.nn.Module] = {}
    for module, state in states:
        if any(id(fp.sharded_param) in ids for g in fsdp_param_groups(state) for fp in g.fsdp_params):
            found[id(module)] = module
    return list(found.values())


class GradSync:
    """The DDP and FSDP2 wrappers of a router's parameters: checks, and gradient sync for accumulation.

    With ``accumulate > 1`` the wrappers skip gradient communication on every micro-batch but the last of a
    window: DDP's ``require_backward_grad_sync`` (what ``no_sync()`` switches, read by DDP's forward) and
    FSDP2's ``set_requires_gradient_sync``. The router sets them when it closes a micro-batch, for the next
    forward, so each wrapped module communicates once per real step. With ``accumulate == 1`` nothing is
    switched (a ``no_sync()`` of the caller's own is left alone).

    Args:
        groups: the router's groups (``name -> Group``).
    """

    def __init__(self, groups: Mapping[str, Any]) -> None:
        self._groups = tuple(groups.values())
        self._params = tuple(group_params(groups))
        self._ddp: list[weakref.ref[Any]] = []
        self._rescanned = False
        self._scan()

    def _scan(self, modules: bool = True) -> None:
        known = {id(m): r for r, m in ((r, r()) for r in self._ddp) if m is not None}
        for m in find_ddp(self._groups, modules=modules):
            known.setdefault(id(m), weakref.ref(m))
        self._ddp = list(known.values())

    def ddp(self) -> list[Any]:
        """The DDP modules found (alive)."""
        return [m for m in (r() for r in self._ddp) if m is not None]

    def check(self, routes: Sequence[Route]) -> None:
        """Refuse, before anything is touched, what DDP cannot do with these routed passes.

        Raises:
            ValueError: a DDP module with ``static_graph=True``; a DDP module (without
                ``find_unused_parameters``) that synchronizes this backward and holds trainable parameters
                the routed groups leave out (DDP would wait for their gradients).
        """
        if not self._ddp and _ddp_class() is None:
            return  # no process group, none found: no wrapper can synchronize this backward
        # wrapped after the router was built: the groups' modules once more (at the first backward with a
        # process group); a wrapper whose forward is running: on every backward (one class attribute read)
        first = not self._rescanned
        self._scan(modules=first)
        self._rescanned = True
        if first and not self._ddp and _ddp_class() is not None and not has_dtensor(self._params):
            warnings.warn(
                "torch.distributed is initialized but gradroute sees no DistributedDataParallel wrapper of the "
                "groups' parameters. If one wraps them, name it (gradroute.Group(module, ddp=wrapper)) or build "
                "the group from the wrapper: gradroute then refuses what DDP cannot do with routed passes "
                "(static_graph=True, a synchronizing backward that leaves some of its parameters out) and skips "
                "its all-reduce on accumulation micro-batches",
                stacklevel=4,
            )
        modules = self.ddp()
        if not modules:
            return
        routed: set[int] = set()
        for r in routes:
            routed.update(id(p) for p in r.params)
        for m in modules:
            if getattr(m, "static_graph", False):
                raise ValueError(
                    f"DistributedDataParallel({type(m.module).__name__}) has `static_graph=True`, which assumes "
                    "one backward per forward: its first-iteration all-reduce runs at the end of the first "
                    "engine call, before the router's later passes have produced their gradients. Build the "
                    "DDP with static_graph=False (the default); find_unused_parameters=True also works"
                )
            if getattr(m, "find_unused_parameters", False) or not getattr(m, "require_backward_grad_sync", True):
                continue
            left = [n for n, p in m.module.named_parameters() if p.requires_grad and id(p) not in routed]
            if left and len(left) < sum(1 for p in m.module.parameters() if p.requires_grad):
                raise ValueError(
                    f"DistributedDataParallel({type(m.module).__name__}) synchronizes this backward but "
                    f"{len(left)} of its trainable parameters (e.g. `{left[0]}`) are in no routed group: DDP "
                    "waits for every parameter's gradient and fails at the next forward. Route every group it "
                    "wraps in each backward, or wrap each network in its own DDP"
                )

    def set_sync(self, sync: bool) -> None:
        """Whether the next forward/backward of every wrapper communicates gradients."""
        for m in self.ddp():
            m.require_backward_grad_sync = sync  # type: ignore[assignment]
        for f in find_fsdp(self._params):
            f.set_requires_gradient_sync(sync, recurse=False)  # type: ignore[operator]

    def next_micro_batch(self, index: int, accumulate: int) -> None:
        """The next forward is micro-batch ``index`` (from 0) of a window of ``accumulate``: sync on the last."""
        if accumulate > 1:
            self.set_sync(index == accumulate - 1)


def group_params(groups: Mapping[str, Any]) -> list[torch.Tensor]:
    """Every parameter of ``groups`` (``name -> Group``), each once."""
    return list(dict.fromkeys(p for g in groups.values() for p in g.params))
