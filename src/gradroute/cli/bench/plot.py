"""``gradroute bench --plot``: a PNG with median step time (min as a tick) and peak memory per strategy."""

from __future__ import annotations

from typing import Any

from ..choices import INEXACT
from ..common import pyplot


def plot(report: dict[str, Any], path: str) -> None:
    """A PNG with median step time (min as a tick) and peak memory per strategy."""
    plt = pyplot()
    res = report["results"]
    names = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.6))
    y = list(range(len(names)))
    colours = ["tab:green" if s.startswith("gradroute") else "tab:grey" if s in INEXACT else "tab:blue" for s in names]
    for ax, key, label in ((axes[0], "ms", "median step time (ms)"), (axes[1], "peak_mib", "peak memory (MiB)")):
        vals = [res[s].get(key) or 0.0 for s in names]
        ax.barh(y, vals, color=colours)
        if key == "ms":
            mins = [res[s].get("ms_min") for s in names]
            ax.scatter([m or 0.0 for m in mins], y, marker="|", color="k", s=120, label="min", zorder=3)
            ax.legend(loc="lower right")
        for k, s in enumerate(names):
            if "error" in res[s]:
                ax.text(0, k, " crashes", va="center", color="tab:red")
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_xlabel(label)
    fig.suptitle(
        f"gradroute bench: {report['workload']}, batch {report['batch']}, {report['dtype']}, {report['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
