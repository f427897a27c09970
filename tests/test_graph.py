"""The graph walk: structure, signature, and the freed check it folds in."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradroute._graph import walk

D = torch.float64


def _linear_chain(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(torch.tanh(x), torch.ones(3, x.shape[1], dtype=D))


def _bare_layer_norm(x: torch.Tensor) -> torch.Tensor:
    # no weight, no bias: the node's first saved tensors (alphabetical: bias) are optional ones never defined
    return nn.functional.layer_norm(x, (x.shape[1],)) * 2


def _checkpointed(x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda t: torch.sin(t).exp(), x, use_reentrant=False)


def _indexed(x: torch.Tensor) -> torch.Tensor:
    # the only node keeping tensors (IndexBackward0) keeps a list of them: read once released, the list raises
    return x[torch.tensor([0, 2])]


GRAPHS: list[Callable[[torch.Tensor], torch.Tensor]] = [_linear_chain, _bare_layer_norm, _checkpointed, _indexed]


def _leaf() -> torch.Tensor:
    return torch.randn(4, 5, dtype=D, requires_grad=True)


@pytest.mark.parametrize("make", GRAPHS)
def test_live_graph_has_no_freed_node(make):
    loss = make(_leaf()).sum()
    g = walk([loss.grad_fn], {})
    assert g.freed is None


@pytest.mark.parametrize("make", GRAPHS)
def test_graph_freed_by_a_backward_is_found(make):
    loss = make(_leaf()).sum()
    loss.backward()
    g = walk([loss.grad_fn], {})
    assert g.freed is not None


def test_graph_freed_in_part_is_found_below_live_nodes():
    x = _leaf()
    h = nn.functional.layer_norm(x, (x.shape[1],))
    # frees only the nodes between h and x (the layer norm, whose first saved tensor is an absent bias)
    torch.autograd.grad(h.sum(), x)
    loss = (h.exp() * 3).sum()  # live nodes above the freed ones
    g = walk([loss.grad_fn], {})
    assert g.freed is not None
    assert type(g.nodes[g.freed]).__name__ == "NativeLayerNormBackward0"


def test_freed_check_runs_no_saved_tensor_hook():
    unpacked = []

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        loss = _linear_chain(_leaf()).sum()
    assert walk([loss.grad_fn], {}).freed is None
    assert unpacked == []


def test_equal_graphs_have_equal_signatures_and_others_differ():
    x = _leaf()
    marks = {id(x): 1}
    first, second = (walk([_linear_chain(x).sum().grad_fn], marks) for _ in range(2))
    other = walk([_bare_layer_norm(x).sum().grad_fn], marks)
    unmarked = walk([_linear_chain(x).sum().grad_fn], {})
    assert first.signature == second.signature
    assert first.signature != other.signature
    assert first.signature != unmarked.signature


@pytest.mark.parametrize("make", GRAPHS)
def test_adjacency_lists_are_the_next_functions(make):
    x = _leaf()
    g = walk([make(x).sum().grad_fn], {id(x): 1})
    # independent of the walk's flat edges: torch's own next_functions of every node found
    expected = [[(g.index[fn], nr) for fn, nr in node.next_functions if fn is not None] for node in g.nodes]
    assert g.succ == expected
    assert g.leaf == {i: x for i, node in enumerate(g.nodes) if getattr(node, "variable", None) is x}
    assert type(g).of(expected, nodes=g.nodes, leaf={}, index={}, signature=[], kinds=set()).succ == expected


def test_edges_into_other_input_slots_are_recorded():
    a = _leaf()
    b, c = a.unbind(0)[:2]  # one node with several outputs: edges into input slots 0 and 1
    g = walk([(b * c).sum().grad_fn], {})
    slots = {nr for out in g.succ for _, nr in out}
    assert slots == {0, 1}


def _custom(x: torch.Tensor) -> torch.Tensor:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    return Twice.apply(x)


def _copy_slices(x: torch.Tensor) -> torch.Tensor:
    y = x * 1
    y[0] = 0.0
    return y


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (lambda x: x.view(-1), True),
        (lambda x: x.t(), True),
        (lambda x: x + x, True),
        (lambda x: torch.cat([x, x]), True),
        (lambda x: x * x, False),
        (lambda x: x.sin(), False),
        (lambda x: x @ x, False),
        (_custom, False),
        (_copy_slices, False),
    ],
)
def test_stateless_nodes_are_those_that_save_no_tensors(op, expected):
    # a stateless node may run in any number of engine calls, retaining or not (the planner relies on it)
    from gradroute._graph import stateless

    x = torch.randn(3, 3, requires_grad=True)
    out = op(x)
    assert stateless(out.grad_fn) is expected
    if expected:  # released by a call without retain_graph, it runs again
        total = out.sum()
        first = torch.autograd.grad(total, x)
        torch.testing.assert_close(torch.autograd.grad(total, x), first, rtol=0, atol=0)
