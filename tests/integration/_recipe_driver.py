"""Run a recipe under ``accelerate launch`` and save what each process's optimizer applied at every step.

``python tests/integration/_recipe_driver.py OUT_DIR RECIPE [recipe arguments...]`` writes ``OUT_DIR/rank<R>.pt``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import torch  # noqa: E402

from tests.integration._recipes import recorded_steps  # noqa: E402


def main() -> int:
    out, name, *argv = sys.argv[1:]
    torch.set_num_threads(1)
    recipe = importlib.import_module(name)
    with recorded_steps() as records:
        code = recipe.main(argv)
    torch.save(records, Path(out) / f"rank{os.environ.get('RANK', '0')}.pt")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
