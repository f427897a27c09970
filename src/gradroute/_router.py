"""`Router`: named parameter groups, and exact routed gradients from one forward pass."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ._accelerate import check_backward
from ._autotune import Autotune
from ._group import Group, GroupLike
from ._loss_checks import merge_named
from ._options import PlanOptions
from ._planner import Plan
from ._router_options import RoutingOptions, make_stepper
from ._routing import LossLike, Routing
from ._step import StepStats
from ._types import GraphCounts


class Router:
    """Routes each loss to its own parameter group: exact gradients from one forward, without ``retain_graph``.

    After ``router.backward(a=loss_a, b=loss_b)``, every parameter ``p`` of group ``a`` has
    ``p.grad += d loss_a / d p``, exactly what a separate forward and backward of ``loss_a`` alone would give.
    Parameters the loss does not reach, and groups not named in the call, are untouched. A parameter in
    several groups receives the sum of their losses' gradients.

    The plan (which engine calls, with which ``inputs=``, which retain, in which order) is made from the
    autograd graph of the losses on every call; see :meth:`plan`.

    Args:
        groups: ``name -> group`` (an ``nn.Module``, an iterable of parameters or a :class:`Group`). Names may
            also be given as keyword arguments.
        scaler: a ``torch.amp.GradScaler`` shared by all groups (see :meth:`step`).
        accumulate: micro-batches per optimizer step (see :meth:`step`).
        allow_unreached: by default a loss that reaches none of its group's parameters is an error (almost
            always a stray ``.detach()``). ``True`` allows it for every group, or give the group names.
        plan_options: the planner's settings (:class:`gradroute.PlanOptions`); the defaults suit most graphs.
        accelerator: an ``accelerate.Accelerator``: each loss is then divided and scaled as
            ``accelerator.backward`` does, groups may hold its prepared objects, and :meth:`step` steps when
            ``accelerator.sync_gradients`` is True; ``scaler`` and ``accumulate`` come from it
            (docs/integrations.md).
        skip_nonfinite: without an enabled scaler, a group whose gradient norm is inf/NaN is not stepped
            (``skip_reason="nonfinite"``; with fused optimizers on the device, without a host sync). ``False``
            (the default): torch's behaviour, every group is stepped; an enabled scaler skips either way.
        atomic_step: ``True``: a failed :meth:`step` is undone without copies, except an exception inside an
            optimizer's or scheduler's own ``step()``; ``"copy"`` undoes that too, at about 4x the parameters'
            bytes more memory during the step; ``False``: no undo (docs/training_step.md).
        autotune: time the candidate plans of each new graph with shared ``gradroute.checkpoint`` segments on
            its first backwards and keep the fastest (:class:`gradroute.Autotune`); ``False``: ``plan_options``.
        static_graph: promise that the graph has the same structure on every backward, as DDP's
            ``static_graph``: backwards then follow recorded paths instead of walking the graph, which is
            checked whole every 100th backward (an int ``n``: every ``n``-th). Not under DDP or FSDP2
            (docs/static_graphs.md, :attr:`graph_counts`).
        **named_groups: groups by keyword.

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> router = gradroute.Router(tenc=tenc, unet=unet)
        >>> x, target, mask = torch.randn(8, 4), torch.randn(8, 4), torch.rand(8, 4) > 0.5
        >>> loss = torch.nn.functional.mse_loss(unet(tenc(x)), target, reduction="none")
        >>> router.backward(tenc=loss.mean(), unet=(loss * mask).mean())
        >>> tenc.weight.grad.shape, unet.weight.grad.shape
        (torch.Size([4, 4]), torch.Size([4, 4]))
    """

    def __init__(
        self,
        groups: Mapping[str, GroupLike] | None = None,
        /,
        *,
        scaler: Any = None,
        accumulate: int = 1,
        allow_unreached: bool | Iterable[str] = False,
        plan_options: PlanOptions | None = None,
        skip_nonfinite: bool = False,
        atomic_step: bool | str = True,
        accelerator: Any = None,
        autotune: bool | Autotune = True,
        static_graph: bool | int = False,
        **named_groups: GroupLike,
    ) -> None:
        specs = merge_named(groups, named_groups, "groups", "group", "name -> group", "Router")
        if not specs:
            raise ValueError("`Router` needs at least one group, e.g. Router(tenc=text_encoder, unet=unet)")
        self._groups = {name: _own_group(name, spec) for name, spec in specs.items()}
        self._routing = routing = RoutingOptions.check(
            self._groups,
            allow_unreached=allow_unreached,
            plan_options=plan_options,
            autotune=autotune,
            static_graph=static_graph,
        )
        self._accelerator, self._stepper = make_stepper(
            self._groups,
            scaler=scaler,
            accumulate=accumulate,
            skip_nonfinite=skip_nonfinite,
            atomic_step=atomic_step,
            accelerator=accelerator,
        )
        self._run = Routing(self._groups, routing, self._stepper.distributed)

    # ------------------------------------------------------------------ public API

    @property
    def plan_options(self) -> PlanOptions:
        """The planner's settings this router was built with."""
        return self._routing.plan

    @property
    def autotune(self) -> Autotune | None:
        """The measured choice's settings, or None when it is off."""
        return self._routing.autotune

    @property
    def autotuning(self) -> bool:
        """Whether the plans of some graph seen are still being measured (the next backward may be a trial)."""
        return self._run.measuring

    @property
    def groups(self) -> Mapping[str, Group]:
        """The groups, by name."""
        return dict(self._groups)

    @property
    def graph_counts(self) -> GraphCounts:
        """How this router's routed backwards met their graphs so far (:class:`gradroute.GraphCounts`)."""
        return self._run.counts()

    def backward(self, losses: Mapping[str, LossLike] | None = None, /, **named_losses: LossLike) -> None:
        """Accumulate each loss's gradient into its own group's ``.grad`` (exact, one forward, no retain).

        Args:
            losses: ``group name -> loss``; a loss is a scalar tensor or a list of scalar tensors (summed).
            **named_losses: the same, by keyword.

        With a ``scaler`` or ``accumulate > 1`` each loss is divided by ``accumulate`` and scaled first.
        :meth:`step` closes a micro-batch: call it once per micro-batch, after that micro-batch's
        ``backward`` call(s); it steps the optimizers on every ``accumulate``-th call.

        A parameter's hooks (DDP's and FSDP's included) fire once per backward; a hook on an intermediate
        tensor runs once per routed pass that reaches it, and once more with a zero gradient where a pass is cut
        there, so hooks that scale, negate or clip stay exact.

        Raises:
            ValueError, TypeError: a bad loss or group name, a loss that is not a real floating-point scalar;
                raised before any ``.grad`` is touched.
            gradroute.GraphFreedError: the graph of a loss (or a part it shares with the others) was freed
                by an earlier backward; every ``.grad`` is then as it was.
        """
        check_backward(self._accelerator, self._stepper.accumulate)
        original = self._run.routes(losses, named_losses, "backward")
        routes = self._stepper.before_backward(original)
        self._run.backward(original, routes)
        self._stepper.after_backward(routes)

    def grads(
        self, losses: Mapping[str, LossLike] | None = None, /, **named_losses: LossLike
    ) -> dict[str, tuple[torch.Tensor | None, ...]]:
        """The routed gradients, returned instead of accumulated; ``.grad`` is untouched.

        Returns:
            ``group name -> tuple`` of ``d loss / d p`` for the group's parameters in order (``None`` for a
            parameter the loss does not reach). No scaling is applied.
        """
        return self._run.grads(self._run.routes(losses, named_losses, "grads"))

    def plan(self, losses: Mapping[str, LossLike] | None = None, /, **named_losses: LossLike) -> Plan:
        """What :meth:`backward` would do with these losses; nothing is run. ``print(plan)`` shows a table."""
        return self._run.plan(self._run.routes(losses, named_losses, "plan"))

    def step(self) -> StepStats:
        """Close a micro-batch; on every ``accumulate``-th call, step every group's optimizer and scheduler.

        A real step follows PyTorch's AMP notes for several optimizers: ``unscale_`` per optimizer, every
        ``grad_hook``, clipping per group, ``scaler.step`` per optimizer (inf/NaN skips only that group), ONE
        ``scaler.update()``, the schedulers, ``.grad = None`` (the order and the skipped schedules:
        docs/training_step.md). The other calls only count the micro-batch.

        Returns:
            :class:`gradroute.StepStats`: ``group name -> GroupStats`` (``loss``, unscaled and averaged over
            the micro-batches; ``grad_norm`` of the unscaled gradients before clipping; ``lr`` this step
            used, read before the scheduler steps; ``skipped``), and ``accumulating`` (``True`` on a
            micro-step), ``micro_step``, ``step`` and ``scale``.

        A step that raises (a ``grad_hook``, a bad value, Ctrl-C) leaves everything as before the call, as
        ``atomic_step`` says; ``step()`` again retries it, ``zero_grad()`` drops it. With fused optimizers it
        makes no host sync: the statistics stay tensors until read.

        Raises:
            RuntimeError: no :meth:`backward` since the last ``step()``; a group without ``optimizer``; an
                optimizer or scheduler changed to not match its group since construction; the scaler already
                unscaled or stepped one of the optimizers. Checked before anything is touched.
            ValueError: float16 gradients with an enabled scaler (before anything is touched).

        Examples:
            >>> import torch, gradroute
            >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            >>> opt_t, opt_u = torch.optim.AdamW(tenc.parameters()), torch.optim.AdamW(unet.parameters())
            >>> router = gradroute.Router(
            ...     tenc=gradroute.Group(tenc, optimizer=opt_t, max_grad_norm=1.0),
            ...     unet=gradroute.Group(unet, optimizer=opt_u),
            ...     accumulate=2,
            ... )
            >>> for _ in range(2):
            ...     loss = unet(tenc(torch.randn(8, 4))).pow(2)
            ...     router.backward(tenc=loss.mean(), unet=loss[:4].mean())
            ...     stats = router.step()
            >>> stats.accumulating, stats.step, stats["tenc"].skipped
            (False, 1, False)
        """
        return self._stepper.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or set to None) every group's gradients, and drop the accumulation window.

        :meth:`step` already sets the gradients to None after every real step; calling ``zero_grad()`` between
        the micro-batches of an accumulation window discards them (the window restarts).
        """
        self._stepper.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Optimizers, schedulers, scaler and accumulation counter, for resuming (model weights not included).

        Saved inside an accumulation window (or between :meth:`backward` and :meth:`step`), it also holds the
        accumulated gradients, so a resumed run takes the same steps. Loadable with ``torch.load(...,
        weights_only=True)``.
        """
        return self._stepper.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, into a Router built the same way.

        It may be taken at any point of the loop (after :meth:`backward`, inside an accumulation window, after
        :meth:`step`): the resumed run continues bit-identically, reported losses included.

        Raises:
            ValueError, TypeError: the state does not match this Router (keys, groups, sizes, optimizer states,
                gradients, scaler, window), checked before anything is loaded; the error names the key. If an
                optimizer or scheduler still refuses its state half-way, what was loaded is undone.
        """
        self._stepper.load_state_dict(state_dict)

    def __repr__(self) -> str:
        parts = [f"{n}={len(g.params)} params" for n, g in self._groups.items()]
        return f"Router({', '.join(parts)})"


def _own_group(name: Any, spec: GroupLike) -> Group:
    """Group ``name`` of the router: its own copy of a caller's Group (which is never changed: a Group may be in
    several routers), or a new Group of a module or of parameters."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"group names must be non-empty strings, got {name!r}")
    group = copy.copy(spec) if isinstance(spec, Group) else Group(spec, name=name)
    group.name = name
    return group
