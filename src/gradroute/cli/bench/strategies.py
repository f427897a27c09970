"""The ways ``gradroute bench`` routes two losses from one forward, one function each.

``up``/``down`` are the upstream and downstream groups of the workload (see ``gradroute.cli.workloads``):

* ``sum`` -- one backward of ``loss_up + loss_down``: the cost floor, wrong gradients (each loss leaks into
  the other group).
* ``no_retain`` -- ``loss_up.backward(inputs=up)`` then ``loss_down.backward(inputs=down)`` without
  ``retain_graph``, the common first attempt: crashes (the first call frees the shared graph).
* ``retain_twice`` -- ``loss_up.backward(retain_graph=True)``, keep the upstream grads, ``loss_down.backward()``,
  put the upstream grads back: two full backwards.
* ``freeze`` -- the same two full backwards, with the other group's ``requires_grad`` switched off around each.
* ``two_forward`` -- GAN style: the downstream loss on ``boundary.detach()``, then a second downstream forward
  with the downstream network frozen for the upstream loss.
* ``pruned`` -- hand-written ``backward(inputs=)`` passes, retaining on the first; upstream loss first (the
  order with the lower peak).
* ``cut`` -- a hand cut at the boundary: ``grad(loss_up, boundary, retain_graph=True)``, ``loss_down`` into
  the downstream group, then the boundary gradient into the upstream group.
* ``gradroute`` -- ``Router.backward(up=loss_up, down=loss_down)``.
* ``gradroute_ckpt`` -- with ``--checkpointing`` only: the same with ``gradroute.checkpoint`` as both
  networks' checkpoint function (one recomputation per segment for all engine calls), where the other
  strategies use ``torch.utils.checkpoint`` (non-reentrant).
* ``gradroute_blocks`` -- with ``--checkpointing`` only: ``gradroute`` with ``gradroute.checkpoint_modules``
  on whole UNet blocks (``sd15``: down, mid and up blocks instead of diffusers' per-layer switch, so that the
  router can interleave its calls per block; ``sd-tiny`` checkpoints whole blocks already: as ``gradroute_ckpt``).
* ``gradroute_cuts`` -- with ``--checkpointing`` only: ``gradroute_ckpt`` plus ``gradroute.cut_points`` on the
  UNet blocks' submodules (``sd15``: the passes interleave layer by layer, one recomputation per segment;
  ``sd-tiny``: as ``gradroute_ckpt``).

The three checkpointing strategies run ``gradroute``'s function; what differs is the checkpoint kind
``Runner.prepare`` switches the workload to (``CKPT_STRATEGIES`` in ``gradroute.cli.choices``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..choices import CKPT_STRATEGIES

if TYPE_CHECKING:
    from .runner import Runner


def _set_requires_grad(params: list[torch.Tensor], flag: bool) -> None:
    for p in params:
        p.requires_grad_(flag)


def _sum(r: Runner) -> None:
    _, lu, ld = r.forward()
    (lu + ld).backward()


def _no_retain(r: Runner) -> None:
    _, lu, ld = r.forward()
    lu.backward(inputs=r.up_params)
    ld.backward(inputs=r.down_params)


def _retain_twice(r: Runner) -> None:
    _, lu, ld = r.forward()
    lu.backward(retain_graph=True)
    kept = [p.grad for p in r.up_params]
    r.zero()
    ld.backward()
    for p, g in zip(r.up_params, kept):
        p.grad = g


def _freeze(r: Runner) -> None:
    _, lu, ld = r.forward()
    _set_requires_grad(r.down_params, False)
    try:
        lu.backward(retain_graph=True)
    finally:
        _set_requires_grad(r.down_params, True)
    _set_requires_grad(r.up_params, False)
    try:
        ld.backward()
    finally:
        _set_requires_grad(r.up_params, True)


def _two_forward(r: Runner) -> None:
    up, down = r.wl.up_name, r.wl.down_name
    h = r.up()
    r.down(h.detach(), down)[down].backward()
    _set_requires_grad(r.down_params, False)
    try:
        r.down(h, up)[up].backward()
    finally:
        _set_requires_grad(r.down_params, True)


def _pruned(r: Runner) -> None:
    _, lu, ld = r.forward()
    lu.backward(inputs=r.up_params, retain_graph=True)
    ld.backward(inputs=r.down_params)


def _cut(r: Runner) -> None:
    h, lu, ld = r.forward()
    (g_h,) = torch.autograd.grad(lu, h, retain_graph=True)
    ld.backward(inputs=r.down_params)
    h.backward(g_h, inputs=r.up_params)


def _gradroute(r: Runner, strategy: str = "gradroute") -> None:
    _, lu, ld = r.forward()
    r.router_for(strategy).backward(**{r.wl.up_name: lu, r.wl.down_name: ld})


#: strategy name (``STRATEGIES`` and ``CKPT_STRATEGIES`` in ``gradroute.cli.choices``) -> its step
STRATEGY_FNS: dict[str, Callable[[Runner], None]] = {
    "sum": _sum,
    "no_retain": _no_retain,
    "retain_twice": _retain_twice,
    "freeze": _freeze,
    "two_forward": _two_forward,
    "pruned": _pruned,
    "cut": _cut,
    "gradroute": _gradroute,
    **{s: functools.partial(_gradroute, strategy=s) for s in CKPT_STRATEGIES},
}
