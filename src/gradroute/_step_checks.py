"""The training step's argument checks: every one runs before anything is touched, and names what it got.

Construction (``accumulate``, ``scaler``, the groups' optimizers and schedulers), each ``step()`` (optimizers
still bound, the scaler not used behind the router's back, gradients GradScaler can unscale) and
``load_state_dict`` (every key, group name, window size, and the saved optimizer states against the
parameters they will be applied to). A check raises ``TypeError``/``ValueError`` (``RuntimeError`` for
calls in the wrong order or state changed since construction) and changes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from ._group import Group, describe_param, optimizer_mismatch, scheduler_mismatch
from ._scaler import Scaler

#: What ``Router.state_dict()`` writes; format 1 stored the window's losses as Python floats.
STATE_FORMAT = "gradroute.Router.state_dict/2"
_OLD_FORMATS = ("gradroute.Router.state_dict/1",)
STATE_KEYS = (
    "format",
    "accumulate",
    "micro_step",
    "steps",
    "backward_pending",
    "losses",
    "grads",
    "optimizers",
    "schedulers",
    "scaler",
)
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def check_accumulate(accumulate: Any) -> int:
    if isinstance(accumulate, bool):
        raise TypeError(f"`accumulate` must be an int >= 1, got bool ({accumulate!r})")
    try:
        n = operator.index(accumulate)
    except TypeError:
        raise TypeError(f"`accumulate` must be an int >= 1, got {type(accumulate).__name__} ({accumulate!r})") from None
    if n < 1:
        raise ValueError(f"`accumulate` must be >= 1, got {accumulate!r}")
    return n


def check_flag(value: Any, arg: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{arg}` must be True or False, got {type(value).__name__} ({value!r})")
    return value


def check_atomic_step(value: Any) -> bool | str:
    """``True`` (by ordering, the default), ``"copy"`` (full copies) or ``False`` (no undo of the groups)."""
    if isinstance(value, bool) or value == "copy":
        return value  # type: ignore[no-any-return]
    if isinstance(value, str):
        raise ValueError(f"`atomic_step` must be True, False or 'copy', got {value!r}")
    raise TypeError(f"`atomic_step` must be True, False or 'copy', got {type(value).__name__} ({value!r})")


_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale", "is_enabled", "state_dict", "load_state_dict")


def check_scaler(scaler: Any) -> Any:
    if scaler is None:
        return None
    lacking = [m for m in _SCALER_METHODS if not callable(getattr(scaler, m, None))]
    if lacking:
        raise TypeError(
            f"`scaler` must be a torch.amp.GradScaler or None, got {type(scaler).__name__} "
            f"(it has no {', '.join(lacking)})"
        )
    return scaler


def check_step_parts(groups: Mapping[str, Group]) -> None:
    """Optimizers own exactly their group's parameters, schedulers are bound to them; ValueError otherwise."""
    owner: dict[int, str] = {}
    for name, g in groups.items():
        if g.optimizer is not None:
            for m in ("step", "zero_grad", "state_dict", "load_state_dict"):
                if not callable(getattr(g.optimizer, m, None)) or not hasattr(g.optimizer, "param_groups"):
                    raise TypeError(
                        f"`optimizer` of group `{name}` must be a torch.optim.Optimizer, "
                        f"got {type(g.optimizer).__name__}"
                    )
            why = optimizer_mismatch(name, groups)
            if why:
                raise ValueError(why)
            for p in g.params:
                other = owner.setdefault(id(p), name)
                if other != name:
                    raise ValueError(
                        f"{describe_param(p, groups)} is in groups `{other}` and `{name}`, which both have "
                        "an optimizer: it would be unscaled, clipped and stepped twice"
                    )
        if g.scheduler is not None:
            _check_scheduler(name, g, groups)


def _check_scheduler(name: str, g: Group, groups: Mapping[str, Group]) -> None:
    if isinstance(g.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            f"`scheduler` of group `{name}` is a ReduceLROnPlateau, which steps on a metric: leave "
            "`scheduler` unset and call its step(metric) yourself"
        )
    for m in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(g.scheduler, m, None)):
            raise TypeError(
                f"`scheduler` of group `{name}` must be a torch LRScheduler, got {type(g.scheduler).__name__}"
            )
    why = scheduler_mismatch(name, groups)
    if why:
        raise ValueError(why)


# ---------------------------------------------------------------------- every step()


