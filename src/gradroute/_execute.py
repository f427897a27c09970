"""Runs a program built by ``_planner.build``: one engine call per ``Call``, captured gradients carried on."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress, repeat
from typing import Any, ClassVar

import torch
from torch.autograd.graph import GradientEdge, Node

from ._compat import backward_hooks, engine_run_backward, grad_and_hooks_names
from ._losses import group_names
from ._options import PlanOptions
from ._planner import Call, Program
from ._session import routed_backward
from ._types import Route

_FREED = "backward through the graph a second time"


class GraphFreedError(RuntimeError):
    """A routed loss's autograd graph was already freed by an earlier backward.

    Every ``.grad`` is then as it was before the routed backward (NOTE [Undoing a failed routed backward]).

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> loss = unet(tenc(torch.randn(2, 4))).sum()
        >>> loss.backward()
        >>> try:
        ...     gradroute.Router(tenc=tenc, unet=unet).backward(tenc=loss, unet=loss)
        ... except gradroute.GraphFreedError as e:
        ...     print(str(e).split(":")[0])
        a loss routed to `tenc`, `unet`
    """


def freed_message(groups: Sequence[str]) -> str:
    """The message of a :class:`GraphFreedError` for the losses routed to ``groups`` (those reaching the node)."""
    what = (
        f"loss for group `{groups[0]}`"
        if len(groups) == 1
        else "a loss routed to " + ", ".join(f"`{n}`" for n in groups)
    )
    return (
        f"{what}: its autograd graph was already freed by an earlier backward (a loss can be backpropagated "
        "once; run a new forward for every backward, and do not call `.backward()` on a loss you route)"
    )


class _Handoff:
    """Starts an engine call at graph edges with gradients that Python no longer references while it runs.

    A gradient passed to ``torch.autograd.grad``/``backward`` stays referenced by Python (the argument lists) and
    by the engine's root node until the call returns. Here the root gets a zero placeholder (a 0-d tensor
    expanded, no memory) and a pre-hook on the edge's node swaps in the real gradient, popped from this object, so
    that the engine holds the only reference: a cotangent is freed as soon as its node has consumed it, and an
    ``AccumulateGrad`` node steals a parameter gradient into ``.grad`` instead of copying it.

    Pre-hooks run after the node's tensor hooks (``Tensor.register_hook``), so those see the placeholder, not the
    gradient again: they already ran on it when the earlier call captured it at this edge. A hook's return
    value is kept (it is added to the gradient), so a hook that scales or negates its input stays exact.

    NOTE [Hand-off hooks and placeholders made ahead]
    Right after an engine call the interpreter's and the dispatcher's memory is cold, and the first hook
    registration or tensor op there costs several times what it costs warm; so ``_run`` installs the pre-hooks
    of every node a call starts from before its first engine call (``install``), and placeholders are kept per
    shape (``placeholder``). Both are exact:
      1. A pre-hook whose slot is empty returns None: the node's inputs are left as they are. Installed
         early, it is empty in every call before the hand-off (the node may be captured or even run there).
      2. A placeholder reaches only the node of its root edge, and that node's pre-hook replaces it (or adds
         the real gradient to a sum that holds it) before the node runs; so it never travels further, and one
         tensor can stand for every slot of its shape, in any call, thread or router (each hook compares only
         the input of its own slot with it).
      3. A placeholder is an expanded 0-d zero, never written: the engine adds into an input buffer in place
         only when that buffer is no view, and ``AccumulateGrad`` steals only a gradient that obeys the
         parameter's layout (an expanded view does not); a shared one is, besides, referenced by the cache.
    """

    # placeholders per (shape, dtype, device): expanded views of one 0-d zero (no memory); bounded
    placeholders: ClassVar[dict[tuple[torch.Size, torch.dtype, torch.device], torch.Tensor]] = {}
    limit: ClassVar[int] = 64

    def __init__(self) -> None:
        self.slots: dict[Node, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.handles: list[Any] = []

    def install(self, node: Node) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The slots of ``node``, with its pre-hook registered on first use (rule 1)."""
        slot = self.slots.get(node)
        if slot is None:
            slot = self.slots[node] = {}
            self.handles.append(node.register_prehook(_swap_in(slot)))
        return slot

    def hand_off(self, node: Node, nr: int, grads: list[torch.Tensor | None], i: int) -> torch.Tensor:
        """Move ``grads[i]`` (set to None there) into the slot of input ``nr`` of ``node``; returns the placeholder
        to start the engine call with."""
        g, grads[i] = grads[i], None
        if g is None:
            raise TypeError("no gradient to hand off")  # unreachable: callers check
        placeholder = self.placeholder(g)
        self.install(node)[nr] = (g, placeholder)
        return placeholder

    @classmethod
    def placeholder(cls, g: torch.Tensor) -> torch.Tensor:
        """A zero tensor of ``g``'s shape, dtype and device that holds no memory (rules 2-3)."""
        key = (g.shape, g.dtype, g.device)
        out = cls.placeholders.get(key)
        if out is None:
            if len(cls.placeholders) >= cls.limit:
                cls.placeholders.clear()
            out = cls.placeholders[key] = torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)
        return out

    def empty(self) -> None:
        """Drop what a call left in the slots (a start its engine call never ran): nothing is swapped in later."""
        for slot in self.slots.values():
            slot.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.slots.clear()


