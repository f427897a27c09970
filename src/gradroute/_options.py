"""`PlanOptions`: the planner's and the routed backward's tunable settings, passed in (never module constants)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanOptions:
    """How :class:`gradroute.Router` plans and runs a routed backward. Every setting keeps gradients exact.

    Attributes:
        chunk: nodes per chunk (at least) of a ``gradroute.checkpoint`` segment that several passes share: the
            passes are cut and interleaved chunk by chunk, so a retaining call holds about a chunk of the
            segment's recomputation.
        held_factor: how many of the largest segment's recomputations may be alive at once between engine
            calls before the segments holding the most are recomputed once per call instead of shared.
        interleave: cut and interleave the passes through shared checkpoint segments at all (switched off
            automatically under FSDP2).
        remake_min_bytes: a shared recomputation drops the tensors that cheap ops made from other saved
            tensors once each engine call has used them, and makes them again for the next, only in segments
            that save at least this many bytes.
        split: split a pass into several engine calls where that frees activations earlier (the default). With
            ``False`` every pass is one engine call, which retains the whole pass if a later one needs any of
            its nodes (as the hand-written ``pruned`` does): fewer engine calls, activations kept until the
            graph is dropped; no interleaving through checkpoint segments.

    Examples:
        >>> import torch, gradroute
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> router = gradroute.Router(a=a, b=b, plan_options=gradroute.PlanOptions(chunk=10))
        >>> router.plan_options.chunk
        10
    """

    chunk: int = 20
    held_factor: float = 2.0
    interleave: bool = True
    remake_min_bytes: int = 16 * 2**20
    split: bool = True

    def __post_init__(self) -> None:
        for name in ("chunk", "remake_min_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"`{name}` must be an int, got {type(value).__name__} ({value!r})")
        if self.chunk < 1:
            raise ValueError(f"`chunk` must be at least 1, got {self.chunk}")
        if self.remake_min_bytes < 0:
            raise ValueError(f"`remake_min_bytes` must be at least 0, got {self.remake_min_bytes}")
        if isinstance(self.held_factor, bool) or not isinstance(self.held_factor, (int, float)):
            raise TypeError(f"`held_factor` must be a number, got {type(self.held_factor).__name__}")
        if self.held_factor < 0:
            raise ValueError(f"`held_factor` must be at least 0, got {self.held_factor}")
        for name in ("interleave", "split"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` must be a bool, got {type(getattr(self, name)).__name__}")