def check_configured(groups: Mapping[str, Group]) -> None:
    """Every group has an optimizer, still bound as at construction; RuntimeError otherwise."""
    missing = [n for n, g in groups.items() if g.optimizer is None]
    if missing:
        raise RuntimeError(
            f"`step()` needs an optimizer for every group; group `{missing[0]}` has none "
            f"(give it: Router({missing[0]}=gradroute.Group(module, optimizer=...)), or step the "
            "optimizers yourself and do not call router.step())"
        )
    for name in groups:
        why = optimizer_mismatch(name, groups) or scheduler_mismatch(name, groups)
        if why:
            raise RuntimeError(f"{why}; it changed after the Router was built")


def check_gradients(active: Mapping[str, Group], groups: Mapping[str, Group], scaler: Scaler) -> None:
    """With an enabled scaler: no optimizer already unscaled/stepped by hand, no float16 gradient."""
    if not scaler.enabled:
        return
    for name, g in active.items():
        stage = scaler.used_stage(g.optimizer)
        if stage is not None:
            raise RuntimeError(
                f"the scaler was already used on group `{name}`'s optimizer since its last update() "
                f"(stage {stage}): router.step() unscales and steps every optimizer "
                "itself; do not call scaler.unscale_/scaler.step on them"
            )
        for p in g.params:
            if p.grad is not None and p.grad.dtype == torch.float16:
                raise ValueError(
                    f"{describe_param(p, groups)} of group `{name}` has float16 gradients, which "
                    "GradScaler cannot unscale: keep the parameters in float32 and compute in float16 "
                    "with torch.autocast"
                )


# ---------------------------------------------------------------------- load_state_dict