def _swap_in(slot: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...] | None:
        if not slot:  # installed ahead, or already swapped in (rule 1)
            return None
        out = list(grad_outputs)
        for nr, (g, placeholder) in slot.items():
            got = out[nr]
            out[nr] = g if got is None or got is placeholder else got + g
        slot.clear()
        return tuple(out)

    return hook


# NOTE [Undoing a failed routed backward]
# A routed backward must refuse a graph that an earlier backward freed, even in part, with every ``.grad`` as it
# was; the engine reports a freed node only when it runs it, possibly after earlier calls (or earlier nodes of
# the same call) wrote ``.grad``. One of two ways keeps that promise:
#   1. Probe: the walk reads one saved tensor of every node that keeps tensors before the first engine call
#      (NOTE [One walk: structure, signature and the freed check] in _graph.py). It works for every backward,
#      at a cost per node, which is why it is the second way's fallback.
#   2. Undo: when every routed parameter's ``.grad`` is None before the backward (the usual case: zero_grad with
#      set_to_none before each step, no accumulation), putting None back undoes every write. Then the walk skips
#      the probe, and anything the engine raises (a freed node, an out-of-memory error, a hook that raises,
#      Ctrl-C) leaves ``.grad`` as it was.
#   3. Undo cannot take back what runs when a gradient is written: ``register_hook`` and
#      ``register_post_accumulate_grad_hook`` hooks on the parameters (an optimizer stepped in a hook), DDP's
#      all-reduce, FSDP2's reduce-scatter. Backwards where one of these is present, or where a ``.grad`` holds a
#      gradient to add to, probe instead (``undoable``; the router knows about DDP and FSDP2). Undoing writes
#      that add to earlier gradients would take a second gradient buffer (or a copy) while the backward runs.
#   4. ``Router.grads`` writes no ``.grad``: it needs neither.
#   5. Not seen: a hook registered on a parameter's ``AccumulateGrad`` node itself (``node.register_hook``; torch
#      lists a node's hooks nowhere), which a freed graph can then trigger for the parameters written before the
#      engine meets the freed node.


def undoable(routes: Sequence[Route]) -> bool:
    """Whether a failed routed backward of ``routes`` can be undone by setting every routed parameter's ``.grad``
    back to None (NOTE [Undoing a failed routed backward]); DDP and FSDP2 are the caller's to rule out."""
    # one C-level loop per attribute (host-bound loops); a hooks dict emptied again is no hook
    return not any(
        any(map(operator.is_not, map(_grad, r.params), repeat(None)))
        or any(map(_hooks, r.params))
        or any(map(_post_hooks, r.params))
        for r in routes
    )


_grad, _hooks, _post_hooks = (operator.attrgetter(a) for a in grad_and_hooks_names)


