"""Measured plan choice (``Router(autotune=...)``): the candidate plans of a graph, tried and timed on its first calls.

NOTE [Measured plan choice]
Every plan the planner makes is exact, so plans are interchangeable; which is fastest depends on where the
time goes (kernels, or the host's work per op and per engine call). Like ``torch.backends.cudnn.benchmark``,
the router measures instead of guessing.
  1. Candidates: :class:`~gradroute.PlanOptions` derived from the router's own
     (:meth:`Autotune.default_candidates`). They differ only on graphs with ``gradroute.checkpoint`` segments
     that several engine calls enter, or whose plan splits a pass into several calls; any other graph has one
     candidate and nothing is measured.
  2. Every default candidate frees each node at its last use, as the router's own plan does: nothing of the
     forward stays alive after ``backward`` while the caller holds the losses. One engine call per pass
     (``split=False``) can keep the nodes only its earlier, retaining calls ran; it is a candidate only with
     ``Autotune(keep_graph=True)``.
  3. Per graph signature (per call shape: group names, loss counts, ``backward``/``grads``), never inherited:
     a signature not seen before gets its own tuning; each candidate's program is built once on the walked
     graph (then cached); candidates that make the same program are merged; those whose estimated peak exceeds
     the lowest by more than ``memory_tolerance`` are not tried, except the first (the router's own options).
     The estimate: routed parameters and a gradient each, the graph's saved tensors, the larger of the largest
     shared segment's recomputation and the plan's shared recomputations held between calls. No device
     statistic is read or reset (the caller's ``max_memory_allocated`` stays theirs).
  4. Each routed backward runs the next candidate, round-robin: a real, exact backward, so nothing is wasted
     but time. It is timed (CUDA: wall clock, the devices synchronised before and after; elsewhere the
     process's CPU time). After two rounds, candidates slower than 1.25x the fastest are not run again; after
     ``trials`` rounds the router keeps, for good, the fastest (median) whose estimated peak is within
     ``memory_tolerance`` of the lowest. A candidate whose backward raised is never run again nor chosen.
  5. A followed backward (``static_graph``: only once the choice is made) is never planned again. Planning is
     under the router's lock; a trial records under the tuner's, so threads sharing a router may interleave.
Under ``torch.distributed`` with several ranks, the ranks would time differently and could choose different
plans: the router keeps its own options there.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._compat import SAVED_DATA, node_sequence_nr, saved_data, saved_items
from ._options import PlanOptions
from ._planner import Checkpoints, Program
from ._types import Route

#: a chunk or threshold no graph reaches
_HUGE = 2**62
#: tuned signatures kept per call shape
_SIGNATURES = 4
#: after two rounds, candidates slower than this times the fastest are not tried again
_DROP = 1.25


@dataclass(frozen=True)
class Autotune:
    """How :class:`gradroute.Router` chooses among its candidate plans by measuring them (``Router(autotune=)``).

    ``Router(autotune=True)`` (the default) uses these defaults; ``False`` switches the measured choice off.

    Attributes:
        trials: timed routed backwards per candidate before choosing (a candidate far slower than the
            fastest after two is dropped earlier).
        memory_tolerance: keep the fastest candidate whose peak memory is at most ``1 + memory_tolerance``
            times the lowest candidate's.
        candidates: the plan options to try, first the one to keep while measuring is not possible; ``None``:
            :meth:`default_candidates` of the router's ``plan_options``.
        keep_graph: also try one engine call per pass (``PlanOptions(split=False)``): fewer engine calls, but
            where a pass is split it keeps the saved tensors of the nodes only its earlier, retaining calls ran
            alive after ``backward`` for as long as the losses are referenced (a logging list of losses keeps
            them all). Off by default: the default candidates keep nothing.

    Examples:
        >>> import torch, gradroute
        >>> settings = gradroute.Autotune(trials=2, memory_tolerance=0.05)
        >>> router = gradroute.Router(net=torch.nn.Linear(2, 2), autotune=settings)
        >>> router.autotune.memory_tolerance, gradroute.Router(net=torch.nn.Linear(2, 2), autotune=False).autotune
        (0.05, None)
    """

    trials: int = 3
    memory_tolerance: float = 0.1
    candidates: tuple[PlanOptions, ...] | None = None
    keep_graph: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.trials, bool) or not isinstance(self.trials, int):
            raise TypeError(f"`trials` must be an int, got {type(self.trials).__name__} ({self.trials!r})")
        if self.trials < 1:
            raise ValueError(f"`trials` must be at least 1, got {self.trials}")
        tol = self.memory_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)):
            raise TypeError(f"`memory_tolerance` must be a number, got {type(tol).__name__}")
        if not tol >= 0:
            raise ValueError(f"`memory_tolerance` must be at least 0, got {tol}")
        if not isinstance(self.keep_graph, bool):
            raise TypeError(f"`keep_graph` must be a bool, got {type(self.keep_graph).__name__} ({self.keep_graph!r})")
        if self.candidates is not None:
            cands = tuple(self.candidates) if isinstance(self.candidates, (list, tuple)) else None
            if not cands or not all(isinstance(c, PlanOptions) for c in cands):
                raise TypeError(
                    f"`candidates` must be a non-empty tuple of gradroute.PlanOptions, got {self.candidates!r}"
                )
            object.__setattr__(self, "candidates", cands)

    @staticmethod
    def default_candidates(base: PlanOptions, *, keep_graph: bool = False) -> tuple[PlanOptions, ...]:
        """The plan options :class:`gradroute.Autotune` tries by default, ``base`` first; every one is exact.

        ``base``; every shared segment recomputed once per engine call (``held_factor=0``, as torch's checkpoint);
        chunks 4x larger; one chunk per segment; no cuts inside segments with one shared recomputation held
        through the whole backward (``interleave=False``, ``held_factor=inf``: fewest engine calls, most held);
        tensors remade in every segment; in none; with ``keep_graph``, one engine call per pass
        (``split=False``, which may keep saved tensors alive after the backward).

        Examples:
            >>> import gradroute
            >>> cands = gradroute.Autotune.default_candidates(gradroute.PlanOptions())
            >>> cands[0] == gradroute.PlanOptions(), cands[1].held_factor
            (True, 0.0)
        """
        out = [
            base,
            dataclasses.replace(base, held_factor=0.0),
            dataclasses.replace(base, chunk=min(base.chunk * 4, _HUGE)),
            dataclasses.replace(base, chunk=_HUGE),
            dataclasses.replace(base, interleave=False, held_factor=math.inf),
            dataclasses.replace(base, remake_min_bytes=0),
            dataclasses.replace(base, remake_min_bytes=_HUGE),
        ]
        if keep_graph:
            out.append(dataclasses.replace(base, split=False))
        return tuple(dict.fromkeys(out))


@dataclass(eq=False)
class _Candidate:
    options: PlanOptions
    times: list[float] = field(default_factory=list)
    peak: int = 0  # the estimate
    dropped: bool = False
    failed: bool = False  # its routed backward raised (out of memory, say): never run again nor chosen


@dataclass(eq=False)
class _State:
    """The tuning of one graph signature."""

    signature: list
    cands: list[_Candidate]
    resident: int  # the estimate's base: routed parameters and their gradients, saved tensors
    largest: int  # the largest shared segment's recomputation (alive while it is made, in any plan)
    trials: int
    tolerance: float
    why_not: str = ""  # set when there is nothing to tune
    chosen: int | None = None
    queue: list[int] = field(default_factory=list)
    rounds: int = 0

    def __post_init__(self) -> None:
        if len(self.cands) == 1:
            self.chosen = 0
        else:
            self.queue = list(range(len(self.cands)))

    def next(self) -> int:
        return self.chosen if self.chosen is not None else self.queue[0]

    def record(self, k: int, seconds: float, held: int) -> None:
        """Candidate ``k``'s routed backward took ``seconds``."""
        c = self.cands[k]
        c.times.append(seconds)
        c.peak = self.resident + max(held, self.largest)
        self._done(k)

    def fail(self, k: int) -> None:
        """Candidate ``k``'s routed backward raised: it is not run again (the router's own options, ``k`` 0, are
        what it runs without tuning: a failure there is the caller's)."""
        if k:
            self.cands[k].failed = self.cands[k].dropped = True
        self._done(k)

    def _done(self, k: int) -> None:
        """A trial of candidate ``k`` ended (threads sharing a router may end trials out of order, or two of
        one candidate: a candidate leaves the round's queue once)."""
        if self.chosen is not None or k not in self.queue:
            return
        self.queue.remove(k)
        if not self.queue:
            self._round_done()

    def _round_done(self) -> None:
        self.rounds += 1
        live = [k for k, c in enumerate(self.cands) if not c.dropped and c.times]
        if self.rounds == 2 and live:
            fastest = min(statistics.median(self.cands[k].times) for k in live)
            for k in live:
                if statistics.median(self.cands[k].times) > _DROP * fastest:
                    self.cands[k].dropped = True
            live = [k for k in live if not self.cands[k].dropped]
        if self.rounds >= self.trials or len(live) <= 1:
            # a dropped candidate is slow, not unfit: its peak is the floor if lowest, and it may still be chosen
            ran = [k for k, c in enumerate(self.cands) if c.times and not c.failed] or [0]
            lowest = min(self.cands[k].peak for k in ran)
            fits = [k for k in ran if self.cands[k].peak <= lowest * (1 + self.tolerance)]
            self.chosen = min(fits, key=lambda k: (statistics.median(self.cands[k].times or [0.0]), k))
        else:
            self.queue = live

    def describe(self) -> str | None:
        if self.why_not:  # nothing measured: the plan is the router's own, nothing to say
            return None
        rows = []
        for k, c in enumerate(self.cands):
            ms = f"{statistics.median(c.times) * 1e3:.2f} ms" if c.times else "not run yet"
            mark = " (failed)" if c.failed else " (dropped: slow)" if c.dropped else ""
            mark = " <- chosen" if k == self.chosen else mark
            rows.append(f"  #{k} {_short(c.options)}: {ms}, peak {_size(c.peak)} (estimated){mark}")
        if self.chosen is None:
            done = sum(len(c.times) for c in self.cands)
            head = f"autotune: measuring {len(self.cands)} candidate plans ({done} routed backwards so far)"
        else:
            head = (
                f"autotune: candidate #{self.chosen} of {len(self.cands)} chosen, the fastest (median of up to "
                f"{self.trials}) whose peak is within {self.tolerance:.0%} of the lowest; {self._cost()}"
            )
        return "\n".join([head, *rows])

    def _cost(self) -> str:
        """What measuring cost: the trial backwards, and their time beyond as many backwards of the chosen plan."""
        times = [t for c in self.cands for t in c.times]
        best = statistics.median(self.cands[self.chosen or 0].times or [0.0])
        extra = max(0.0, sum(times) - best * len(times))
        return f"{len(times)} trial backwards, {extra * 1e3:.2f} ms more than the chosen plan's"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _short(o: PlanOptions) -> str:
    base = PlanOptions()
    parts = []
    for f in dataclasses.fields(o):
        v = getattr(o, f.name)
        if v != getattr(base, f.name):
            parts.append(f"{f.name}={'max' if v == _HUGE else v}")
    return "PlanOptions(" + ", ".join(parts) + ")"


_NO_TRIAL = contextlib.nullcontext()


class _Trial:
    """Times one routed backward of a candidate and records it (or that it raised).

    With losses on CUDA devices: wall-clock time, the devices synchronised before and after. Otherwise the
    process's CPU time: what the backward costs, all threads, whatever else the machine runs meanwhile.
    """

    def __init__(self, tuner: Tuner, state: _State, k: int, program: Program) -> None:
        self.tuner, self.state, self.k, self.held = tuner, state, k, program.planned.held
        self.devices = sorted({t.device for r in program.routes for t in r.losses if t.is_cuda}, key=str)
        self.clock = time.perf_counter if self.devices else time.process_time
        self.start = 0.0

    def __enter__(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)
        self.start = self.clock()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            for d in self.devices:
                torch.cuda.synchronize(d)
        seconds = self.clock() - self.start
        with self.tuner.lock:
            if exc_type is not None:
                self.state.fail(self.k)
            else:
                self.state.record(self.k, seconds, self.held)


class Tuner:
    """The measured choice of one router: per call shape, the tuning of its latest graph signatures."""

    def __init__(self, settings: Autotune, checkpoints: Checkpoints) -> None:
        self.settings = settings
        self.checkpoints = checkpoints  # the planner's view of gradroute.checkpoint segments
        self.states: dict[tuple, list[_State]] = {}
        self.lock = threading.Lock()  # the states, which trials in other threads update
        self._last: _State | None = None

    @property
    def measuring(self) -> bool:
        """Whether some graph seen is still being measured."""
        with self.lock:
            return any(s.chosen is None for states in self.states.values() for s in states)

    def program(
        self,
        key: tuple,
        base: PlanOptions,
        routes: Sequence[Route],
        make: Callable[..., Program],
        *,
        measure: bool = True,
    ) -> tuple[Program, Any]:
        """The program to run now for ``routes``, and the context to run it in (a trial while its graph is being
        measured and ``measure``: a routed backward, not a plan).

        ``make(options)`` walks (or follows) and plans; ``make(options, graph)`` plans a graph already walked.
        ``key`` names the call shape (``base`` is part of it). The graph is walked once, planned with the
        options of the call shape's latest signature's candidate, then, where its own signature's tuning wants
        other options, planned again on the same walked graph (rule 3).
        """
        with self.lock:
            states = self.states.get(key)
            state = states[0] if states else None
            options = state.cands[state.next()].options if state else base
        program = make(options)
        if program.graph.followed:  # only once the choice is made: never planned again (rule 5)
            return program, _NO_TRIAL
        sig = program.graph.signature
        with self.lock:
            if state is None or (sig is not state.signature and sig != state.signature):
                state = self._state(key, base, routes, program, make)
            else:
                state.signature = sig  # the cached list from now on: compared by identity
            k = state.next()
        if state.cands[k].options != options:
            program = make(state.cands[k].options, program.graph)  # the same graph: not walked again
        self._last = state
        if state.chosen is not None or not measure:
            return program, _NO_TRIAL
        return program, _Trial(self, state, k, program)

    def describe(self) -> str | None:
        """What the tuning of the graph of the program last returned chose or measured so far."""
        return None if self._last is None else self._last.describe()

    def _state(
        self, key: tuple, base: PlanOptions, routes: Sequence[Route], first: Program, make: Callable[..., Program]
    ) -> _State:
        states = self.states.setdefault(key, [])
        sig = first.graph.signature
        for k, s in enumerate(states):
            if s.signature == sig:
                states.insert(0, states.pop(k))
                return s
        st = self.settings
        options = (
            st.candidates if st.candidates is not None else Autotune.default_candidates(base, keep_graph=st.keep_graph)
        )
        why_not = _why_not(first, self.checkpoints)
        resident = largest = 0
        if why_not:
            cands = [_Candidate(options[0])]
        else:
            resident = _resident(first, routes)
            largest = max(_shared_segments(first, self.checkpoints).values(), default=0)
            if st.candidates is None and not largest and not first.planned.per_call:
                # no checkpoint segment shared: only splitting can differ (not planned for the others at all)
                options = tuple(o for o in options if o == base or not o.split)
            # estimated peaks first: a candidate that would hold too much is not even tried (no OOM while tuning),
            # except the first, which is what the router runs without tuning
            held = _distinct(options, lambda o: make(o, first.graph), self.checkpoints)
            peaks = {o: resident + max(h, largest) for o, h in held.items()}
            lowest = min(peaks.values())
            cands = [
                _Candidate(o, peak=p)
                for k, (o, p) in enumerate(peaks.items())
                if k == 0 or p <= lowest * (1 + st.memory_tolerance)
            ]
            if len(cands) == 1:
                why_not = "one candidate plan fits for this graph: nothing to measure"
        state = _State(sig, cands, resident, largest, st.trials, st.memory_tolerance, why_not=why_not)
        states.insert(0, state)
        del states[_SIGNATURES:]
        return state


def _why_not(program: Program, ckpts: Checkpoints) -> str:
    """Why there is nothing to tune for ``program``'s graph (``""``: there may be)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "off under torch.distributed with several ranks (they could time and choose differently)"
    plan = program.plan
    if len(plan.calls) > len(plan.passes):  # a pass split into several calls: one call per pass is a candidate
        return ""
    if not program.planned.per_call and not _shared_segments(program, ckpts):
        return "one engine call per pass and no gradroute.checkpoint segment entered by several: one candidate plan"
    return ""


def _shared_segments(program: Program, ckpts: Checkpoints, skip: Sequence[int] = ()) -> dict[int, int]:
    """``segment -> bytes`` its saved tensors stand for, of the live ``gradroute.checkpoint`` segments that
    nodes executed by several engine calls belong to (less the segments of the nodes ``skip``)."""
    nodes = program.graph.nodes
    ranges = ckpts.segments(nodes)
    if not ranges:
        return {}
    starts = [a for a, _ in ranges]

    def segment(i: int) -> int:
        s = node_sequence_nr(nodes[i])
        r = bisect.bisect_right(starts, s) - 1
        return r if r >= 0 and s < ranges[r][1] else -1

    out: dict[int, int] = {}
    for i in program.planned.shared:
        r = segment(i)
        if r >= 0:
            out[r] = out.get(r, 0) + ckpts.node_bytes(nodes[i])
    for i in skip:
        out.pop(segment(i), None)
    return out


def _resident(program: Program, routes: Sequence[Route]) -> int:
    """Bytes alive during any routed backward of ``program``'s graph, whatever the plan: the routed
    parameters and a gradient each, and the tensors the graph saved (each storage once; a checkpoint's
    recomputations are not here but in the plan's estimate)."""
    params = {id(p): p for r in routes for p in r.params}
    total = 2 * sum(p.numel() * p.element_size() for p in params.values())
    seen = {p.untyped_storage().data_ptr() for p in params.values()}
    storages: dict[int, int] = {}
    for node in program.graph.nodes:
        for item in saved_items(node) or ():
            # what was saved, without running hooks (a checkpoint's placeholder for a tensor it will recompute
            # is not a tensor; a torch without SavedTensor.data shows nothing: the estimate is lower there)
            data = saved_data(item) if SAVED_DATA and item is not None else None
            if isinstance(data, torch.Tensor) and data.device.type != "meta":
                storage = data.untyped_storage()
                key = storage.data_ptr()
                if key and key not in seen:
                    storages[key] = max(storages.get(key, 0), storage.nbytes())
    return total + sum(storages.values())


def _distinct(
    options: Sequence[PlanOptions], make: Callable[..., Program], ckpts: Checkpoints
) -> dict[PlanOptions, int]:
    """``options`` less those whose program is the same as an earlier one's (built here, hence cached), each
    with its program's estimate of the shared recomputations held between calls (``Planned.held``)."""
    seen: set[tuple] = set()
    out: dict[PlanOptions, int] = {}
    for o in options:
        program = make(o)
        fp = _fingerprint(program, o, ckpts)
        if fp not in seen:
            seen.add(fp)
            out[o] = program.planned.held
    return out


def _fingerprint(program: Program, options: PlanOptions, ckpts: Checkpoints) -> tuple:
    """What running ``program`` with ``options`` does: its engine calls, its per-call segments, and which
    shared segments remake tensors (segments recomputed per call do not)."""
    calls = tuple((c.retain, c.wiring) for c in program.plan.calls)
    per_call = program.planned.per_call
    sizes = _shared_segments(program, ckpts, skip=per_call) if len(per_call) < len(program.planned.shared) else {}
    remade = tuple(sorted(r for r, b in sizes.items() if b >= options.remake_min_bytes))
    return calls, per_call, remade
