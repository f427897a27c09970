"""The names the command line accepts, in one place; torch-free, so that ``gradroute --help`` imports no torch."""

from __future__ import annotations

#: ``gradroute bench --workload``
WORKLOADS = ("sd-tiny", "gan", "actor-critic", "sd15")
#: the workloads that support ``--checkpointing``
CHECKPOINTING = ("sd-tiny", "sd15")
#: samples per batch when ``--batch-size`` is not given
DEFAULT_BATCH = {"sd-tiny": 16, "gan": 64, "actor-critic": 256, "sd15": 8}

#: ``gradroute bench --strategies``, always available (see ``gradroute.cli.bench.strategies``)
STRATEGIES = ("sum", "no_retain", "retain_twice", "freeze", "two_forward", "pruned", "cut", "gradroute")
#: with ``--checkpointing`` only: strategy -> the checkpoint kind the workload switches to
#: (see ``Workload.set_checkpoint``)
CKPT_STRATEGIES = {"gradroute_ckpt": "gradroute", "gradroute_blocks": "blocks", "gradroute_cuts": "cuts"}
#: strategies whose gradients are wrong (``sum``) or that crash on shared graphs (``no_retain``) by design
INEXACT = ("sum", "no_retain")

#: ``--dtype`` values besides ``auto``
DTYPES = ("fp32", "bf16", "fp16")

#: ``gradroute bench --compile`` (the backends ``gradroute.compile`` accepts; kept here so ``--help`` needs no torch)
COMPILE_BACKENDS = ("inductor", "aot_eager")
