"""`gradroute.compile`: ``torch.compile`` whose compiled backwards compute only what each engine call needs."""

from __future__ import annotations

import copy
import operator
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _compat

# NOTE [Compiled backwards specialised per engine call]
# torch.compile turns a module's forward and backward into one custom autograd.Function (AOTAutograd's
# CompiledFunction), whose backward node (CompiledFunctionBackward) runs one compiled graph that returns the
# gradient of every input, parameters included, whatever the engine needs: ctx.needs_input_grad is all True
# under backward(inputs=...)/autograd.grad (pytorch#174017). A routed pass that needs only the gradient at a
# compiled UNet's input (the text encoder's loss) would compute all of the UNet's weight gradients and drop them.
#   1. gradroute.compile wraps the backend's backward compiler. AOTAutograd compiles the backward on its first
#      call and hands the compiler the backward FX graph (saved tensors and tangents in, one gradient per forward
#      input out); the wrapper keeps that graph and returns a dispatcher.
#   2. On each call, inside the engine, the dispatcher asks the engine, for each next edge of the node being
#      executed (torch._C._current_autograd_node), whether this graph task will execute the node the edge leads
#      to (torch._C._will_engine_execute_node; under autograd.grad a captured leaf raises instead of answering:
#      it is needed). The engine discards the gradients it will not execute, so they may be left out.
#   3. Those outputs are replaced by None in a copy of the graph, dead code is eliminated, and that variant is
#      compiled with the backend's own compiler and cached per mask. A routed backward through a compiled UNet
#      typically needs three: all gradients (a plain backward), the input gradient only (the text encoder's
#      pass) and the weight gradients only (the UNet's pass).
#   4. The backward graph's outputs follow the forward's flat inputs (the forward graph's "primals" placeholders,
#      recorded when it is compiled), the node's next edges its tensor inputs only (a dynamic shape passes
#      SymInts too): the recorded placeholders map one onto the other. Where they do not line up (tensor
#      subclasses, effect tokens, functionalised RNG on CUDA add inputs or outputs), the full graph runs: exact,
#      not pruned. A variant that fails to compile falls back to the full graph, with a warning.
#   5. The forward is compiled as usual (inductor or aot_eager). AOTAutograd's cache is off for these graphs: a
#      hit would load a compiled backward without calling the wrapped compiler. Buffer donation (the compiled
#      backward reusing saved activations as gradient buffers) is off too: a routed pass retains the graph, which
#      donation forbids.

# Every private torch API this module needs (the engine's state during a backward, the aot_eager and inductor
# backends' parts, AOTAutograd's contexts, cache and ids) comes from _compat, which says per API which releases
# have it; where one is missing (_compat.compiler_internals_missing), gradroute.compile falls back to
# torch.compile and the plan says so.

_UNAVAILABLE: list[str | None] = []  # computed once: why this torch release cannot prune compiled backwards


def unavailable() -> str | None:
    """Why this torch release cannot specialise compiled backwards (a missing private API), or None."""
    if not _UNAVAILABLE:
        _UNAVAILABLE.append(_compat.compiler_internals_missing())
    return _UNAVAILABLE[0]


def _engine_will_run(fn: Any) -> bool:
    """Whether the running graph task executes ``fn`` (the node a gradient edge leads to)."""
    if fn is None:
        return False
    try:
        return _compat.engine_will_execute(fn)
    except RuntimeError:
        return True  # a leaf that autograd.grad captures: "not supported" to ask, and needed


