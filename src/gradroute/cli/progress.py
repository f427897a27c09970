"""A one-line text progress bar for the commands (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    """A one-line text progress bar: rewritten in place on a terminal, else a line every 10%.

    Example:
        >>> p = Progress(10, "demo", enabled=False)
        >>> p.update(1, "step 1")
        >>> p.close()
    """

    def __init__(
        self, total: int, label: str, *, stream: IO[str] | None = None, enabled: bool = True, width: int = 24
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0
        self._last_decile = -1
        self._len = 0
        self._start = time.perf_counter()

    def update(self, n: int = 1, text: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if not self.enabled:
            return
        if self.tty:
            self._redraw(text)
        else:
            self._line_per_decile(text)

    def _redraw(self, text: str) -> None:
        now = time.perf_counter()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        fill = round(self.width * self.done / self.total)
        line = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {self.done}/{self.total} {text}"
        pad = max(0, self._len - len(line))
        self._len = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def _line_per_decile(self, text: str) -> None:
        decile = 10 * self.done // self.total
        if decile != self._last_decile:
            self._last_decile = decile
            elapsed = time.perf_counter() - self._start
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({elapsed:.0f} s) {text}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
