"""The recipes of docs/integrations.md (docs/recipes/), run as written, against independent references.

Each run records what the optimizer is about to apply at every real step (``_recipes.recorded_steps``); the
reference for the step starts from the recorded parameters and takes a fresh forward per loss and
``torch.autograd.grad`` on every micro-batch. AdamW would hide a gradient scale (its update is nearly
scale-invariant), so the gradients themselves are compared, not the trained weights.
"""

from __future__ import annotations

import itertools
import os
import re
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


def recipe_reference(record: Any, name: str, argv: list[str], batches_per_rank: Any, device: str = "cpu") -> Any:
    """The reference gradients of one step of recipe ``name`` (both networks trained, the optimizer over the
    UNet's parameters, then the text encoder's), under the recipe's autocast."""
    import importlib

    import text_to_image
    import tiny

    recipe = importlib.import_module(name)
    args = recipe.parse_args(argv)
    settings = recipe_settings(name, argv)
    tenc, unet, noise_scheduler = tiny.models()
    tenc, unet = tenc.to(device), unet.to(device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(settings["precision"])
    autocast = torch.autocast(device, dtype=dtype, enabled=dtype is not None)

    def forward(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast:
            if name == "dreambooth":
                loss_tenc, loss_unet = recipe.compute_losses(tenc, unet, noise_scheduler, batch, args)
            else:  # text_to_image, and torch_loop (which uses text_to_image's losses)
                loss_tenc, loss_unet = text_to_image.compute_losses(tenc, unet, noise_scheduler, batch)
        return {"tenc": loss_tenc, "unet": loss_unet}

    return reference_step(
        record,
        [*unet.parameters(), *tenc.parameters()],
        {"tenc": list(tenc.parameters()), "unet": list(unet.parameters())},
        forward,
        batches_per_rank,
        accumulation=settings["accumulation"],
        max_grad_norm=args.max_grad_norm,
    )


def recipe_settings(name: str, argv: list[str]) -> dict[str, Any]:
    """Accumulation, batch size, steps and precision of a recipe run (the plain loop names them its own way)."""
    import importlib

    args = importlib.import_module(name).parse_args(argv)
    if name == "torch_loop":
        return {
            "accumulation": args.accumulation,
            "batch": args.batch_size,
            "steps": args.max_steps,
            "precision": args.amp,
        }
    return {
        "accumulation": args.gradient_accumulation_steps,
        "batch": args.train_batch_size,
        "steps": args.max_train_steps,
        "precision": args.mixed_precision,
    }


def check_recipe(
    records: list[Any], name: str, argv: list[str], *, world: int = 1, rtol: float, atol: float, device: str = "cpu"
) -> None:
    settings = recipe_settings(name, argv)
    assert len(records) == settings["steps"]
    streams = [micro_batches(settings["batch"], world=world, rank=r) for r in range(world)]
    for record in records:
        per_rank = [list(itertools.islice(s, settings["accumulation"])) for s in streams]
        expected = recipe_reference(record, name, argv, per_rank, device)
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
    check_recipe(records, "dreambooth", argv, rtol=1e-5, atol=1e-7)


TEXT_TO_IMAGE = ["--train_text_encoder", "--max_train_steps", "2", "--max_grad_norm", "1e6"]


@pytest.mark.parametrize(
    ("extra", "tol"),
    [(["--gradient_accumulation_steps", "2"], 1e-5), (["--mixed_precision", "bf16"], 2e-2)],
    ids=["accumulate2", "bf16"],
)
def test_text_to_image_routed_steps_match_fresh_forwards(extra: list[str], tol: float) -> None:
    import text_to_image

    argv = [*TEXT_TO_IMAGE, *extra]
    with recorded_steps() as records:
        assert text_to_image.main(argv) == 0
    check_recipe(records, "text_to_image", argv, rtol=tol, atol=tol * 1e-2)


# ==================================================================================================== plain torch

TORCH_LOOP = ["--accumulation", "2", "--max_steps", "2", "--max_grad_norm", "1e6"]


@pytest.mark.parametrize("extra", [[], ["--gradient_checkpointing", "--max_grad_norm", "0.05"]], ids=["plain", "ckpt"])
def test_torch_loop_routed_steps_match_fresh_forwards(extra: list[str]) -> None:
    import torch_loop

    argv = [*TORCH_LOOP, *extra]
    with recorded_steps() as records:
        assert torch_loop.main(argv) == 0
    check_recipe(records, "torch_loop", argv, rtol=1e-5, atol=1e-7)


def _torch_loop_worker(rank: int, world: int, argv: list[str]) -> None:
    import torch_loop

    with recorded_steps() as records:
        assert torch_loop.main(argv) == 0
    if rank == 0:
        check_recipe(records, "torch_loop", argv, world=world, rtol=1e-5, atol=1e-7)


@pytest.mark.distributed
def test_torch_loop_two_processes_match_full_batch_reference() -> None:
    from tests.distributed._worker import launch

    launch(_torch_loop_worker, TORCH_LOOP, timeout=300.0)


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
    check_recipe(ranks[0], "dreambooth", argv, world=2, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Accelerate's fp16 GradScaler path needs a GPU (none on CPU)")
def test_dreambooth_fp16_scaler_on_cuda() -> None:
    import dreambooth

    argv = [*DREAMBOOTH, "--gradient_accumulation_steps", "2", "--max_grad_norm", "1e6", "--mixed_precision", "fp16"]
    with recorded_steps() as records:
        assert dreambooth.main(argv) == 0
    check_recipe(records, "dreambooth", argv, rtol=2e-2, atol=1e-4, device="cuda")


# ========================================================================================= docs/integrations.md

DOC = ROOT / "docs" / "integrations.md"


def excerpts() -> list[tuple[Path, list[str]]]:
    """``(file, chunks)`` for every python block of the doc whose first line names a file (``# path``);
    ``...`` lines separate the chunks."""
    out = []
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        first, _, body = block.partition("\n")
        assert first.startswith("# ") and (ROOT / first[2:]).is_file(), f"excerpt without its file: {first!r}"
        chunks = re.split(r"^\s*\.\.\.\s*$\n?", body, flags=re.M)
        out.append((ROOT / first[2:], [c for c in chunks if c.strip()]))
    return out


def test_integrations_doc_excerpts_are_cut_from_their_files() -> None:
    blocks = excerpts()
    assert {p.name for p, _ in blocks} >= {
        "dreambooth.py",
        "text_to_image.py",
        "torch_loop.py",
        "accelerate_train.py",
        "lightning_train.py",
    }
    for path, chunks in blocks:
        text, at = path.read_text(), 0
        for chunk in chunks:
            found = text.find(chunk, at)
            assert found >= 0, f"{path.name}: this excerpt is not in the file (in this order):\n{chunk}"
            at = found + len(chunk)


@pytest.mark.parametrize("recipe", ["dreambooth", "text_to_image", "torch_loop"])
def test_integrations_doc_shows_every_changed_line(recipe: str) -> None:
    shown = DOC.read_text()
    lines = (RECIPES / f"{recipe}.py").read_text().splitlines()
    marked = [line for line in lines if re.search(r"  # gradroute(:|$)", line)]
    assert marked
    for line in marked:
        assert line in shown, f"{recipe}.py: a line marked # gradroute is not in docs/integrations.md:\n{line}"
    assert f"recipes/{recipe}.py" in shown
    assert f"import {recipe}" in Path(__file__).read_text()  # and a test here runs it


def test_readme_points_to_integrations() -> None:
    assert "docs/integrations.md" in (ROOT / "README.md").read_text()
