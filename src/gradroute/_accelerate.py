"""Hugging Face Accelerate: the router does what ``accelerator.backward`` does; Accelerate-prepared optimizers.

Nothing here imports ``accelerate``: the wrappers are recognised through ``sys.modules`` (no Accelerate object can
exist unless ``accelerate`` was imported), so ``import gradroute`` stays light.

NOTE [What accelerator.backward does, and what the router does instead]
``Accelerator.backward(loss)`` (accelerate 1.x) divides the loss by ``gradient_accumulation_steps`` (except under
DeepSpeed, whose engine divides itself), then runs, by setup: DeepSpeed's ``engine.backward`` (its own scaling,
accumulation boundary and ZeRO-partitioned gradients); nothing under Megatron-LM (its train step runs the
backward); ``scaler.scale(loss).backward()`` with a ``GradScaler`` (fp16); the fused backward-and-update of a
LOMO optimizer; else ``loss.backward()``. Which processes all-reduce is decided elsewhere:
``accelerator.accumulate(model)`` enters DDP's ``no_sync`` around every micro-batch but the last of a window and
sets ``sync_gradients``, which the prepared optimizer (``AcceleratedOptimizer``: steps and zeroes only when it is
True, and calls ``scaler.step`` and ``scaler.update`` itself) and scheduler (``AcceleratedScheduler``) read.

1. ``Router(..., accelerator=accelerator)`` divides every routed loss by the accelerator's
   ``gradient_accumulation_steps``, read on every backward (it is a settable property), and scales it with
   ``accelerator.scaler``: that is all Accelerate's backward does in the single-process and DDP setups
   (``distributed_type`` NO and MULTI_*).
2. It leaves DDP's switch to ``accumulate()``: DDP reads it in its forward, before the router is involved.
3. DeepSpeed, Megatron-LM, Accelerate's FSDP plugin (FSDP1 flattens parameters; neither version is tested through
   Accelerate, while ``fully_shard`` without Accelerate is: docs/distributed.md), XLA and LOMO optimizers are
   refused when the router is built, since their backward is not "divide, scale, backward"; LOMO again on every
   backward, since the optimizer may be prepared later.

NOTE [Prepared optimizers and schedulers in a Group]
1. The router steps the torch optimizer inside a prepared one (``prepared.optimizer``) with the accelerator's
   scaler and updates the scale once: ``AcceleratedOptimizer.step`` calls ``scaler.update()`` itself, so with
   one optimizer per group the scale would change once per group and iteration (PyTorch's AMP notes: once per
   iteration).
2. A prepared scheduler is kept as it is and stepped through its wrapper on real steps, so that it steps as
   Accelerate's would: once per process and real step unless ``split_batches`` (diffusers sizes its schedules
   for that).
3. Real steps are Accelerate's: ``router.step()`` steps when ``accelerator.sync_gradients`` is True (the last
   micro-batch of an ``accumulate()`` window, or the end of the data loader) and otherwise only counts the
   micro-batch.
4. Without ``accelerator=`` a prepared optimizer or scheduler is refused: the router would neither scale the
   losses with the accelerator's scaler nor know its accumulation window.

NOTE [Silent N x gradients]
``accelerator.backward`` divides by ``gradient_accumulation_steps``; a router that was not told would not,
and the gradients would be N times Accelerate's, with no error anywhere. When an Accelerator with
``gradient_accumulation_steps > 1`` exists in the process (Accelerate's ``GradientState`` is a process-wide
singleton) and the router has neither ``accelerator=`` nor ``accumulate=``, ``Router.backward`` raises. An
error rather than a warning: the result would be wrong, not slow, a warning scrolls past in a training log, and
the fix is one keyword.
"""

from __future__ import annotations

import sys
from typing import Any

