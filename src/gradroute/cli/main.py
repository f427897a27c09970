"""The ``gradroute`` command: ``gradroute demo`` and ``gradroute bench`` (``python -m gradroute ...``).

The argument parser and ``main``, the console script's entry point. The subcommands' modules (and
matplotlib, diffusers, ...) are imported only when that subcommand runs.
Bad arguments give a one-line error on stderr and exit code 2; set ``GRADROUTE_TRACEBACK=1`` to see the
traceback of an error raised while validating.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .choices import COMPILE_BACKENDS, DTYPES, STRATEGIES, WORKLOADS


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: message``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(low: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: an integer, ``>= low`` unless ``low`` is None."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or (low is not None and v < low):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")
_int = _int_at_least(None, "an integer")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradroute",
        description="Exact routed gradients for chained networks from one forward pass.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench}", required=True)
    _add_demo(sub)
    _add_bench(sub)
    return parser


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a tiny text encoder + UNet with two routed losses (about a minute on 2 CPU cores)",
        description="Train a tiny text encoder and conditional UNet on synthetic captioned shapes: the "
        "unmasked loss trains the text encoder, the masked loss the UNet, from one forward. Prints the plan "
        "and a step-0 check against independent forwards; writes DIR/demo.json and DIR/demo.png.",
    )
    demo.add_argument("--steps", type=_positive, default=300, help="training steps (default 300)")
    demo.add_argument("--batch-size", type=_positive, default=16, help="samples per step (default 16)")
    demo.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    demo.add_argument("--seed", type=_int, default=0, help="seed for models, data and noise (default 0)")
    demo.add_argument("--out", default="demo-out", metavar="DIR", help="output directory (default ./demo-out)")
    demo.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="auto (default): fp16 autocast + GradScaler on CUDA, fp32 on CPU",
    )
    demo.add_argument("--width", type=_positive, default=32, help="UNet base channels, a multiple of 8 (default 32)")


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="time, memory and gradient error of ways to route two losses, side by side",
        description="Run every strategy on one workload: relative gradient error against independent "
        "forwards, median/min step time (forward + backward) after warm-up, peak memory above rest.",
    )
    bench.add_argument("--workload", choices=WORKLOADS, default="sd-tiny", help="default sd-tiny")
    bench.add_argument("--batch-size", type=_positive, default=None, help="default per workload")
    bench.add_argument("--steps", type=_positive, default=10, help="timed steps per strategy (default 10)")
    bench.add_argument("--warmup", type=_non_negative, default=2, help="warm-up steps per strategy (default 2)")
    bench.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    bench.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="autocast dtype; auto (default): bf16 on CUDA, fp32 on CPU",
    )
    bench.add_argument(
        "--strategies", default=None, metavar="LIST", help=f"comma-separated subset of {','.join(STRATEGIES)}"
    )
    bench.add_argument("--checkpointing", action="store_true", help="activation checkpointing (sd-tiny, sd15)")
    bench.add_argument("--width", type=_positive, default=None, help="model width (sd-tiny, gan, actor-critic)")
    bench.add_argument(
        "--latent-size",
        type=_positive,
        default=None,
        help="sd15: latent height and width, a multiple of 8 (default 64: 512-pixel images)",
    )
    bench.add_argument("--seed", type=_int, default=0, help="seed for models and batch (default 0)")
    bench.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's)")
    bench.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of time and memory bars")
    bench.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory measurement (on CPU: a process each)"
    )
    bench.add_argument(
        "--static-graph",
        action="store_true",
        help="every gradroute strategy with a Router(static_graph=True) of its own (the graph walked on the "
        "first two backwards and every 100th only)",
    )
    bench.add_argument(
        "--compile",
        choices=COMPILE_BACKENDS,
        default=None,
        help="also run every strategy through both networks compiled by gradroute.compile with this backend",
    )
    bench.add_argument(
        "--step",
        action="store_true",
        help="time and peak memory of the whole training iteration (forward, routed backward, two AdamW, "
        "clipping, schedulers, a GradScaler with fp16), the router's loop against the hand-written one",
    )
    bench.add_argument(
        "--targets",
        default=None,
        metavar="SPEC",
        help="bounds printed next to the run's ratios, NAME=BOUND,...: with --step time and peak (upper bounds on "
        "the ratios to the hand-written loop), e.g. time=1.03,peak=1.01; else the names the report prints, e.g. "
        "time_vs_hand=1.02,speedup_vs_naive=1.2 (speedup_vs_naive: a lower bound)",
    )
    bench.add_argument("--_one", default=None, help=argparse.SUPPRESS)  # child process of a CPU run


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gradroute`` with ``argv`` (``sys.argv[1:]`` if None); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.command == "demo":
            from .demo.command import run as run_demo

            return run_demo(args)
        from .bench.command import run as run_bench

        return run_bench(args)
    except (ValueError, ImportError) as e:
        if os.environ.get("GRADROUTE_TRACEBACK"):
            raise
        message = " ".join(str(e).split())
        print(f"gradroute {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gradroute {args.command}: interrupted", file=sys.stderr)
        return 130
