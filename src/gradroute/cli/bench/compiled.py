"""``gradroute bench --compile BACKEND``: every strategy also through both networks compiled by gradroute.compile.

Both networks are compiled in place once (``nn.Module.compile`` with :func:`gradroute.compile`'s backend), and
each strategy is measured in two forms that take turns with all the others, step by step: eager (``STRATEGY``)
and compiled (``STRATEGY@compiled``: the compiled code switched on around its steps). A form's first steps
compile (forward, backward, the backward's variants): the warm-up steps absorb them, and the report gives the
graphs and variants compiled and the seconds the variants took. Errors of both forms are against the eager
reference. The report's ratio ``compiled_vs_eager``: the routed step's time over ``sum``'s, compiled, over the
same ratio eager. Peak memory is measured for the eager forms only (a child process per form would compile
again).
"""

from __future__ import annotations

from typing import Any

import torch

import gradroute

from ..._compile import CompileStats, compile_module
from .measure import measure
from .runner import Runner

SUFFIX = "@compiled"


def split(strategy: str) -> tuple[str, bool]:
    """``(strategy, compiled?)`` of a measured name."""
    if strategy.endswith(SUFFIX):
        return strategy[: -len(SUFFIX)], True
    return strategy, False


class CompiledRunner(Runner):
    """A :class:`Runner` whose networks also run compiled, for the strategies named ``STRATEGY@compiled``."""

    _compiled: dict[torch.nn.Module, Any]

    def compile(self, backend: str) -> list[CompileStats | None]:
        """Compiles both networks in place (switched off until a compiled form runs)."""
        modules = [self.wl.up_module, self.wl.down_module]
        stats = [compile_module(m, backend=backend) for m in modules]
        self._compiled = {m: m._compiled_call_impl for m in modules}  # what nn.Module.compile made
        self._switch(False)
        return stats

    def _switch(self, on: bool) -> None:
        self._on = on
        for m, impl in self._compiled.items():
            m._compiled_call_impl = impl if on else None

    def router_for(self, strategy: str) -> gradroute.Router:
        # the compiled form's graph differs from the eager one's: a static router each
        return super().router_for(strategy + SUFFIX if getattr(self, "_on", False) else strategy)

    def prepare(self, strategy: str) -> None:
        name, on = split(strategy)
        self._switch(on)
        super().prepare(name)

    def step(self, strategy: str) -> None:
        super().step(split(strategy)[0])

    def reference(self) -> dict[str, list[torch.Tensor]]:
        self._switch(False)  # both forms are held to the eager reference
        return super().reference()


def measure_both(
    r: CompiledRunner, backend: str, strategies: list[str], *, steps: int, warmup: int, progress: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each strategy eager and compiled, interleaved: the eager results, each with its compiled form's under
    ``"compiled"``; and what was compiled."""
    stats = r.compile(backend)
    both = [name for s in strategies for name in (s, s + SUFFIX)]
    results = measure(r, both, steps=steps, warmup=warmup, progress=progress)
    out = {s: v for s, v in results.items() if not split(s)[1]}
    for s in out:
        out[s]["compiled"] = results[s + SUFFIX]
    known = [st for st in stats if st is not None]
    info = {
        "backend": backend,
        "pruned": len(known) == len(stats),  # False: this torch release cannot (plain module.compile)
        "backwards": sum(st.backwards for st in known),
        "variants": sum(st.variants for st in known),
        "variant_seconds": sum(st.seconds for st in known),
    }
    return out, info


def compiled_vs_eager(results: dict[str, dict[str, Any]]) -> float | None:
    """(gradroute / sum) compiled over (gradroute / sum) eager, where all four ran."""
    try:
        eager = results["gradroute"]["ms"] / results["sum"]["ms"]
        compiled = results["gradroute"]["compiled"]["ms"] / results["sum"]["compiled"]["ms"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return compiled / eager


def header(info: dict[str, Any] | None) -> tuple[str, str, str]:
    """The table's extra header cells, separators and a line on what was compiled (empty without --compile)."""
    if info is None:
        return "", "", ""
    how = "pruned per call" if info["pruned"] else "NOT pruned on this torch release"
    line = (
        f"compiled: gradroute.compile(backend={info['backend']!r}), {info['backwards']} backward graph(s), "
        f"{info['variants']} variant(s) compiled in {info['variant_seconds']:.1f} s, {how}"
    )
    return " compiled err | compiled median ms | compiled × sum |", "---|---|---|", line


def cells(v: dict[str, Any], floor: dict[str, Any], info: dict[str, Any] | None) -> str:
    """The compiled form's cells of one row (empty without --compile)."""
    if info is None:
        return ""
    c, fc = v.get("compiled") or {}, floor.get("compiled") or {}
    if "error" in c:
        return f" crashes: {c['error'][:60]} | | |"
    ratio = c["ms"] / fc["ms"] if c.get("ms") and fc.get("ms") else None
    err = "" if c.get("err") is None else format(c["err"], ".1e")
    ms = "" if c.get("ms") is None else format(c["ms"], ".1f")
    return f" {err} | {ms} | {'' if ratio is None else format(ratio, '.2f')} |"