#: Accelerate's ``DistributedType`` values whose backward is "divide, scale, ``loss.backward()``" (DDP or one
#: process).
_SUPPORTED = frozenset(
    {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU"}
)

_WHY_NOT = {
    "DEEPSPEED": "DeepSpeed's engine runs the backward itself (its own loss scaling, accumulation boundary and "
    "ZeRO-partitioned gradients), so routed engine calls cannot stand in for it",
    "MEGATRON_LM": "Megatron-LM's train step runs the backward itself",
    "FSDP": "Accelerate's FSDP plugin is not supported (FSDP1 flattens the parameters; FSDP2 through Accelerate "
    "is untested); FSDP2's fully_shard used directly works, see docs/distributed.md",
    "XLA": "XLA devices are not tested with gradroute",
}


def _accelerate_class(module: str, name: str) -> type | None:
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def prepared_optimizer(opt: Any) -> Any:
    """The torch optimizer inside an Accelerate ``AcceleratedOptimizer``; None if ``opt`` is not one."""
    cls = _accelerate_class("accelerate.optimizer", "AcceleratedOptimizer")
    wrapper: Any = opt
    return wrapper.optimizer if cls is not None and isinstance(opt, cls) else None


def is_prepared_scheduler(sched: Any) -> bool:
    """Whether ``sched`` is an Accelerate ``AcceleratedScheduler``."""
    cls = _accelerate_class("accelerate.scheduler", "AcceleratedScheduler")
    return cls is not None and isinstance(sched, cls)


def scheduler_optimizer(sched: Any) -> Any:
    """The torch optimizer a scheduler is bound to, looking through Accelerate's wrappers; None if it has none."""
    if is_prepared_scheduler(sched):
        sched = sched.scheduler
    bound = getattr(sched, "optimizer", None)
    inner = prepared_optimizer(bound)
    return bound if inner is None else inner


def prepared_refusal(group: str, what: str, obj: Any) -> str:
    """The message refusing an Accelerate-prepared ``optimizer``/``scheduler`` given without ``accelerator=``."""
    inner = "optimizer.optimizer" if what == "optimizer" else "scheduler.scheduler"
    return (
        f"the `{what}` of group `{group}` was prepared by Accelerate ({type(obj).__name__}): pass the "
        "accelerator too, Router(..., accelerator=accelerator), and the router scales, accumulates and steps it "
        f"as Accelerate would; or give the torch {what} inside it (`{inner}`) and the router's own `scaler=` "
        f"and `accumulate=`; or leave `{what}` unset and step the prepared {what} yourself"
    )


def accelerate_accumulation_steps() -> int:
    """``gradient_accumulation_steps`` of the Accelerator in this process; 1 if there is none.

    Reads Accelerate's process-wide ``GradientState`` without creating it (``GradientState()`` would).
    """
    cls = _accelerate_class("accelerate.state", "GradientState")
    shared = getattr(cls, "_shared_state", None)
    if not shared:
        return 1
    kwargs = shared.get("plugin_kwargs") or {}
    steps = kwargs.get("num_steps", 1)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else 1


def unannounced_accumulation_message(steps: int) -> str:
    return (
        f"an Accelerator with gradient_accumulation_steps={steps} is active, but this Router does not know it: "
        "accelerator.backward(loss) divides every loss by that number and router.backward would not (the "
        f"gradients would be {steps}x Accelerate's). Build the router with Router(..., accelerator=accelerator) "
        f"(it then does what accelerator.backward does), or with Router(..., accumulate={steps}) and call "
        "router.step() once per micro-batch"
    )


class AcceleratorLink:
    """What :class:`gradroute.Router` reads from an ``accelerate.Accelerator`` (see the module notes).

    Args:
        accelerator: the ``Accelerator`` of the training script.

    Raises:
        TypeError: not an Accelerator.
        ValueError: a setup whose backward the router cannot stand in for (DeepSpeed, Megatron-LM, FSDP, XLA,
            a LOMO optimizer).
    """

    def __init__(self, accelerator: Any) -> None:
        lacking = [
            a
            for a in ("backward", "gradient_accumulation_steps", "sync_gradients", "distributed_type", "scaler")
            if not hasattr(accelerator, a)
        ]
        if lacking:
            raise TypeError(
                f"`accelerator` must be an accelerate.Accelerator, got {type(accelerator).__name__} "
                f"(it has no {', '.join(lacking)})"
            )
        self.accelerator = accelerator
        self.check()

    def check(self) -> None:
        """Refuse what the router cannot do the way ``accelerator.backward`` does it (before anything is touched)."""
        acc = self.accelerator
        kind = str(getattr(acc.distributed_type, "value", acc.distributed_type))
        if kind not in _SUPPORTED:
            why = _WHY_NOT.get(kind, "gradroute supports Accelerate's single-process and DDP setups only")
            raise ValueError(
                f"`accelerator` uses distributed_type {kind}: {why}. Router(accelerator=...) supports one process "
                "and DDP (`accelerate launch --multi_gpu`, or ACCELERATE_USE_CPU=true on the CPU)"
            )
        if getattr(acc, "has_lomo_optimizer", False):
            raise ValueError(
                "`accelerator` holds a LOMO optimizer, which updates the parameters inside its own fused "
                "backward; gradroute cannot route into it"
            )

    @property
    def scaler(self) -> Any:
        """``accelerator.scaler``: a GradScaler under fp16 on a GPU, else None."""
        return self.accelerator.scaler

    def divisor(self) -> int:
        """What ``accelerator.backward`` divides a loss by: ``gradient_accumulation_steps``, read now."""
        steps = self.accelerator.gradient_accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`accelerator.gradient_accumulation_steps` must be an int >= 1, got {steps!r}")
        return steps

    def sync(self) -> bool:
        """``accelerator.sync_gradients``: whether this micro-batch ends an accumulation window."""
        return bool(self.accelerator.sync_gradients)


def adopt_prepared(groups: Any, link: AcceleratorLink | None) -> None:
    """Give each ``Group`` (``name -> Group``) with an Accelerate-prepared optimizer the torch optimizer inside.

    The router then steps it with the accelerator's scaler and updates the scale once per iteration; a prepared
    scheduler stays as it is (stepped through its wrapper). Without ``link`` both are refused (ValueError).
    """
    for name, g in groups.items():
        inner = prepared_optimizer(g.optimizer)
        if link is None:
            if inner is not None:
                raise ValueError(prepared_refusal(name, "optimizer", g.optimizer))
            if is_prepared_scheduler(g.scheduler):
                raise ValueError(prepared_refusal(name, "scheduler", g.scheduler))
        elif inner is not None:
            g.optimizer = inner


def check_backward(link: AcceleratorLink | None, accumulate: int) -> None:
    """Before a routed backward: the accelerator's setup still fits; no Accelerate accumulation unannounced."""
    if link is not None:
        link.check()
        return
    if accumulate == 1:
        steps = accelerate_accumulation_steps()
        if steps > 1:
            raise ValueError(unannounced_accumulation_message(steps))


def link_accelerator(accelerator: Any, *, scaler: Any, accumulate: Any) -> AcceleratorLink | None:
    """``Router(accelerator=...)``: the link, or None; ``scaler=``/``accumulate=`` given as well are refused."""
    if accelerator is None:
        return None
    link = AcceleratorLink(accelerator)
    if scaler is not None:
        raise ValueError(
            "`scaler` comes from the accelerator (accelerator.scaler) when `accelerator` is given; leave `scaler` "
            f"unset (got a {type(scaler).__name__})"
        )
    if isinstance(accumulate, bool) or accumulate != 1:
        raise ValueError(
            "`accumulate` comes from the accelerator (Accelerator(gradient_accumulation_steps=N) and "
            f"accelerator.accumulate()) when `accelerator` is given; leave `accumulate` unset (got {accumulate!r})"
        )
    return link