def execute(
    program: Program,
    *,
    accumulate: bool,
    remake_min_bytes: int = PlanOptions.remake_min_bytes,
    watch: bool = True,
    undo: bool = False,
) -> list[dict[int, torch.Tensor]]:
    """Run ``program``.

    Args:
        program: what ``_planner.build`` returned.
        accumulate: add into ``.grad`` (``Router.backward``); otherwise collect (``Router.grads``).
        remake_min_bytes: :attr:`gradroute.PlanOptions.remake_min_bytes`, for ``gradroute.checkpoint``.
        watch: whether a ``gradroute.checkpoint`` segment may be alive (``_checkpoint.maybe_live``): only its
            unpacks ask for the routed backward's session (``_session``), so without one none is opened. With
            one, autograd's device threads recognise this routed backward by a pre-hook on every node an engine
            call starts from (``_session.Session.watch``; the calling thread knows it without).
        undo: every routed parameter's ``.grad`` was None (``undoable``): if anything raises, they are set
            back to None before it propagates.

    Returns:
        With ``accumulate=False``: per route, ``id(param) -> gradient``. Otherwise empty dicts.
    """
    try:
        if not watch:  # no gradroute.checkpoint segment is alive: nothing asks for the session
            return _run(program, accumulate)
        nodes = program.graph.nodes
        per_call = {nodes[i] for i in program.planned.per_call}
        # the nodes the engine calls start from: how autograd's device threads recognise this routed backward
        starts = [
            *(t.grad_fn for r in program.routes for t in r.losses),
            *(nodes[j] for call in program.plan.calls for j, _ in call.wiring.edges_in),
        ]
        with routed_backward(remake_min_bytes, recompute_per_call=per_call, starts=starts):
            return _run(program, accumulate)
    except BaseException:
        if undo:
            undo_writes(program.routes)
        raise


def undo_writes(routes: Sequence[Route]) -> None:
    """Put None back into every routed parameter's ``.grad``: the undo of a failed backward that ``undoable``
    allowed."""
    for r in routes:
        for p in r.params:
            p.grad = None


def refuse_freed(error: BaseException, groups: Sequence[str]) -> None:
    """Raise :class:`GraphFreedError` (for the losses routed to ``groups``) from ``error`` where it is the
    engine's report of a freed graph; otherwise return."""
    if isinstance(error, RuntimeError) and _FREED in str(error):
        raise GraphFreedError(freed_message(groups)) from error


def _run(program: Program, accumulate: bool) -> list[dict[int, torch.Tensor]]:
    nodes = program.graph.nodes
    carried: dict[tuple[int, int, int], torch.Tensor] = {}  # (pass, node, input slot) -> captured gradient
    collected: list[dict[int, torch.Tensor]] = [{} for _ in program.routes]
    handoff = _Handoff()
    try:
        # before the first engine call: NOTE [Hand-off hooks and placeholders made ahead]
        for call in program.plan.calls:
            for j, _ in call.wiring.edges_in:
                handoff.install(nodes[j])
        for c, call in enumerate(program.plan.calls):
            try:
                _run_call(program, c, call, accumulate, carried, collected, handoff)
            finally:
                handoff.empty()
    finally:
        handoff.close()
    return collected


def _run_call(
    program: Program,
    c: int,
    call: Call,
    accumulate: bool,
    carried: dict[tuple[int, int, int], torch.Tensor],
    collected: list[dict[int, torch.Tensor]],
    handoff: _Handoff,
) -> None:
    """Call ``c`` of ``program``: start it from its losses and carried gradients, capture what later calls need."""
    nodes, leaf = program.graph.nodes, program.graph.leaf
    w = call.wiring
    outputs: list[torch.Tensor | GradientEdge] = []
    grad_outputs: list[torch.Tensor] = []
    for r, k in w.losses:
        t = program.routes[r].losses[k]
        outputs.append(t)
        grad_outputs.append(torch.ones_like(t))
    targets = program.targets[c] if program.targets is not None else tuple(map(leaf.__getitem__, w.targets))
    ids = w.targets
    owners = w.target_routes if program.target_routes is None else program.target_routes[c]
    if not all(map(_requires_grad, targets)):
        targets, ids, owners = _frozen_since(targets, ids, owners)
    for j, nr in w.edges_in:
        grad: list[torch.Tensor | None] = [carried.pop((w.pass_index, j, nr), None)]
        if grad[0] is not None:
            outputs.append(GradientEdge(nodes[j], nr))
            grad_outputs.append(handoff.hand_off(nodes[j], nr, grad, 0))
    if not outputs or not (targets or w.edges_out):  # (no inputs: the engine would write every leaf)
        return
    edges_out: list[torch.Tensor | GradientEdge] = [GradientEdge(nodes[j], nr) for j, nr in w.edges_out]
    try:
        if accumulate and not edges_out:
            run_engine(outputs, grad_outputs, call.retain, targets, accumulate=True)
            return
        res: list[torch.Tensor | None] = list(
            run_engine(outputs, grad_outputs, call.retain, [*edges_out, *targets], accumulate=False)
        )
    except RuntimeError as e:
        refuse_freed(e, group_names([r for r in program.routes if r.name in call.groups]))
        raise
    del outputs, grad_outputs
    for i, (j, nr) in enumerate(w.edges_out):
        _add(carried, (w.pass_index, j, nr), _compact(res[i]))
        res[i] = None
    grads = res[len(edges_out) :]
    del res  # the engine steals what nothing else references
    if accumulate and targets:
        _accumulate([nodes[j] for j in ids], targets, grads)
    else:
        for i, r in enumerate(owners):
            _add(collected[r], id(targets[i]), grads[i])