def _aot_eager(region: Region) -> Callable[..., Any]:
    def forward(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        region.forward_compiled(gm)
        return _compat.boxed_nop(gm, example_inputs)

    def backward(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return region.backward(gm, lambda variant: _compat.boxed_nop(variant, example_inputs))

    return _compat.aot_eager_backend(forward, backward)


def _inductor(region: Region, patches: dict[str, Any]) -> Callable[..., Any]:
    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            region.forward_compiled(gm)
            return _compat.inductor_compile_inner(gm, example_inputs, **kwargs)

        def compile_variant(variant: torch.fx.GraphModule) -> Any:
            with _compat.inductor_config_patch(patches):
                return _compat.inductor_compile_inner(variant, example_inputs, **kwargs)

        return region.backward(gm, compile_variant)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return _compat.inductor_compile(gm, example_inputs, inner, patches)

    return backend


# ---------------------------------------------------------------------------------------------------------------

BACKENDS = ("inductor", "aot_eager")

_ROUTED: set[int] = set()  # aot ids of the regions compiled by gradroute.compile
_STATS: weakref.WeakKeyDictionary[Any, CompileStats] = weakref.WeakKeyDictionary()


@dataclass
class CompileStats:
    """What :func:`gradroute.compile` compiled for one compiled module, summed over its regions (graphs).

    Attributes:
        regions: forward graphs compiled for training (each has one backward graph).
        backwards: backward graphs AOTAutograd asked for (compiled lazily, on their first call).
        variants: backward variants compiled, one per mask of needed gradients seen (the full one included).
        seconds: wall time spent compiling the variants.
        unaligned: backward graphs whose outputs could not be mapped onto the engine's edges (run whole).
        masks: per variant, the indices of the backward graph's outputs it computes.

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> unet_c = gradroute.compile(unet, backend="aot_eager")
        >>> out = unet_c(tenc(torch.randn(2, 4)))
        >>> gradroute.Router(tenc=tenc, unet=unet).backward(tenc=out.sum(), unet=out.pow(2).sum())
        >>> gradroute.compile_stats(unet_c).variants  # the input's gradient only; the weights' only
        2
    """

    regions: int = 0
    backwards: int = 0
    variants: int = 0
    seconds: float = 0.0
    unaligned: int = 0
    masks: list[tuple[int, ...]] = field(default_factory=list)


class Region:
    """The forward and backward of one graph dynamo captured: which forward inputs are tensors."""

    def __init__(self, stats: CompileStats) -> None:
        self.stats = stats
        self.slots: list[int | None] | None = None  # forward input -> index among the node's next edges
        self.tensors = 0

    def forward_compiled(self, gm: torch.fx.GraphModule) -> None:
        primals = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
        if not primals:
            return  # an inference graph: no backward
        slots: list[int | None] = []
        tensors = 0
        for n in primals:
            is_tensor = isinstance(n.meta.get("val"), torch.Tensor)
            slots.append(tensors if is_tensor else None)
            tensors += is_tensor
        self.slots, self.tensors = slots, tensors
        self.stats.regions += 1
        aot_id = _compat.aot_id_being_compiled()
        if aot_id is not None:
            _ROUTED.add(aot_id)

    def backward(self, gm: torch.fx.GraphModule, compile_variant: Callable[[torch.fx.GraphModule], Any]) -> Any:
        _compat.no_backward_donation()
        self.stats.backwards += 1
        return MaskedBackward(gm, self, compile_variant)


class MaskedBackward:
    """A compiled backward that runs, on each call, the variant of its graph computing only the needed outputs."""

    def __init__(self, gm: torch.fx.GraphModule, region: Region, compile_variant: Callable[..., Any]) -> None:
        # boxed calling convention (the args list is handed over); an instance attribute, so that the wrappers
        # torch puts around a compiled backward (functools.wraps copies __dict__) keep it
        self._boxed_call = True
        outs = _outputs(gm)
        self.gm = gm
        self.stats = region.stats
        self.computed = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.fx.Node))
        self.slots = region.slots if region.slots is not None and len(region.slots) == len(outs) else None
        self.tensors = region.tensors
        if self.slots is None:
            self.stats.unaligned += 1
        self.compile_variant = compile_variant
        self.contexts = _compat.compile_contexts()
        self.variants: dict[tuple[int, ...], Any] = {}
        if _compat.current_autograd_node() is not None:  # compiled lazily, in the first call: this call's variant, now
            self._get(self.mask(), reenter=False)

    def mask(self) -> tuple[int, ...]:
        """The outputs this call of the backward must compute (indices into the graph's outputs)."""
        node = _compat.current_autograd_node() if self.slots is not None else None
        edges = node.next_functions if node is not None else None
        if edges is None or len(edges) != self.tensors or self.slots is None:
            return self.computed
        slots = self.slots
        return tuple(i for i in self.computed if (s := slots[i]) is not None and _engine_will_run(edges[s][0]))

    def __call__(self, args: list[Any]) -> Any:
        return self._get(self.mask(), reenter=True)(args)

    def _get(self, keep: tuple[int, ...], *, reenter: bool) -> Any:
        fn = self.variants.get(keep)
        if fn is not None:
            return fn
        start = time.perf_counter()
        with self.contexts() if reenter else ExitStack():
            try:
                fn = self.compile_variant(_pruned(self.gm, keep) if keep != self.computed else copy.deepcopy(self.gm))
            except Exception as e:  # exact anyway: the full graph computes a superset
                if keep == self.computed:
                    raise
                warnings.warn(
                    f"gradroute.compile: a pruned backward failed to compile ({e}); running it whole", stacklevel=2
                )
                fn = self.variants[keep] = self._get(self.computed, reenter=False)
                return fn
        self.variants[keep] = fn
        self.stats.variants += 1
        self.stats.masks.append(keep)
        self.stats.seconds += time.perf_counter() - start
        return fn


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(out.args[0])


