"""The :class:`gradroute.Router` constructor's options, checked and grouped: those of routing
(:class:`RoutingOptions`) and those of the training step (:func:`make_stepper`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._accelerate import AcceleratorLink, adopt_prepared, link_accelerator
from ._autotune import Autotune
from ._group import Group
from ._options import PlanOptions
from ._step import Stepper


@dataclass(frozen=True)
class RoutingOptions:
    """How a router routes, checked.

    Attributes:
        plan: the planner's settings (``plan_options``).
        autotune: the measured choice's settings; None: off.
        static_every: under ``static_graph``, every how many backwards the whole graph is walked and checked;
            0: no promise (every backward walks).
        allow_unreached: the groups whose loss may reach none of their parameters.
    """

    plan: PlanOptions
    autotune: Autotune | None
    static_every: int
    allow_unreached: frozenset[str]

    @classmethod
    def check(
        cls, groups: Mapping[str, Group], *, allow_unreached: Any, plan_options: Any, autotune: Any, static_graph: Any
    ) -> RoutingOptions:
        """The options as given to ``Router`` (for ``groups``); TypeError/ValueError naming what was received."""
        allowed = _check_allow_unreached(allow_unreached, groups)
        if plan_options is None:
            plan_options = PlanOptions()
        elif not isinstance(plan_options, PlanOptions):
            raise TypeError(f"`plan_options` must be a gradroute.PlanOptions, got {type(plan_options).__name__}")
        if isinstance(autotune, bool):
            settings = Autotune() if autotune else None
        elif isinstance(autotune, Autotune):
            settings = autotune
        else:
            raise TypeError(f"`autotune` must be a bool or a gradroute.Autotune, got {type(autotune).__name__}")
        return cls(plan_options, settings, _check_static_graph(static_graph), frozenset(allowed))


def make_stepper(
    groups: Mapping[str, Group],
    *,
    scaler: Any,
    accumulate: Any,
    skip_nonfinite: Any,
    atomic_step: Any,
    accelerator: Any,
) -> tuple[AcceleratorLink | None, Stepper]:
    """The training step of ``groups`` (the router's own copies: an Accelerate-prepared optimizer in one is replaced
    by the torch optimizer inside), and the link to ``accelerator`` (None without one), whose ``scaler`` and
    accumulation window the step then uses; each option checked (ValueError/TypeError)."""
    link = link_accelerator(accelerator, scaler=scaler, accumulate=accumulate)
    if link is not None:
        scaler = link.scaler
    adopt_prepared(groups, link)
    stepper = Stepper(
        groups,
        scaler=scaler,
        accumulate=accumulate,
        skip_nonfinite=skip_nonfinite,
        atomic_step=atomic_step,
        window=link,
    )
    return link, stepper


def _check_static_graph(value: Any) -> int:
    """``static_graph`` as every how many backwards the whole graph is checked (0: no promise)."""
    if isinstance(value, bool):
        return 100 if value else 0
    if not isinstance(value, int):
        raise TypeError(f"`static_graph` must be a bool or an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"`static_graph` must be True, False or an int >= 1 (check every n-th backward), got {value}")
    return value


def _check_allow_unreached(value: Any, groups: Mapping[str, Group]) -> set[str]:
    """``allow_unreached`` as a set of group names; TypeError/ValueError naming what was received."""
    if isinstance(value, bool):
        return set(groups) if value else set()
    if isinstance(value, str):
        names = [value]
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        names = list(value)
    else:
        raise TypeError(
            f"`allow_unreached` must be True, False or an iterable of group names, got {type(value).__name__} "
            f"({value!r})"
        )
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"`allow_unreached` must hold group names (str), got {type(n).__name__} ({n!r})")
        if n not in groups:
            raise ValueError(f"`allow_unreached` names unknown group `{n}`; groups are: {', '.join(groups)}")
    return set(names)