_requires_grad = operator.attrgetter("requires_grad")


def _frozen_since(
    targets: Sequence[torch.Tensor], ids: Sequence[int], owners: Sequence[int]
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], tuple[int, ...]]:
    """A call's parameters, their node ids and routes without those that stopped requiring grad since the forward
    (the engine refuses them as inputs; a plain backward's ``AccumulateGrad`` skips them)."""
    keep = list(map(_requires_grad, targets))
    return tuple(compress(targets, keep)), tuple(compress(ids, keep)), tuple(compress(owners, keep))


def run_engine(
    outputs: Sequence[torch.Tensor | GradientEdge],
    seeds: Sequence[torch.Tensor],
    retain: bool,
    inputs: Sequence[torch.Tensor | GradientEdge],
    *,
    accumulate: bool,
    entry: Any = engine_run_backward,
) -> tuple[torch.Tensor | None, ...]:
    """One engine call: ``torch.autograd.backward(outputs, seeds, retain_graph=retain, inputs=inputs)`` with
    ``accumulate``, else ``torch.autograd.grad(outputs, inputs, seeds, retain_graph=retain, allow_unused=True)``.

    Straight into the engine: the seeds are made here with the right shapes and dtypes, so the public
    functions' argument checks (Python, most of a call's own cost when the host is the bottleneck) are
    skipped. A torch without that entry (``entry`` None) gets the public functions.
    """
    if entry is not None:
        return entry(tuple(outputs), tuple(seeds), retain, False, tuple(inputs), True, accumulate_grad=accumulate)
    if accumulate:
        torch.autograd.backward(outputs, seeds, retain_graph=retain, inputs=inputs or None)  # type: ignore[arg-type]
        return ()
    return torch.autograd.grad(outputs, inputs, seeds, retain_graph=retain, allow_unused=True)  # type: ignore[arg-type]


def _add(into: dict[Any, torch.Tensor], key: Any, g: torch.Tensor | None) -> None:
    # a function of its own, so that no local variable keeps a gradient alive through the next engine call
    if g is not None:
        prev = into.get(key)
        into[key] = g if prev is None else prev + g


def _compact(g: torch.Tensor | None) -> torch.Tensor | None:
    """``g``, copied if, waiting for a later call, it would keep a storage of twice its size or more alive.

    The engine hands out slices of one gradient buffer (the backward of ``torch.cat``: a UNet's skip connections),
    and a slice held across calls keeps the whole buffer: the rest of it was consumed long ago.
    """
    if g is None or g.untyped_storage().nbytes() < 2 * g.numel() * g.element_size():
        return g
    return g.clone(memory_format=torch.contiguous_format)


def _accumulate(accumulators: list[Node], params: Sequence[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Add captured parameter gradients into ``.grad`` through the parameters' ``AccumulateGrad`` nodes.

    A call that captures gradient edges cannot also accumulate (``autograd.grad`` captures instead), so its
    parameter gradients go to their ``AccumulateGrad`` nodes in one more engine call: ``.grad`` is written the
    way the engine writes it (layout contract, hooks such as DDP's and FSDP's,
    ``register_post_accumulate_grad_hook``). Handed off (``_Handoff``), each gradient is stolen into ``.grad``
    when that is empty, not copied. The parameters' own tensor hooks (``Tensor.register_hook``) already ran
    when the gradient was captured: they are set aside for this call so they do not run twice.
    """
    handoff = _Handoff()
    edges: list[torch.Tensor | GradientEdge] = []
    grad_outputs: list[torch.Tensor] = []
    hooks: list[tuple[dict, dict]] = []
    try:
        for i, node in enumerate(accumulators):
            if grads[i] is not None:
                edges.append(GradientEdge(node, 0))
                grad_outputs.append(handoff.hand_off(node, 0, grads, i))
                own = backward_hooks(params[i])
                if own:
                    hooks.append((own, dict(own)))
                    own.clear()
        if edges:
            run_engine(edges, grad_outputs, False, (), accumulate=True)
    finally:
        handoff.close()
        for own, saved in hooks:
            own.update(saved)
