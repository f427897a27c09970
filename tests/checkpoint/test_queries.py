"""What the planner and the router ask: the bytes a node's placeholders stand for, the checkpoint kind of a node,
whether a segment may be alive."""

from __future__ import annotations

import gc

import torch

import gradroute
from gradroute import _compat
from gradroute._checkpoint import _queries, checkpoint_kind, held_bytes, maybe_live

from ._helpers import torch_ck


def test_held_bytes_are_what_each_node_of_the_segment_saved() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    y = gradroute.checkpoint(lambda t: (t.sin() * t).exp(), x)
    exp = y.grad_fn  # the segment's last node, as for torch's checkpoint (attribute reads see the plain tensor)
    mul = exp.next_functions[0][0]
    sin = mul.next_functions[0][0]
    assert [n.name() for n in (exp, mul, sin)] == ["ExpBackward0", "MulBackward0", "SinBackward0"]
    size = x.numel() * x.element_size()
    # exp saves its result, mul both factors, sin its input; read by the path this torch takes, and by the
    # sequence-number record that is the path of torch releases without SavedTensor.data
    assert [held_bytes(n) for n in (exp, mul, sin)] == [size, 2 * size, size]
    assert [sum(_queries._saved_by(n)) for n in (exp, mul, sin)] == [size, 2 * size, size]
    assert held_bytes(torch.sin(x).grad_fn) == 0


def test_checkpoint_kind_names_the_checkpoint() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    ours = gradroute.checkpoint(torch.sin, x)
    theirs = torch_ck(torch.sin, x)
    reentrant = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=True)
    # the output's grad_fn is the segment's last node, as for torch's (each consumer gets a view of its own)
    assert checkpoint_kind(ours.grad_fn) == "gradroute"
    # torch's own is recognised where torch exposes what its saved-tensor hooks packed (see gradroute._compat)
    assert checkpoint_kind(theirs.grad_fn) == ("torch" if _compat.SAVED_DATA else None)
    assert checkpoint_kind(reentrant.grad_fn) == "reentrant"
    assert checkpoint_kind(torch.sin(x).grad_fn) is None
    assert checkpoint_kind((x + 1).grad_fn) is None  # saves nothing
    ours.sum().backward()
    assert checkpoint_kind(ours.grad_fn) is None  # freed


def test_no_segment_is_live_once_the_graphs_holding_them_are_gone() -> None:
    # the router asks on every routed backward (a live segment costs each engine call a pre-hook): segments
    # whose graphs are gone must not count, though their records are pruned only now and then
    gc.collect()  # graphs of earlier tests left in reference cycles
    x = torch.randn(2, 3, requires_grad=True)
    losses = [gradroute.checkpoint(torch.sin, x).sum() for _ in range(3)]
    assert maybe_live()
    losses[0].backward()
    assert maybe_live()  # the nodes, and so the segments, live while the losses do
    del losses
    assert not maybe_live()
