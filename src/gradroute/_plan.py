"""The planner: from the autograd graph of the routed losses to a list of engine calls.

Terms used throughout:

* **route** -- one group name with its loss tensors (summed) and its parameters.
* **pass** -- one or more routes whose losses are backpropagated together. Routes are merged into one pass
  when that is exact: no loss of the pass reaches a parameter that only another route of the pass owns.
* **need** -- the autograd nodes a pass must execute: on a path from one of its losses to one of its
  parameters. This is exactly the set the engine executes for ``backward(inputs=params)``.
* **last use** -- passes run in an order; a node's last use is the last pass that needs it. Executing a node
  without ``retain_graph`` frees its saved tensors, so every node must be executed with ``retain_graph=False``
  exactly at its last use, and with ``retain_graph=True`` before.
* **stage** -- a pass is split at the edges where the label (retain or final) changes. Each stage is one engine
  call; the gradients flowing across a cut are captured as ``GradientEdge`` inputs of one call and fed as
  ``GradientEdge`` outputs of the next.

Nothing here touches ``.grad``: ``_execute.py`` runs the program built here.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge

from ._graph import Graph, root_edge, stateless, walk
from ._options import PlanOptions


@dataclass(frozen=True, eq=False)
class Route:
    """One routed loss: a group name, its loss tensors (summed), and the group's parameters."""

    name: str
    losses: tuple[torch.Tensor, ...]
    params: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Call:
    """One engine call of a :class:`Plan`.

    Attributes:
        step: position in the plan, from 1.
        groups: the groups of the pass this call belongs to.
        retain: whether the call runs with ``retain_graph=True`` (its nodes are needed by a later pass).
        losses: how many loss tensors start here.
        cuts_in: how many gradient edges, cut by earlier calls, start here.
        cuts_out: how many gradient edges are cut here and carried to a later call.
        params: how many parameters receive gradient in this call.
        nodes: how many autograd nodes this call executes.
    """

    step: int
    groups: tuple[str, ...]
    retain: bool
    losses: int
    cuts_in: int
    cuts_out: int
    params: int
    nodes: int


@dataclass(frozen=True)
class Plan:
    """What :meth:`gradroute.Router.backward` does for a given set of losses; ``str(plan)`` is a table.

    A plan holds no reference to the autograd graph it was made from.

    Attributes:
        groups: the routed group names, in call order.
        reach: ``reach[loss][group]`` is how many of ``group``'s parameters the loss routed to ``loss``
            reaches in the graph.
        leaks: ``leaks[loss]`` names the groups whose parameters (not shared with ``loss``'s own group) the
            loss reaches: a plain backward of the summed losses would write its gradient there.
        passes: the routes backpropagated together, in execution order.
        calls: the engine calls, in execution order.
        others: groups of the router not named in the call; ``reach`` and ``leaks`` cover them too (filled by
            :meth:`Router.plan`).
        kept_nodes: nodes whose last execution had to retain their saved tensors (0 unless the graph has a
            shape the cut cannot express; they are freed when the caller drops the losses).
        graph_nodes: autograd nodes below the losses.
    """

    groups: tuple[str, ...]
    reach: Mapping[str, Mapping[str, int]]
    leaks: Mapping[str, tuple[str, ...]]
    passes: tuple[tuple[str, ...], ...]
    calls: tuple[Call, ...]
    kept_nodes: int
    graph_nodes: int
    notes: tuple[str, ...] = ()
    others: tuple[str, ...] = ()

    def __str__(self) -> str:
        names = self.groups
        columns = (*names, *self.others)
        width = max([len(n) for n in names] + [5])
        lines = [
            f"gradroute plan: {len(names)} routed loss(es), {len(self.passes)} pass(es), "
            f"{len(self.calls)} engine call(s), {self.graph_nodes} autograd nodes, "
            f"{self.kept_nodes} kept after backward",
            "",
            "reach: parameters of each group (columns) that each routed loss (rows) reaches",
            "  " + "loss".ljust(width) + "  " + "  ".join(g.rjust(max(len(g), 9)) for g in columns),
        ]
        for loss in names:
            cells = []
            for g in columns:
                n = self.reach[loss].get(g, 0)
                text = "-" if n == 0 else str(n)
                if g == loss:
                    text += " (own)"
                elif g in self.leaks.get(loss, ()):
                    text += " LEAK"
                cells.append(text.rjust(max(len(g), 9)))
            lines.append("  " + loss.ljust(width) + "  " + "  ".join(cells))
        leaky = [f"{loss} -> {', '.join(gs)}" for loss, gs in self.leaks.items() if gs]
        if leaky:
            lines.append(
                "  a plain backward of the summed losses would leak: " + "; ".join(leaky) + " (routing prevents it)"
            )
        else:
            lines.append("  no loss reaches another group's parameters: a summed backward would be exact")
        lines.append("")
        lines.append("passes (in order): " + "  then  ".join("+".join(p) for p in self.passes))
        lines.append("")
        header = ("#", "pass", "retain", "starts from", "cuts out", "params", "nodes")
        rows = []
        for c in self.calls:
            start = []
            if c.losses:
                start.append(f"{c.losses} loss(es)")
            if c.cuts_in:
                start.append(f"{c.cuts_in} cut edge(s)")
            rows.append(
                (
                    str(c.step),
                    "+".join(c.groups),
                    "yes" if c.retain else "no",
                    " + ".join(start),
                    str(c.cuts_out) if c.cuts_out else "-",
                    str(c.params) if c.params else "-",
                    str(c.nodes),
                )
            )
        widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)))
        lines.append("")
        lines.append("retain=yes: the call's nodes are needed again by a later pass; each node's last call frees it.")
        if self.kept_nodes:
            lines.append(
                f"kept: {self.kept_nodes} nodes could not be cut cleanly and stay alive until the losses are dropped."
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


@dataclass(eq=False)
class Stage:
    """One engine call, with what it needs from the graph (internal; holds graph references)."""

    pass_index: int
    retain: bool
    losses: list[tuple[int, int]]  # (route, loss) positions in Program.routes
    cuts_in: list[tuple[int, int]]
    cuts_out: list[tuple[int, int]]
    targets: list[torch.Tensor]
    target_ids: list[int]  # their AccumulateGrad nodes
    # for grads(): which route each target belongs to, in this pass
    target_routes: list[int]
    nodes: int


@dataclass(eq=False)
class Program:
    """A plan plus the graph references needed to execute it. Dropped after execution."""

    plan: Plan
    graph: Graph
    routes: Sequence[Route]
    stages: list[Stage] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)  # nodes that more than one call executes
    unshared: list[int] = field(default_factory=list)  # nodes of checkpoint segments recomputed per call


