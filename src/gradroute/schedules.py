"""Learning-rate schedules: :func:`warmup_power`, linear warmup then polynomial decay.

A schedule here is a plain ``torch.optim.lr_scheduler.LambdaLR``: step it once per optimizer step (a
:class:`gradroute.Group` with ``scheduler=`` does that for you), save and load it with its ``state_dict``.

Without a floor or jitter it equals torch's ``SequentialLR([LinearLR(opt, 1 / warmup, 1, warmup - 1),
PolynomialLR(opt, total - warmup, exponent)], [warmup])``, and after the warmup transformers'
``get_polynomial_decay_schedule_with_warmup`` (whose warmup spends its first step at learning rate 0). What
neither does: the seeded multiplicative jitter (``random=``, a pure function of the step, so a resumed run
follows the same schedule), and, for torch, a floor above 0 (``min_lr_ratio``), in one scheduler without
transformers.
"""

from __future__ import annotations

import math
import random as _random

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["warmup_power"]

#: Jitter amplitude used for ``random=True``.
DEFAULT_JITTER = 0.1


def warmup_power(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    exponent: float,
    total_steps: int,
    *,
    min_lr_ratio: float = 0.0,
    random: bool | float = False,
    seed: int = 0,
    last_epoch: int = -1,
) -> LambdaLR:
    """Linear warmup, then ``(1 - progress) ** exponent`` decay to ``min_lr_ratio`` of the base lr.

    The learning rate of every parameter group is ``base_lr * factor(s)``, where ``s`` counts scheduler steps
    (0 before the first ``scheduler.step()``, i.e. during the first optimizer step) and

    * warmup, ``s < warmup_steps``: ``factor = (s + 1) / warmup_steps`` (the first step already trains, at
      ``base_lr / warmup_steps``; the last warmup step runs at ``base_lr``);
    * decay, ``warmup_steps <= s < total_steps``: with ``progress = (s - warmup_steps) / (total_steps -
      warmup_steps)``, ``factor = min_lr_ratio + (1 - min_lr_ratio) * (1 - progress) ** exponent``;
    * after, ``s >= total_steps``: ``factor = min_lr_ratio``.

    With ``random`` the factor is multiplied by ``1 + a * u``, where ``a`` is the jitter amplitude
    (``random=True`` means ``a = 0.1``; a float gives ``a`` itself, in ``[0, 1)``) and ``u`` is uniform in
    ``[-1, 1]``, drawn from a generator seeded with ``(seed, s)``. The jitter is a pure function of the step,
    so a resumed run follows the same schedule, and it does not touch Python's or torch's global RNG.

    This is our equivalent of the ``custom_scheduler(optimizer, warmup_steps=30, exponent=5, random=False)``
    of the two-network training loop in the README.

    Args:
        optimizer: the optimizer whose learning rates are scheduled.
        warmup_steps: steps of linear warmup (``0`` for none).
        exponent: power of the decay; ``1`` is linear, ``0`` keeps ``base_lr`` after warmup.
        total_steps: step at which the decay reaches ``min_lr_ratio``; at least ``warmup_steps``.
        min_lr_ratio: the final learning rate as a fraction of ``base_lr``, in ``[0, 1]``.
        random: multiplicative jitter: ``False`` (none), ``True`` (amplitude 0.1) or an amplitude in
            ``[0, 1)``.
        seed: seeds the jitter.
        last_epoch: as in every torch scheduler (``-1`` starts from scratch).

    Returns:
        A ``LambdaLR``; its ``state_dict`` holds the schedule's settings.

    Examples:
        >>> import torch
        >>> from gradroute.schedules import warmup_power
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = warmup_power(opt, warmup_steps=2, exponent=2, total_steps=4)
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(opt.param_groups[0]["lr"])
        ...     opt.step()
        ...     sched.step()
        >>> lrs
        [0.5, 1.0, 1.0, 0.25, 0.0]
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    lam = _WarmupPower(
        warmup_steps=_int_arg("warmup_steps", warmup_steps, 0),
        exponent=_float_arg("exponent", exponent),
        total_steps=_int_arg("total_steps", total_steps, 1),
        min_lr_ratio=_float_arg("min_lr_ratio", min_lr_ratio),
        jitter=_jitter_arg(random),
        seed=_int_arg("seed", seed, None),
    )
    if lam.exponent < 0:
        raise ValueError(f"`exponent` must be >= 0, got {exponent!r}")
    if lam.total_steps < lam.warmup_steps:
        raise ValueError(f"`total_steps` ({total_steps!r}) must be at least `warmup_steps` ({warmup_steps!r})")
    if not 0.0 <= lam.min_lr_ratio <= 1.0:
        raise ValueError(f"`min_lr_ratio` must be in [0, 1], got {min_lr_ratio!r}")
    return LambdaLR(optimizer, lam, last_epoch=_int_arg("last_epoch", last_epoch, -1))


class _WarmupPower:
    """The factor of :func:`warmup_power` at step ``s`` (an object, so ``LambdaLR`` saves its fields)."""

    def __init__(
        self,
        *,
        warmup_steps: int,
        exponent: float,
        total_steps: int,
        min_lr_ratio: float,
        jitter: float,
        seed: int,
    ) -> None:
        self.warmup_steps = warmup_steps
        self.exponent = exponent
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.jitter = jitter
        self.seed = seed

    def __call__(self, s: int) -> float:
        if s < self.warmup_steps:
            factor = (s + 1) / self.warmup_steps
        elif s < self.total_steps:
            progress = (s - self.warmup_steps) / (self.total_steps - self.warmup_steps)
            factor = self.min_lr_ratio + (1.0 - self.min_lr_ratio) * (1.0 - progress) ** self.exponent
        else:
            factor = self.min_lr_ratio
        if self.jitter:
            # A string seed is hashed with SHA-512: the same on every run and platform, and independent of
            # PYTHONHASHSEED.
            u = _random.Random(f"gradroute.warmup_power:{self.seed}:{s}").uniform(-1.0, 1.0)
            factor *= 1.0 + self.jitter * u
        return factor


def _int_arg(name: str, value: object, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}")
    return value


def _float_arg(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} ({value!r})")
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value!r}")
    return float(value)


def _jitter_arg(value: object) -> float:
    if value is True:
        return DEFAULT_JITTER
    if value is False:
        return 0.0
    amplitude = _float_arg("random", value)
    if not 0.0 <= amplitude < 1.0:
        raise ValueError(f"`random` as a jitter amplitude must be in [0, 1), got {value!r}")
    return amplitude