def check_state_dict(
    sd: Any, groups: Mapping[str, Group], scaler: Scaler, accumulate: int, *, window: int | None = None
) -> Mapping[str, Any]:
    """``sd`` as :meth:`Router.load_state_dict` may load it, or the first thing that does not fit (``window``:
    micro-batches per real step when an accelerator decides it, else ``accumulate``)."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"`state_dict` must be a mapping from Router.state_dict(), got {type(sd).__name__}")
    fmt = sd.get("format")
    if fmt != STATE_FORMAT and fmt not in _OLD_FORMATS:
        raise ValueError(f"`state_dict` is not from Router.state_dict() (format {fmt!r}, expected {STATE_FORMAT!r})")
    missing = [k for k in STATE_KEYS if k not in sd]
    if missing:
        raise ValueError(f"`state_dict` has no key {missing[0]!r} (keys found: {sorted(map(str, sd))})")
    _check_counters(sd, accumulate, accumulate if window is None else window)
    for kind, attr in (("optimizers", "optimizer"), ("schedulers", "scheduler")):
        _check_names(sd, kind, {n for n, g in groups.items() if getattr(g, attr) is not None})
    for name in sorted(sd["optimizers"]):
        _check_optimizer_state(name, sd["optimizers"][name], groups[name])
    for name in sorted(sd["schedulers"]):
        if not isinstance(sd["schedulers"][name], Mapping):
            raise TypeError(
                f"`state_dict['schedulers'][{name!r}]` must be a mapping, got {type(sd['schedulers'][name]).__name__}"
            )
    _check_scaler_state(sd["scaler"], scaler)
    _check_losses(sd["losses"], groups)
    _check_grads(sd["grads"], groups)
    return sd


def _check_counters(sd: Mapping[str, Any], accumulate: int, window: int) -> None:
    for key in ("accumulate", "micro_step", "steps"):
        v = sd[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "accumulate" else 0):
            raise ValueError(f"`state_dict[{key!r}]` must be a non-negative int, got {v!r}")
    if not isinstance(sd["backward_pending"], bool):
        raise TypeError(f"`state_dict['backward_pending']` must be a bool, got {sd['backward_pending']!r}")
    micro = sd["micro_step"]
    if micro >= window:
        raise ValueError(
            f"`state_dict` was saved at micro-batch {micro!r} of an accumulation window of "
            f"{sd['accumulate']}; this Router has accumulate={accumulate}"
        )
    if sd["accumulate"] != accumulate and (micro or sd["backward_pending"]):
        raise ValueError(
            f"`state_dict` was saved inside an accumulation window of {sd['accumulate']} micro-batches; "
            f"this Router has accumulate={accumulate}"
        )


def _check_names(sd: Mapping[str, Any], kind: str, have: set[str]) -> None:
    saved = sd[kind]
    if not isinstance(saved, Mapping):
        raise TypeError(f"`state_dict[{kind!r}]` must be a mapping of group name -> state, got {type(saved).__name__}")
    if have != set(saved):
        raise ValueError(f"`state_dict` has {kind} for groups {sorted(saved)}, this Router for groups {sorted(have)}")


def _check_optimizer_state(name: str, saved: Any, g: Group) -> None:
    """Parameter-group sizes, then every saved state tensor against the parameter it will be applied to."""
    where = f"state_dict['optimizers'][{name!r}]"
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        raise ValueError(f"`{where}` must be an optimizer state_dict (with 'state' and 'param_groups')")
    opt = g.optimizer
    assert opt is not None  # the names were checked against the groups with an optimizer
    sizes = [len(pg["params"]) for pg in saved["param_groups"]]
    mine = [len(pg["params"]) for pg in opt.param_groups]
    if sizes != mine:
        raise ValueError(
            f"the saved optimizer of group `{name}` has parameter groups of sizes {sizes}, this one {mine}"
        )
    index = {
        k: p
        for spg, pg in zip(saved["param_groups"], opt.param_groups, strict=True)
        for k, p in zip(spg["params"], pg["params"], strict=True)
    }
    for k, state in saved["state"].items():
        p = index.get(k)
        if p is None:
            raise ValueError(f"`{where}` has state for parameter index {k!r}, which none of its param_groups lists")
        for key, t in state.items() if isinstance(state, Mapping) else ():
            if isinstance(t, torch.Tensor) and _state_mismatch(t, p):
                raise ValueError(
                    f"`{where}['state'][{k!r}][{key!r}]` has shape {tuple(t.shape)} and dtype {t.dtype}, but the "
                    f"parameter it belongs to, {describe_param(p, {name: g})}, has shape {tuple(p.shape)} and "
                    f"dtype {p.dtype}"
                )


def _state_mismatch(t: torch.Tensor, p: torch.Tensor) -> bool:
    """A per-element state tensor (ndim of the parameter's or more) of another shape or kind of dtype.

    Scalars (``step``) and lower-rank factored statistics (Adafactor's row/column variances) are left alone;
    floating state of another float width is allowed (torch's optimizers cast it on load).
    """
    if t.dim() == 0 or t.dim() < p.dim():
        return False
    if tuple(t.shape) != tuple(p.shape):
        return True
    return t.is_complex() != p.is_complex() or t.is_floating_point() != p.is_floating_point()


def _check_scaler_state(saved: Any, scaler: Scaler) -> None:
    if scaler.enabled and not saved:
        raise ValueError("`state_dict` was saved without an enabled scaler; this Router's scaler is enabled")
    if scaler.scaler is None and saved:
        raise ValueError("`state_dict` holds a scaler's state; this Router has no `scaler`")
    if scaler.enabled:
        if not isinstance(saved, Mapping):
            raise TypeError(f"`state_dict['scaler']` must be a GradScaler state_dict, got {type(saved).__name__}")
        lacking = [k for k in _SCALER_KEYS if k not in saved]
        if lacking:
            raise ValueError(f"`state_dict['scaler']` has no key {lacking[0]!r} (keys found: {sorted(saved)})")


def _check_losses(saved: Any, groups: Mapping[str, Group]) -> None:
    if not isinstance(saved, Mapping):
        raise TypeError(f"`state_dict['losses']` must be a mapping of group name -> loss, got {type(saved).__name__}")
    unknown = set(saved) - set(groups)
    if unknown:
        raise ValueError(f"`state_dict` has losses for unknown groups {sorted(unknown)}")
    for name, v in saved.items():
        ok = isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()
        if not ok and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise TypeError(f"`state_dict['losses'][{name!r}]` must be a scalar float tensor, got {v!r}")


def _check_grads(saved: Any, groups: Mapping[str, Group]) -> None:
    if saved is None:
        return
    if not isinstance(saved, Mapping):
        raise TypeError(f"`state_dict['grads']` must be None or a mapping, got {type(saved).__name__}")
    for name, grads in saved.items():
        g = groups.get(name)
        if g is None or not isinstance(grads, (list, tuple)) or len(grads) != len(g.params):
            raise ValueError(f"`state_dict` has gradients for group `{name}` that do not match this Router")
        for k, (t, p) in enumerate(zip(grads, g.params, strict=True)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                got = f"shape {tuple(t.shape)}, {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"`state_dict` gradient {k} of group `{name}` has {got}, the parameter "
                    f"shape {tuple(p.shape)}, {p.dtype}"
                )
