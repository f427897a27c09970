"""Named parameter groups: what a routed loss may write gradients into, and how the group is stepped."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._accelerate import scheduler_optimizer

#: A hook that sees a group's unscaled routed gradients before clipping and stepping. It receives the group's
#: parameters (those with a gradient) and may change their ``.grad`` in place.
GradHook = Callable[[Sequence[torch.Tensor]], None]


@dataclass(eq=False)
class Group:
    """A parameter group for :class:`gradroute.Router`, with the optional parts of its training step.

    Args:
        params: an ``nn.Module`` (its parameters with ``requires_grad=True``; frozen ones are left out, as
            with LoRA), or an iterable of leaf tensors that require grad.
        optimizer: the optimizer that owns exactly these parameters; needed for :meth:`Router.step`.
        scheduler: an LR scheduler bound to ``optimizer``, stepped once per real optimizer step.
        max_grad_norm: clip the group's unscaled gradients to this total 2-norm before stepping.
        grad_hook: called with the group's parameters after their gradients are unscaled, before clipping.
        ddp: the ``DistributedDataParallel`` wrapper that holds these parameters, when the group is not built
            from the wrapper itself (e.g. one DDP around both networks, the groups built from its submodules).
            A wrapper is otherwise found without being named when ``params`` is the wrapper or contains it,
            or when the losses are computed and routed inside the wrapper's forward (Lightning).

    Examples:
        >>> import torch, gradroute
        >>> net = torch.nn.Linear(2, 2)
        >>> g = gradroute.Group(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), max_grad_norm=1.0)
        >>> len(g.params)
        2
    """

    params: Any
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    max_grad_norm: float | None = None
    grad_hook: GradHook | None = None
    ddp: Any = None
    name: str = field(default="", repr=False)
    #: ``id(param) -> name`` from ``named_parameters()`` when the group was given as a module (for messages).
    param_names: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    #: The module the group was built from (weakly), where DDP wrappers are looked for.
    source: weakref.ref[nn.Module] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.params, nn.Module):
            self.param_names = {id(p): n for n, p in self.params.named_parameters()}
            self.source = weakref.ref(self.params)
        elif isinstance(self.params, Group):
            self.param_names = dict(self.params.param_names)
            self.source = self.params.source
            if self.ddp is None:
                self.ddp = self.params.ddp
        if self.ddp is not None and not isinstance(self.ddp, nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"`ddp` must be a torch.nn.parallel.DistributedDataParallel or None, got {type(self.ddp).__name__}"
            )
        self.params = _resolve_params(self.params, self.name or "params")
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)):
                raise TypeError(
                    f"`max_grad_norm` must be a positive number or None, got {type(self.max_grad_norm).__name__}"
                )
            if not self.max_grad_norm > 0:
                raise ValueError(f"`max_grad_norm` must be > 0, got {self.max_grad_norm!r}")
        if self.grad_hook is not None and not callable(self.grad_hook):
            raise TypeError(f"`grad_hook` must be callable, got {type(self.grad_hook).__name__}")


GroupLike = Group | nn.Module | Iterable[torch.Tensor]


def _resolve_params(spec: Any, name: str) -> tuple[torch.Tensor, ...]:
    """The de-duplicated trainable leaf tensors of a group spec, or a clear error naming the group."""
    if isinstance(spec, Group):
        return spec.params  # type: ignore[no-any-return]
    if isinstance(spec, nn.Module):
        params = [p for p in spec.parameters() if p.requires_grad]
        if not params:
            total = sum(1 for _ in spec.parameters())
            raise ValueError(
                f"group `{name}` ({type(spec).__name__}) has no parameters that require grad "
                f"({total} parameter(s), all frozen)"
                if total
                else f"group `{name}` ({type(spec).__name__}) has no parameters"
            )
        return tuple(dict.fromkeys(params))
    if isinstance(spec, torch.Tensor):
        raise TypeError(
            f"group `{name}` must be an nn.Module or an iterable of parameters, got a single Tensor "
            f"(wrap it in a list: [{name}])"
        )
    try:
        items = list(spec)
    except TypeError:
        raise TypeError(
            f"group `{name}` must be an nn.Module, a gradroute.Group or an iterable of parameters, "
            f"got {type(spec).__name__}"
        ) from None
    if not items:
        raise ValueError(f"group `{name}` has no parameters (got an empty {type(spec).__name__})")
    for k, p in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"group `{name}`: item {k} is a {type(p).__name__}, not a Tensor")
        if not p.requires_grad:
            raise ValueError(
                f"group `{name}`: parameter {k} (shape {tuple(p.shape)}) does not require grad; "
                "leave frozen parameters out of the group"
            )
        if not p.is_leaf:
            raise ValueError(
                f"group `{name}`: tensor {k} (shape {tuple(p.shape)}) is not a leaf (it was computed from "
                "other tensors); groups hold parameters"
            )
    return tuple(dict.fromkeys(items))


# ---------------------------------------------------------------------- step configuration checks


def describe_param(p: torch.Tensor, groups: Mapping[str, Group]) -> str:
    """``tenc.fc.weight`` (group and parameter name), else ``tenc[3]``, else "a parameter in no group"."""
    shape = "x".join(map(str, p.shape)) or "scalar"
    for gname, g in groups.items():
        if id(p) in g.param_names:
            return f"`{gname}.{g.param_names[id(p)]}` ({shape})"
        for k, q in enumerate(g.params):
            if q is p:
                return f"`{gname}[{k}]` ({shape})"
    return f"a parameter in no group ({shape})"


def optimizer_mismatch(name: str, groups: Mapping[str, Group], limit: int = 5) -> str | None:
    """Why group ``name``'s optimizer does not own exactly the group's parameters, or None if it does."""
    group = groups[name]
    opt = group.optimizer
    if opt is None:
        return None
    owned = [p for pg in opt.param_groups for p in pg["params"]]
    if len(owned) == len(group.params) and all(map(operator.is_, owned, group.params)):
        return None  # the same parameters in the same order (the usual case, checked on every step)
    owned_ids = {id(p) for p in owned}
    mine = {id(p) for p in group.params}
    missing = [p for p in group.params if id(p) not in owned_ids]
    extra = list({id(p): p for p in owned if id(p) not in mine}.values())
    if not missing and not extra:
        return None
    parts = []
    for what, ps in (("is missing", missing), ("also holds", extra)):
        if ps:
            shown = ", ".join(describe_param(p, groups) for p in ps[:limit])
            more = f" and {len(ps) - limit} more" if len(ps) > limit else ""
            parts.append(f"{what} {len(ps)} parameter(s): {shown}{more}")
    return (
        f"the optimizer of group `{name}` must own exactly that group's {len(group.params)} parameters, "
        "but it "
        + "; ".join(parts)
        + " (an optimizer shared by several groups cannot be stepped per group: leave `optimizer` unset and "
        "step it yourself)"
    )


def scheduler_mismatch(name: str, groups: Mapping[str, Group]) -> str | None:
    """Why group ``name``'s scheduler is not bound to the group's optimizer, or None if it is."""
    group = groups[name]
    sched = group.scheduler
    if sched is None:
        return None
    if group.optimizer is None:
        return f"group `{name}` has a `scheduler` but no `optimizer`; give the optimizer it is bound to"
    bound = scheduler_optimizer(sched)
    if bound is group.optimizer:
        return None
    kind = type(sched).__name__
    owner = next((n for n, g in groups.items() if g.optimizer is not None and g.optimizer is bound), None)
    if owner is not None:
        return (
            f"the scheduler of group `{name}` is bound to the optimizer of group `{owner}`; give each group a "
            "scheduler built on its own optimizer"
        )
    if bound is None:
        return (
            f"the scheduler of group `{name}` ({kind}) has no `optimizer` attribute; give an LR scheduler built on "
            f"group `{name}`'s optimizer"
        )
    return (
        f"the scheduler of group `{name}` ({kind}) is bound to a {type(bound).__name__} that is not group "
        f"`{name}`'s optimizer; build it on that optimizer"
    )