def _pruned(gm: torch.fx.GraphModule, keep: Iterable[int]) -> torch.fx.GraphModule:
    """A copy of the backward graph ``gm`` that returns None for every output not in ``keep``."""
    g = copy.deepcopy(gm)
    out = next(n for n in reversed(g.graph.nodes) if n.op == "output")
    kept = set(keep)
    outs = [o if i in kept else None for i, o in enumerate(out.args[0])]
    out.args = (tuple(outs) if isinstance(out.args[0], tuple) else outs,)
    visible = out.meta.get("user_visible_output_idxs")
    if visible is not None:
        out.meta["user_visible_output_idxs"] = [i for i in visible if i in kept]
    g.graph.eliminate_dead_code()
    if _narrow_output_masks(g.graph):
        g.graph.eliminate_dead_code()
    g.recompile()
    return g


def _narrow_output_masks(graph: torch.fx.Graph) -> bool:
    """Switch off the outputs nothing uses of ops that compute several gradients at once (an ``output_mask``).

    ``convolution_backward`` and the norms' backwards return the input's, the weight's and the bias's gradients
    from one call; dead-code elimination drops the unused ``getitem`` nodes but the op would still compute them.
    Returns whether a mask changed.
    """
    changed = False
    for node in graph.nodes:
        schema = _compat.target_schema(node.target) if node.op == "call_function" else None
        pos = next((k for k, a in enumerate(schema.arguments) if a.name == "output_mask"), None) if schema else None
        if pos is None or any(u.target is not operator.getitem for u in node.users):
            continue
        in_kwargs = "output_mask" in node.kwargs
        mask = node.kwargs["output_mask"] if in_kwargs else node.args[pos] if pos < len(node.args) else None
        if not isinstance(mask, (list, tuple)):
            continue
        used = {u.args[1] for u in node.users}
        narrowed = [bool(m) and i in used for i, m in enumerate(mask)]
        if narrowed == list(mask):
            continue
        if in_kwargs:
            node.kwargs = {**node.kwargs, "output_mask": narrowed}
        else:
            node.args = (*node.args[:pos], narrowed, *node.args[pos + 1 :])
        changed = True
    return changed


