"""Helpers both commands use: the device and precision they run on, the relative error they report, pyplot,
the progress bar."""

from __future__ import annotations

import contextlib
import math
from typing import IO, Any

import torch

#: autocast dtype per ``--dtype`` (fp32: no autocast)
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> CUDA if available, else CPU; anything else must name an available device.

    Raises:
        ValueError: an unknown or unavailable device.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"`--device` must be auto, cpu or cuda[:N], got {spec!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"`--device` must be auto, cpu or cuda[:N], got {spec!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`--device {spec}`: CUDA is not available (torch {torch.__version__})")
    return dev


def resolve_dtype(spec: str, dev: torch.device, *, cuda_default: str) -> str:
    """``--dtype``: ``auto`` -> ``cuda_default`` on CUDA, fp32 on the CPU.

    Raises:
        ValueError: fp16 on the CPU.
    """
    dtype = spec if spec != "auto" else (cuda_default if dev.type == "cuda" else "fp32")
    if dtype == "fp16" and dev.type != "cuda":
        raise ValueError("`--dtype fp16` needs `--device cuda` (use bf16 or fp32 on CPU)")
    return dtype


def autocast(dev: torch.device, dtype: str) -> Any:
    """``torch.autocast`` for ``dtype`` (one of ``AMP_DTYPES``); no context at all for fp32."""
    amp = AMP_DTYPES[dtype]
    return contextlib.nullcontext() if amp is None else torch.autocast(dev.type, dtype=amp)


def rel_error(got: list[torch.Tensor | None], ref: list[torch.Tensor]) -> float:
    """Relative L2 error of a list of gradients (``None`` counts as zero) against a reference, in float64."""
    num = den = 0.0
    for g, r in zip(got, ref):
        r64 = r.detach().double()
        d = r64 if g is None else g.detach().double() - r64
        num += float(d.square().sum())
        den += float(r64.square().sum())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def has_matplotlib() -> bool:
    """Whether matplotlib can be imported (the plots are optional)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


class _NoBar:
    """The part of ``tqdm``'s interface the commands use, doing nothing (tqdm is not installed)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, *, enabled: bool = True, file: IO[str] | None = None) -> Any:
    """A ``tqdm`` progress bar on ``file`` (stderr by default), drawn only where that is a terminal and the
    command is ``enabled`` (tqdm's ``disable=None``: nothing in logs and pipes); a bar that draws nothing without
    tqdm (``pip install 'gradroute[demo]'``), which no command needs."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, file=file, disable=None if enabled else True, dynamic_ncols=True)