@dataclass(eq=False)
class _Cached:
    """What a program keeps across calls: no graph references, only ids into a graph of equal signature."""

    signature: list
    plan: Plan
    stages: list[Stage]
    unreached: list[str]
    shared: list[int]
    unshared: list[int]


class PlanCache:
    """The last program per call shape (group names, loss counts, mode), reused when the graph is the same.

    Reuse is safe because the plan is a function of the graph's signature alone (node classes, edges with
    their input slots, which leaves are which group parameters, where the losses enter): the walk that
    computes the signature runs on every call, only the analysis is skipped. Parameters are compared by
    identity; the router holds them, so their ids cannot be reused while the cache exists.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.entries: dict[tuple, _Cached] = {}
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self.entries.clear()


def _bits(mask: int) -> list[int]:
    out = []
    k = 0
    while mask:
        if mask & 1:
            out.append(k)
        mask >>= 1
        k += 1
    return out


def build(
    routes: Sequence[Route],
    *,
    merge_shared: bool = True,
    options: PlanOptions | None = None,
    cache: PlanCache | None = None,
) -> Program:
    """Analyse the graph of ``routes`` and build the program.

    Args:
        routes: the routes, in the caller's order.
        merge_shared: whether routes whose groups share parameters may be merged into one pass (exact for
            ``backward``, where shared parameters receive the sum; not for ``grads``, which reports each
            route's gradient separately).

        options: chunk size, interleaving and the other settings (:class:`gradroute.PlanOptions`); the
            router switches ``interleave`` off under FSDP2, which reduce-scatters a module's gradients at the
            end of the first engine call that computes any of them.
        cache: reuse the analysis of an earlier graph with the same signature.

    Returns:
        The program; ``program.unreached`` names the routes whose loss reaches none of their parameters.
    """
    root_edges = [[root_edge(t) for t in r.losses] for r in routes]
    roots = [e.node for edges in root_edges for e in edges]
    marks: dict[int, int] = {}
    for route in routes:
        for p in route.params:
            marks.setdefault(id(p), len(marks) + 1)
    g = walk(roots, marks)
    if any(t.__name__ == "CheckpointFunctionBackward" for t in g.kinds):
        raise ValueError(
            "the losses' graph contains a reentrant torch.utils.checkpoint segment (use_reentrant=True): its "
            "backward refuses `torch.autograd.grad` and `backward(inputs=...)`, which routing needs, and hides "
            "the parameters inside it; use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or "
            "gradroute.checkpoint"
        )
    options = options or PlanOptions()
    key = (merge_shared, options, tuple((r.name, len(r.losses)) for r in routes))
    hit = cache.entries.get(key) if cache is not None else None
    if hit is not None and hit.signature == g.signature:
        cache.hits += 1  # type: ignore[union-attr]
        return Program(hit.plan, g, routes, hit.stages, hit.unreached, hit.shared, hit.unshared)
    program = _analyse(g, routes, root_edges, merge_shared, options)
    if cache is not None:
        cache.misses += 1
        cache.entries.pop(key, None)
        if len(cache.entries) >= cache.size:
            cache.entries.pop(next(iter(cache.entries)))
        cache.entries[key] = _Cached(
            g.signature, program.plan, program.stages, program.unreached, program.shared, program.unshared
        )
    return program


def _analyse(
    g: Graph, routes: Sequence[Route], root_edges: list[list[GradientEdge]], merge_shared: bool, options: PlanOptions
) -> Program:
    n_routes = len(routes)
    n = len(g.nodes)
    succ, topo, leaf = g.succ, g.topo, g.leaf

    # route membership of every parameter, by identity
    owner: dict[int, int] = {}
    for r, route in enumerate(routes):
        for p in route.params:
            owner[id(p)] = owner.get(id(p), 0) | (1 << r)
    own = {i: owner.get(id(v), 0) for i, v in leaf.items()}

    # which routes' losses reach each node
    fwd = [0] * n
    for r, edges in enumerate(root_edges):
        for e in edges:
            fwd[g.index[e.node]] |= 1 << r
    for i in topo:
        f = fwd[i]
        if f:
            for j, _ in succ[i]:
                fwd[j] |= f

    # reach table, leaks, merge compatibility
    reach = [[0] * n_routes for _ in range(n_routes)]
    leak = [0] * n_routes
    incompatible = [0] * n_routes
    for i, m_own in own.items():
        f = fwd[i]
        if not f or not m_own:
            continue
        for r in _bits(f):
            for q in _bits(m_own):
                reach[r][q] += 1
        bad = f & ~m_own
        if bad:
            for r in _bits(bad):
                incompatible[r] |= m_own
                leak[r] |= m_own
            for q in _bits(m_own):
                incompatible[q] |= bad
    if not merge_shared:
        for m in owner.values():
            if m & (m - 1):
                for r in _bits(m):
                    incompatible[r] |= m & ~(1 << r)
    unreached = [routes[r].name for r in range(n_routes) if reach[r][r] == 0]

    # greedy merge of compatible routes into passes (routes reaching nothing of their own are dropped)
    pass_routes: list[int] = []  # route mask per pass
    for r in range(n_routes):
        if reach[r][r] == 0:
            continue
        for k, pm in enumerate(pass_routes):
            if not (incompatible[r] & pm):
                pass_routes[k] = pm | (1 << r)
                break
        else:
            pass_routes.append(1 << r)
    n_pass = len(pass_routes)
    pass_of = {}
    for k, pm in enumerate(pass_routes):
        for r in _bits(pm):
            pass_of[r] = k
    memo: dict[int, int] = {0: 0}

    def to_pass(mask: int) -> int:
        out = memo.get(mask)
        if out is None:
            out = 0
            for r in _bits(mask):
                if r in pass_of:
                    out |= 1 << pass_of[r]
            memo[mask] = out
        return out

    # targets of each pass: leaves that a route of the pass owns and reaches
    target = {i: to_pass(m & fwd[i]) for i, m in own.items() if m & fwd[i]}
    back = [0] * n
    for i, t in target.items():
        back[i] = t
    for i in reversed(topo):
        if i in leaf:
            continue
        b = 0
        for j, _ in succ[i]:
            b |= back[j]
        back[i] = b
    need = [0] * n
    for i in range(n):
        if i not in leaf:
            need[i] = to_pass(fwd[i]) & back[i]

    # order: a pass whose weight-gradient nodes another pass also needs goes after that pass, so that the
    # weight gradients are computed while the shared activations are being freed, not while they are retained
    before = [0] * n_pass
    for i in range(n):
        nd = need[i]
        if not nd:
            continue
        w = 0
        for j, _ in succ[i]:
            w |= target.get(j, 0)
        w &= nd
        for k in _bits(w):
            before[k] |= nd & ~(1 << k)
    order: list[int] = []
    placed = 0
    while len(order) < n_pass:
        ready = [k for k in range(n_pass) if not (placed >> k) & 1 and not (before[k] & ~placed)]
        if not ready:  # a cycle (parameters shared across passes): take the least constrained
            ready = [
                min(
                    (k for k in range(n_pass) if not (placed >> k) & 1),
                    key=lambda k: bin(before[k] & ~placed).count("1"),
                )
            ]
        k = ready[0]
        order.append(k)
        placed |= 1 << k
    pos = {k: p for p, k in enumerate(order)}

    # the last use of every node
    last = [-1] * n
    for i in range(n):
        nd = need[i]
        if nd:
            last[i] = max(_bits(nd), key=lambda k: pos[k])

    def staged(segment: dict[int, int]) -> tuple[list[Stage], list[list[int]], int]:
        per_pass: list[tuple[list[Stage], list[list[int]]]] = []
        kept = 0
        for k in order:
            st, members_of, k_kept = _stage_pass(g, k, routes, root_edges, pass_routes[k], need, last, target, segment)
            kept += k_kept
            per_pass.append((st, members_of))
        return (*_schedule(g, per_pass, root_edges), kept)

    segment = _shared_segments(g, need, options.chunk) if options.interleave else {}
    stages, stage_members, kept = staged(segment)
    unshared, n_unshared = _unshared(g, stage_members, options.held_factor)
    if n_unshared:
        # shared recomputations would pile up (the passes cannot interleave through the segments, or must
        # not: FSDP2): plan as for torch's checkpoint (no cuts inside the segments) and recompute every
        # segment once per call, each tensor dropped once used
        if segment:
            segment = {}
            stages, stage_members, kept = staged(segment)
        unshared, n_unshared = _unshared(g, stage_members, 0)
    calls: list[Call] = []

    groups_of_pass = [tuple(routes[r].name for r in _bits(pass_routes[k])) for k in range(n_pass)]
    for s in stages:
        calls.append(
            Call(
                step=len(calls) + 1,
                groups=groups_of_pass[s.pass_index],
                retain=s.retain,
                losses=len(s.losses),
                cuts_in=len(s.cuts_in),
                cuts_out=len(s.cuts_out),
                params=len(s.targets),
                nodes=s.nodes,
            )
        )
    names = tuple(r.name for r in routes)
    plan = Plan(
        groups=names,
        reach={names[r]: {names[q]: reach[r][q] for q in range(n_routes)} for r in range(n_routes)},
        leaks={names[r]: tuple(names[q] for q in _bits(leak[r]) if q != r) for r in range(n_routes)},
        passes=tuple(groups_of_pass[k] for k in order),
        calls=tuple(calls),
        kept_nodes=kept,
        graph_nodes=n,
        notes=(
            (
                f"{len(set(segment.values()))} chunk(s) of gradroute.checkpoint segments are shared by several "
                "passes: the passes interleave chunk by chunk, and each shared recomputation is freed as they go",
            )
            if segment
            else ()
        )
        + (
            (
                f"{n_unshared} gradroute.checkpoint segment(s) are recomputed once per call instead of shared: "
                "the passes cannot interleave through all of them (plain code hands a tensor to ops on both "
                "sides, e.g. diffusers' skip connections) and shared recomputations would stay alive together, "
                "so the calls are those of torch's checkpoint; gradroute.cut_points on the modules whose outputs "
                "those tensors are (or gradroute.checkpoint_modules on whole blocks) lets the passes interleave",
            )
            if n_unshared
            else ()
        ),
    )
    shared = [i for i in range(n) if need[i] & (need[i] - 1)]
    return Program(
        plan=plan, graph=g, routes=routes, stages=stages, unreached=unreached, shared=shared, unshared=unshared
    )


def _stage_pass(
    g: Graph,
    k: int,
    routes: Sequence[Route],
    root_edges: list[list[GradientEdge]],
    route_mask: int,
    need: list[int],
    last: list[int],
    target: dict[int, int],
    segment: dict[int, int],
) -> tuple[list[Stage], list[list[int]], int]:
    """Split pass ``k`` into stages of one label each; where a cut is not clean, merge the stages involved.

    ``segment`` maps the nodes of ``gradroute.checkpoint`` segments that several passes traverse to the
    position of their chunk in backward order (see :func:`_shared_segments`): such passes are cut between
    chunks too, so that their calls interleave chunk by chunk and each shared recomputation is freed as the
    passes go down it.

    Returns the stages, the nodes each executes, and the number of nodes whose last execution retains.
    """
    succ, topo, leaf = g.succ, g.topo, g.leaf
    bit = 1 << k
    members = [i for i in topo if need[i] & bit]
    final = {i: last[i] == k for i in members}
    # stateless nodes (views, adds...) may run in a retaining call at their last use: it keeps nothing alive
    flex = {i for i in members if stateless(g.nodes[i])}
    any_retained = not all(final.values())
    lower = {i: 2 * segment[i] for i in members if i in segment}
    stage: dict[int, int] = {i: 0 for i in members}
    kept = 0
    if any_retained or lower:
        # Cut per shared checkpointed segment (if any), as late as possible (deferred parts stay together,
        # like a hand cut at the frontier), or as early as possible; where a cut is not clean, resolve it (see
        # _resolve). Keep the numbering that leaves the fewest nodes retained at their last use, preferring
        # them in that order.
        best = None
        for how in ("segments", "late", "early") if lower else ("late", "early"):
            bounds = lower if how == "segments" else {}
            numbered = _number_stages(g, members, final, flex, bit, need, late=how == "late", lower=bounds)
            numbered = _fold_flex_stages(numbered, flex)
            numbered = _resolve(g, k, numbered, need, target, final, flex, move=how == "segments")
            n_kept = sum(1 for i, v in numbered.items() if v % 2 and final[i] and i not in flex)
            if best is None or n_kept < best[0]:
                best = (n_kept, numbered)
            if n_kept == 0:
                break
        assert best is not None
        kept, stage = best

    pass_route_ids = _bits(route_mask)
    losses_by_stage: dict[int, list[tuple[int, int]]] = {}
    leaf_root_targets: list[int] = []
    for r in pass_route_ids:
        for t_pos, e in enumerate(root_edges[r]):
            i = g.index[e.node]
            if i in leaf:  # the loss is a leaf itself: it is its own target
                losses_by_stage.setdefault(0, []).append((r, t_pos))
                leaf_root_targets.append(i)
            elif i in stage:  # a loss term that reaches none of the pass's parameters is left out
                losses_by_stage.setdefault(stage[i], []).append((r, t_pos))

    route_of_param = {id(p): r for r in reversed(pass_route_ids) for p in routes[r].params}

    def owner_route(i: int) -> int:
        return route_of_param[id(leaf[i])]

    if max(stage.values(), default=0) == 0:
        tgt = sorted({j for i in stage for j, _ in succ[i] if target.get(j, 0) & bit} | set(leaf_root_targets))
        single = [
            Stage(
                pass_index=k,
                retain=False,
                losses=[t for ts in losses_by_stage.values() for t in ts],
                cuts_in=[],
                cuts_out=[],
                targets=[leaf[j] for j in tgt],
                target_ids=tgt,
                target_routes=[owner_route(j) for j in tgt],
                nodes=len(stage),
            )
        ]
        return single, [list(stage)], kept

    n_stages = max(stage.values()) + 1
    cuts_out: list[dict[tuple[int, int], None]] = [{} for _ in range(n_stages)]
    cuts_in: list[dict[tuple[int, int], None]] = [{} for _ in range(n_stages)]
    targets: list[set[int]] = [set() for _ in range(n_stages)]
    members_of: list[list[int]] = [[] for _ in range(n_stages)]
    for j in leaf_root_targets:
        targets[0].add(j)
    for i, s in stage.items():
        members_of[s].append(i)
        for j, nr in succ[i]:
            if target.get(j, 0) & bit:
                targets[s].add(j)
            elif need[j] & bit and stage[j] > s:
                key = (j, nr)
                cuts_out[s][key] = None
                cuts_in[stage[j]][key] = None
    out = []
    out_members = []
    for s in range(n_stages):
        if not members_of[s] and not losses_by_stage.get(s) and not targets[s]:
            continue
        out_members.append(members_of[s])
        tgt = sorted(targets[s])
        out.append(
            Stage(
                pass_index=k,
                retain=s % 2 == 1,
                losses=losses_by_stage.get(s, []),
                cuts_in=list(cuts_in[s]),
                cuts_out=list(cuts_out[s]),
                targets=[leaf[j] for j in tgt],
                target_ids=tgt,
                target_routes=[owner_route(j) for j in tgt],
                nodes=len(members_of[s]),
            )
        )
    return out, out_members, kept


def _schedule(
    g: Graph, per_pass: list[tuple[list[Stage], list[list[int]]]], root_edges: list[list[GradientEdge]]
) -> tuple[list[Stage], list[list[int]]]:
    """Interleave the passes' stages: downstream work first, as a plain backward would order it.

    Constraints: a pass's stages run in order, and a retaining call through a node runs before the call that
    frees it. Among the calls that may run, the one reaching the most recently created node that holds
    something (highest autograd sequence number) goes first: e.g. the text encoder's deferred part runs after
    the UNet pass, so the UNet's activations are freed before the text encoder's weight gradients are
    allocated, even where autocast's casts of the text encoder's output, made inside the UNet, start it.
    """
    stages: list[Stage] = []
    members: list[list[int]] = []
    owner: list[int] = []
    for k, (pass_stages, mem) in enumerate(per_pass):
        stages.extend(pass_stages)
        members.extend(mem)
        owner.extend([k] * len(pass_stages))
    n = len(stages)
    if n <= 1:
        return stages, members
    frees: dict[int, int] = {}
    for sid, st in enumerate(stages):
        if not st.retain:
            for v in members[sid]:
                frees[v] = sid
    deps: list[set[int]] = [set() for _ in range(n)]
    for sid in range(1, n):
        if owner[sid] == owner[sid - 1]:
            deps[sid].add(sid - 1)
    for sid, st in enumerate(stages):
        if st.retain:
            for v in members[sid]:
                f = frees.get(v)
                if f is not None and f != sid:
                    deps[f].add(sid)

    def seq(i: int) -> int:
        try:
            return int(g.nodes[i]._sequence_nr())
        except (AttributeError, RuntimeError):
            return -1

    key = []
    for sid, st in enumerate(stages):
        # the most recent node among those that hold something; stateless ones (views, adds, autocast's casts
        # of a tensor consumed downstream) run wherever convenient and say nothing about where a call is
        held = [seq(i) for i in members[sid] if not stateless(g.nodes[i])]
        starts = [g.index[root_edges[r][t].node] for r, t in st.losses] + [j for j, _ in st.cuts_in]
        key.append(max(held) if held else max((seq(i) for i in starts), default=-1))
    done: set[int] = set()
    order: list[int] = []
    while len(order) < n:
        ready = [sid for sid in range(n) if sid not in done and deps[sid] <= done]
        sid = max(ready, key=lambda s: (key[s], -s))
        done.add(sid)
        order.append(sid)
    return [stages[sid] for sid in order], [members[sid] for sid in order]


def _shared_segments(g: Graph, need: list[int], chunk: int) -> dict[int, int]:
    """The nodes of live ``gradroute.checkpoint`` segments that more than one pass enters -> the position of
    their chunk in backward order (1 = created last; 0 is left to the nodes above every segment).

    A segment is split into chunks of at least ``chunk`` nodes (by sequence number) at clean lines only: a
    line is clean when no tensor is consumed by ops on both sides of it (a residual stream inside a block is
    not; the line between two blocks is). Consumers that are views (stateless, one input) do not count: the
    planner moves a view to its input's side and cuts above it. Empty when there is no shared segment.
    """
    from ._checkpoint import segments

    ranges = segments()
    if not ranges:
        return {}
    nodes, succ, leaf = g.nodes, g.succ, g.leaf
    starts = [a for a, _ in ranges]
    seq: dict[int, int] = {}
    of: dict[int, int] = {}
    shared: set[int] = set()
    for i, nd in enumerate(need):
        if nd:
            s = seq[i] = nodes[i]._sequence_nr()
            r = bisect.bisect_right(starts, s) - 1
            if r >= 0 and s < ranges[r][1]:
                of[i] = r
                if nd & (nd - 1):
                    shared.add(r)
    if not shared:
        return {}
    # each producer's consumers span (lowest, highest] in sequence numbers: no clean line in between
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for i, s in seq.items():
        if len(succ[i]) == 1 and stateless(nodes[i]):
            continue
        for j, _ in succ[i]:
            if j not in leaf:
                lo[j] = min(lo.get(j, s), s)
                hi[j] = max(hi.get(j, s), s)
    events = sorted([(lo[j] + 1, 1) for j in lo if lo[j] < hi[j]] + [(hi[j] + 1, -1) for j in lo if lo[j] < hi[j]])

    by_segment: dict[int, list[int]] = {r: [] for r in shared}
    for i, r in of.items():
        if r in by_segment:
            by_segment[r].append(i)
    out: dict[int, int] = {}
    pos = 1
    for r in sorted(shared, reverse=True):
        members = sorted(by_segment[r], key=lambda i: seq[i])  # ascending: the sweep goes up
        # clean[p]: no span contains the line between members[p] and members[p + 1]
        clean = [False] * len(members)
        k = depth = 0
        for p in range(len(members) - 1):
            line = seq[members[p + 1]]
            while k < len(events) and events[k][0] <= line:
                depth += events[k][1]
                k += 1
            clean[p] = depth == 0
        count = 0
        for p in range(len(members) - 1, -1, -1):  # from the top of the segment down
            out[members[p]] = pos
            count += 1
            if count >= chunk and p > 0 and clean[p - 1]:
                pos += 1
                count = 0
        pos += 1
    return out


def _number_stages(
    g: Graph,
    members: list[int],
    final: dict[int, bool],
    flex: set[int],
    bit: int,
    need: list[int],
    *,
    late: bool,
    lower: dict[int, int],
) -> dict[int, int]:
    """Stage numbers for one pass: monotone along gradient flow, even = final, odd = retained (a ``flex``
    node, which keeps no tensors, goes in either).

    As early as possible (``late=False``: each node at the first stage its predecessors and its ``lower``
    bound allow), or as late as possible (``late=True``).
    """
    succ = g.succ
    stage: dict[int, int] = {}
    if not late:
        cand: dict[int, int] = {}
        for i in members:
            base = max(cand.get(i, 0), lower.get(i, 0))
            s = base if i in flex or (base % 2 == 0) == final[i] else base + 1
            stage[i] = s
            for j, _ in succ[i]:
                if need[j] & bit and cand.get(j, -1) < s:
                    cand[j] = s
        return stage
    top = 2 * len(members) + 2
    for i in reversed(members):
        base = min((stage[j] for j, _ in succ[i] if need[j] & bit), default=top)
        stage[i] = base if i in flex or (base % 2 == 0) == final[i] else base - 1
    low = min(stage.values())
    low -= low % 2
    return {i: s - low for i, s in stage.items()}


def _fold_flex_stages(stage: dict[int, int], flex: set[int]) -> dict[int, int]:
    """Move every stage made of stateless nodes only into the next stage (it would be an engine call of its own
    for a few views or adds). The numbering stays monotone: the nodes move together, to a stage their
    successors are at or after."""
    members: dict[int, list[int]] = {}
    for i, s in stage.items():
        members.setdefault(s, []).append(i)
    out = dict(stage)
    for s in sorted(members):
        if s + 1 in members and all(i in flex for i in members[s]):
            for i in members[s]:
                out[i] = s + 1
            members[s + 1].extend(members.pop(s))
    return out


def _conflict(
    g: Graph, k: int, stage: dict[int, int], need: list[int], target: dict[int, int]
) -> tuple[int, int, int] | None:
    """``(s, t, j)``: the call of stage ``s`` captures or accumulates node ``j``, and would also execute a node
    of the later stage ``t`` that feeds ``j``; None when every call executes exactly its own nodes.

    The engine executes every node on a path from a call's starting edges to its captured edges and targets.
    """
    succ = g.succ
    bit = 1 << k
    reach_from: dict[int, int] = {}  # node -> mask of stages that reach it
    sink_of: dict[int, int] = {}  # node -> mask of stages that capture into it or accumulate it
    for i in g.topo:
        s = stage.get(i)
        if s is None:
            continue
        m = reach_from.get(i, 0) | (1 << s)
        for j, _ in succ[i]:
            if target.get(j, 0) & bit:
                sink_of[j] = sink_of.get(j, 0) | (1 << s)
                reach_from[j] = reach_from.get(j, 0) | m
            elif j in stage:
                reach_from[j] = reach_from.get(j, 0) | m
                if stage[j] > s:
                    sink_of[j] = sink_of.get(j, 0) | (1 << s)
    for p, s_p in stage.items():
        r = reach_from.get(p, 0) & ((1 << s_p) - 1)  # earlier stages that reach p
        if not r:
            continue
        for j, _ in succ[p]:
            # an earlier stage that reaches p also captures or accumulates j, which p feeds from later
            both = sink_of.get(j, 0) & r
            if both:
                return (both & -both).bit_length() - 1, s_p, j
    return None


def _resolve(
    g: Graph,
    k: int,
    numbered: dict[int, int],
    need: list[int],
    target: dict[int, int],
    final: dict[int, bool],
    flex: set[int],
    *,
    move: bool,
) -> dict[int, int]:
    """Resolve every conflict (see :func:`_conflict`) at a node ``j`` that stage ``s`` captures.

    With ``move``, the stage-``s`` nodes whose only successor is ``j`` move to ``j``'s stage: their own inputs,
    fed by nobody else, become the cuts (the views ``gradroute.checkpoint`` gives every edge into and out of
    a segment). Otherwise, or if there are none, the stages from ``s`` to the conflicting one merge into one
    call, retaining if any of its nodes must. (A hook reading one edge instead of a capture does not work:
    the engine computes no gradient for an edge whose target the call does not need.)
    """
    succ = g.succ
    bit = 1 << k
    numbered = dict(numbered)
    while (conflict := _conflict(g, k, numbered, need, target)) is not None:
        s, t, j = conflict
        changed = False
        if move and j in numbered:  # (a parameter j has no stage: merge)
            for u, s_u in list(numbered.items()):
                if s_u != s:
                    continue
                outs = [jj for jj, _ in succ[u] if need[jj] & bit or target.get(jj, 0) & bit]
                if outs and all(jj == j for jj in outs):
                    later = numbered[j] if u in flex or (numbered[j] % 2 == 0) == final[u] else numbered[j] - 1
                    if later > s_u:
                        numbered[u] = later
                        changed = True
        if not changed:
            retain = any(not final[i] for i, v in numbered.items() if s <= v <= t and i not in flex)
            merged = s if (s % 2 == 1) == retain else s + 1
            numbered = {i: merged if s <= v <= t else v for i, v in numbered.items()}
    return numbered


def _unshared(g: Graph, stage_members: list[list[int]], factor: float) -> tuple[list[int], int]:
    """The nodes of ``gradroute.checkpoint`` segments whose recomputation is better not shared between calls.

    Shared, a segment's recomputed tensors live from the first call through the segment (which recomputes
    it) until the call that frees their node. Where the passes interleave chunk by chunk that is about one
    segment at a time; where they cannot (a tensor that plain code hands to ops on both sides of the
    segments, e.g. diffusers' skip connections from its downsamplers), one retaining call recomputes a whole
    run of segments and all of them stay alive until the other pass has been through them: on SD-1.5 at
    512 px, several times the summed backward's peak. While the bytes so held after some call exceed
    ``factor`` times the largest segment's, the segments holding the most there are picked (``factor`` 0:
    every segment that more than one call enters). The planner replans when there are any (``_analyse``);
    the executor recomputes the picked segments once per engine call, each recomputed tensor dropped once its
    node has used it, as ``torch.utils.checkpoint`` does (``_checkpoint``, ``Session.recompute_per_call``).

    Returns:
        The picked segments' nodes, and how many segments they make.
    """
    from ._checkpoint import held_bytes, segments

    ranges = segments()
    if not ranges:
        return [], 0
    starts = [a for a, _ in ranges]
    first: dict[int, int] = {}
    size: dict[int, int] = {}
    members: dict[int, dict[int, int]] = {}  # segment -> node -> its last call
    for t, mem in enumerate(stage_members):
        for i in mem:
            s = g.nodes[i]._sequence_nr()
            r = bisect.bisect_right(starts, s) - 1
            if r >= 0 and s < ranges[r][1]:
                first.setdefault(r, t)
                members.setdefault(r, {})[i] = t
    nbytes: dict[int, int] = {}
    for r, m in members.items():
        for i in m:
            nbytes[i] = held_bytes(g.nodes[i])
        size[r] = sum(nbytes[i] for i in m)
    if not size or not max(size.values()):
        return [], 0
    budget = factor * max(size.values())
    n = len(stage_members)
    # held[r][t]: bytes of segment r's recomputation alive after call t, if shared
    held: dict[int, list[int]] = {}
    for r, m in members.items():
        diff = [0] * (n + 1)
        for i, t_last in m.items():
            if t_last > first[r] and nbytes[i]:
                diff[first[r]] += nbytes[i]
                diff[t_last] -= nbytes[i]
        acc, row = 0, []
        for t in range(n):
            acc += diff[t]
            row.append(acc)
        held[r] = row
    out: set[int] = set()
    for t in range(n):
        live = sorted((held[r][t], r) for r in held if r not in out and held[r][t])
        total = sum(b for b, _ in live)
        while total > budget and live:
            b, r = live.pop()  # the segment holding the most at this call
            out.add(r)
            total -= b
    return sorted(i for r in out for i in members[r]), len(out)
