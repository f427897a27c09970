"""What the planner asks: the checkpoint kind of a node."""

from __future__ import annotations

import torch

import gradroute
from gradroute._checkpoint import checkpoint_kind

from ._helpers import torch_ck


def test_checkpoint_kind_names_the_checkpoint() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    ours = gradroute.checkpoint(torch.sin, x)
    theirs = torch_ck(torch.sin, x)
    reentrant = torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=True)
    # the output is an alias of the segment's last node (every consumer gets a view of its own)
    assert checkpoint_kind(ours.grad_fn.next_functions[0][0]) == "gradroute"
    assert checkpoint_kind(theirs.grad_fn) == "torch"
    assert checkpoint_kind(reentrant.grad_fn) == "reentrant"
    assert checkpoint_kind(torch.sin(x).grad_fn) is None
    assert checkpoint_kind((x + 1).grad_fn) is None  # saves nothing
    ours.sum().backward()
    assert checkpoint_kind(ours.grad_fn.next_functions[0][0]) is None  # freed