class RoutedBackend:
    """A ``torch.compile`` backend whose backward graphs are specialised per engine call (see the NOTE above)."""

    def __init__(self, backend: str, mode: str | None, options: dict[str, Any] | None, dynamic: bool | None) -> None:
        self.backend = backend
        self.stats = CompileStats()
        self._patches = _compat.inductor_patches(mode, options, dynamic) if backend == "inductor" else {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        region = Region(self.stats)
        compiler = _inductor(region, self._patches) if self.backend == "inductor" else _aot_eager(region)
        with _compat.no_autograd_cache():
            return compiler(gm, example_inputs)


def compile(
    model: Any,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.compile(model, ...)`` whose compiled backwards compute only the gradients each routed pass needs.

    A module compiled with plain ``torch.compile`` runs one compiled backward that computes every input gradient,
    weights included, in every engine call that crosses it: the text encoder's routed pass through a compiled UNet
    computes the UNet's weight gradients and drops them. Compiled with ``gradroute.compile``, each call runs a
    backward graph specialised for the gradients the engine will use (compiled once per set of needed
    gradients, usually three per region: all, the input's only, the weights' only), as in eager mode. Gradients
    are exactly those of ``torch.compile``; a plain ``.backward()`` runs the full graph.

    Args:
        model: a module or function, as for ``torch.compile``.
        backend: ``"inductor"`` or ``"aot_eager"``. Other backends: use ``torch.compile`` (exact, not pruned).
        mode: inductor's, as for ``torch.compile``.
        options: inductor's, as for ``torch.compile``.
        **kwargs: passed to ``torch.compile`` (``dynamic``, ``fullgraph``, ...).

    Returns:
        What ``torch.compile`` returns.

    Examples:
        >>> import torch, gradroute
        >>> tenc, unet = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> compiled = gradroute.compile(unet, backend="aot_eager")
        >>> router = gradroute.Router(tenc=tenc, unet=unet)
        >>> loss = compiled(tenc(torch.randn(8, 4))).pow(2)
        >>> router.backward(tenc=loss.mean(), unet=loss[:4].mean())
        >>> unet.weight.grad.shape
        torch.Size([4, 4])
    """
    if not isinstance(backend, str):
        raise TypeError(f"`backend` must be one of {', '.join(BACKENDS)}, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(
            f"`backend` must be one of {', '.join(BACKENDS)}, got {backend!r} "
            "(for another backend use torch.compile: exact with gradroute, compiled backwards not pruned)"
        )
    if backend != "inductor" and (mode is not None or options):
        raise ValueError(f"`mode` and `options` are inductor's; got backend {backend!r}")
    reason = unavailable()
    if reason is not None:
        warnings.warn(
            f"gradroute.compile: compiled backwards are not pruned ({reason}); using torch.compile", stacklevel=2
        )
        return torch.compile(model, backend=backend, mode=mode, options=options, **kwargs)
    routed = RoutedBackend(backend, mode, options, kwargs.get("dynamic"))
    compiled = torch.compile(model, backend=routed, **kwargs)
    _STATS[compiled] = routed.stats
    return compiled


def compile_module(module: torch.nn.Module, *, backend: str = "inductor", **kwargs: Any) -> CompileStats | None:
    """``module.compile(...)`` (in place: the module's calls run compiled) with :func:`compile`'s backend.

    Returns its :class:`CompileStats`, or None where this torch release cannot prune (plain ``module.compile``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if unavailable() is not None:
        module.compile(backend=backend, **kwargs)
        return None
    routed = RoutedBackend(backend, kwargs.pop("mode", None), kwargs.pop("options", None), kwargs.get("dynamic"))
    module.compile(backend=routed, **kwargs)
    _STATS[module] = routed.stats
    return routed.stats


def compile_stats(compiled: Any) -> CompileStats | None:
    """What :func:`gradroute.compile` compiled for ``compiled`` so far, or None if it did not make ``compiled``.

    Examples:
        >>> import torch, gradroute
        >>> net = gradroute.compile(torch.nn.Linear(4, 4), backend="aot_eager")
        >>> net(torch.randn(2, 4)).sum().backward()
        >>> stats = gradroute.compile_stats(net)
        >>> stats.backwards, stats.variants
        (1, 1)
    """
    try:
        return _STATS.get(compiled)
    except TypeError:
        return None


def plan_note(nodes: Iterable[Any]) -> str | None:
    """A line for the plan about the compiled regions among ``nodes`` (autograd nodes), or None if none."""
    ids = [_compat.aot_id_of(n) for n in nodes if type(n).__name__ == "CompiledFunctionBackward"]
    if not ids:
        return None
    plain = sum(1 for i in ids if i not in _ROUTED)
    routed = len(ids) - plain
    parts = []
    if routed:
        parts.append(
            f"{routed} compiled region(s) of gradroute.compile: each engine call through them runs a backward "
            "specialised for the gradients it needs."
        )
    if plain:
        reason = unavailable()
        parts.append(
            f"{plain} compiled region(s) not pruned: every engine call through them computes all their input "
            "gradients, weights included ("
            + (
                f"gradroute.compile cannot prune them on this release: {reason}"
                if reason
                else "torch.compile; gradroute.compile computes only what each pass needs"
            )
            + ")."
        )
    return " ".join(parts)
