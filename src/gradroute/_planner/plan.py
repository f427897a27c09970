"""The planner's results as users see them: :class:`Plan` and its :class:`Call` s. No graph references."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Wiring:
    """Where a call starts and what it captures, as ids into a graph of the plan's signature (internal).

    Node ids index ``Graph.nodes`` of any graph with the signature the plan was made for; they are not
    references to a graph.

    Attributes:
        pass_index: the call's pass (gradients captured by one pass are carried to that pass's later calls).
        losses: ``(route, position)`` of each loss tensor the call starts from.
        edges_in: ``(node id, input slot)`` of the gradient edges an earlier call of the pass captured, where
            this call starts.
        edges_out: ``(node id, input slot)`` of the gradient edges this call captures for a later call.
        targets: the ``AccumulateGrad`` node ids of the parameters receiving gradient here.
        target_routes: per target, the route whose gradient it is (for ``Router.grads``).
    """

    pass_index: int = -1
    losses: tuple[tuple[int, int], ...] = ()
    edges_in: tuple[tuple[int, int], ...] = ()
    edges_out: tuple[tuple[int, int], ...] = ()
    targets: tuple[int, ...] = ()
    target_routes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Call:
    """One engine call of a :class:`Plan`.

    Attributes:
        index: position in the plan, from 1.
        groups: the groups of the pass this call belongs to.
        retain: whether the call runs with ``retain_graph=True`` (its nodes are needed by a later pass).
        losses: how many loss tensors start here.
        edges_in: how many gradient edges, captured by earlier calls of the pass, start here.
        edges_out: how many gradient edges are captured here and carried to a later call.
        params: how many parameters receive gradient in this call.
        nodes: how many autograd nodes this call executes.
        wiring: the node ids the executor needs (internal; not part of equality or ``repr``).

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> loss = unet(tenc(torch.randn(2, 4))).pow(2)
        >>> plan = gradroute.Router(tenc=tenc, unet=unet).plan(tenc=loss.mean(), unet=loss[0].mean())
        >>> [(c.index, c.groups, c.retain, c.edges_out) for c in plan.calls]
        [(1, ('tenc',), True, 1), (2, ('unet',), False, 0), (3, ('tenc',), False, 0)]
    """

    index: int
    groups: tuple[str, ...]
    retain: bool
    losses: int
    edges_in: int
    edges_out: int
    params: int
    nodes: int
    wiring: Wiring = field(default_factory=Wiring, repr=False, compare=False)

    @classmethod
    def make(cls, index: int, groups: tuple[str, ...], retain: bool, nodes: int, wiring: Wiring) -> Call:
        """A call whose counts are those of ``wiring``."""
        return cls(
            index=index,
            groups=groups,
            retain=retain,
            losses=len(wiring.losses),
            edges_in=len(wiring.edges_in),
            edges_out=len(wiring.edges_out),
            params=len(wiring.targets),
            nodes=nodes,
            wiring=wiring,
        )


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
        notes: remarks on how checkpointed segments are handled (shared chunk by chunk, recomputed once per
            call, or recomputed per call by ``torch.utils.checkpoint``) and on compiled regions (whether their
            backwards compute only what each call needs: ``gradroute.compile``), one sentence each;
            ``str(plan)`` prints them last.

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> loss = unet(tenc(torch.randn(2, 4))).pow(2)
        >>> plan = gradroute.Router(tenc=tenc, unet=unet).plan(tenc=loss.mean(), unet=loss[0].mean())
        >>> plan.passes, plan.leaks["tenc"], len(plan.calls)
        ((('tenc',), ('unet',)), ('unet',), 3)
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
        lines = [
            f"gradroute plan: {len(self.groups)} routed loss(es), {len(self.passes)} pass(es), "
            f"{len(self.calls)} engine call(s), {self.graph_nodes} autograd nodes, "
            f"{self.kept_nodes} kept after backward",
            "",
            *self._reach_lines(),
            "",
            "passes (in order): " + "  then  ".join("+".join(p) for p in self.passes),
            "",
            *self._call_lines(),
            "",
            "retain=yes: the call's nodes are needed again by a later pass; each node's last call frees it.",
        ]
        if self.kept_nodes:
            lines.append(
                f"kept: {self.kept_nodes} nodes stay alive until the losses are dropped (a retaining call ran them "
                "last: a cut that was not clean, or PlanOptions(split=False))."
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _reach_lines(self) -> list[str]:
        names = self.groups
        columns = (*names, *self.others)
        width = max([len(n) for n in names] + [5])
        lines = [
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
        return lines

    def _call_lines(self) -> list[str]:
        header = ("#", "pass", "retain", "starts from", "edges out", "params", "nodes")
        rows = []
        for c in self.calls:
            start = []
            if c.losses:
                start.append(f"{c.losses} loss(es)")
            if c.edges_in:
                start.append(f"{c.edges_in} gradient edge(s)")
            rows.append(
                (
                    str(c.index),
                    "+".join(c.groups),
                    "yes" if c.retain else "no",
                    " + ".join(start),
                    str(c.edges_out) if c.edges_out else "-",
                    str(c.params) if c.params else "-",
                    str(c.nodes),
                )
            )
        widths = [max([len(h), *(len(r[k]) for r in rows)]) for k, h in enumerate(header)]  # no rows: no call
        lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(header, widths))]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)))
        return lines
