"""The recipes of docs/integrations.md (docs/recipes/), run as written, against independent references.

Each run records what the optimizer is about to apply at every real step (``_recipes.recorded_steps``); the
reference for the step starts from the recorded parameters and takes a fresh forward per loss and
``torch.autograd.grad`` on every micro-batch. AdamW would hide a gradient scale (its update is nearly
scale-invariant), so the gradients themselves are compared, not the trained weights.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration._recipes import (
    RECIPES,
    assert_step_matches,
    micro_batches,
    recorded_steps,
    reference_step,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# ===================================================================================== diffusers-style scripts


def dreambooth_reference(record: Any, args: argparse.Namespace, batches_per_rank: Any, device: str = "cpu") -> Any:
    import dreambooth
    import tiny

    tenc, unet, noise_scheduler = tiny.models()
    tenc, unet = tenc.to(device), unet.to(device)
    params = [*unet.parameters(), *tenc.parameters()]  # the recipe's optimizer order
    autocast = (
        torch.autocast(device, dtype=torch.float16 if args.mixed_precision == "fp16" else torch.bfloat16)
        if args.mixed_precision in ("fp16", "bf16")
        else torch.autocast(device, enabled=False)
    )

    def forward(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with autocast:
            loss_tenc, loss_unet = dreambooth.compute_losses(
                tenc, unet, noise_scheduler, {k: v.to(device) for k, v in batch.items()}, args
            )
        return {"tenc": loss_tenc, "unet": loss_unet}

    groups = {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())}
    return reference_step(
        record,
        params,
        groups,
        forward,
        batches_per_rank,
        accumulation=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
    )


def check_dreambooth(records: list[Any], argv: list[str], *, world: int = 1, rtol: float, atol: float) -> None:
    import dreambooth

    args = dreambooth.parse_args(argv)
    assert len(records) == args.max_train_steps
    streams = [micro_batches(args.train_batch_size, world=world, rank=r) for r in range(world)]
    for record in records:
        per_rank = [list(itertools.islice(s, args.gradient_accumulation_steps)) for s in streams]
        expected = dreambooth_reference(record, args, per_rank)
        assert_step_matches(record, [e.cpu() for e in expected], rtol=rtol, atol=atol)


DREAMBOOTH = ["--train_text_encoder", "--with_prior_preservation", "--max_train_steps", "3"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--gradient_accumulation_steps", "2", "--max_grad_norm", "1e6"],  # no clipping: it would hide a scale
        ["--gradient_accumulation_steps", "2", "--gradient_checkpointing", "--max_grad_norm", "0.05"],
    ],
    ids=["accumulate2", "accumulate2-checkpointing-clipped"],
)
def test_dreambooth_routed_steps_match_fresh_forwards(extra: list[str]) -> None:
    import dreambooth

    argv = [*DREAMBOOTH, *extra]
    with recorded_steps() as records:
        assert dreambooth.main(argv) == 0
    check_dreambooth(records, argv, rtol=1e-5, atol=1e-7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_launch(tmp_path: Path, recipe: str, argv: list[str], timeout: float = 300.0) -> list[Any]:
    """``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2``: each rank's recorded steps."""
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), str(RECIPES)]),
    }
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(ROOT / "tests" / "integration" / "_recipe_driver.py"), str(tmp_path), recipe, *argv,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.distributed
def test_dreambooth_two_processes_match_full_batch_reference(tmp_path: Path) -> None:
    argv = [*DREAMBOOTH, "--gradient_accumulation_steps", "2", "--max_grad_norm", "1e6"]
    ranks = accelerate_launch(tmp_path, "dreambooth", argv)
    for r0, r1 in zip(*ranks, strict=True):  # DDP: every rank applies the same averaged gradients
        for (_, g0), (_, g1) in zip(r0, r1, strict=True):
            torch.testing.assert_close(g0, g1, rtol=0, atol=0)
    check_dreambooth(ranks[0], argv, world=2, rtol=1e-5, atol=1e-7)
