"""The helpers both commands use: the progress bar (tqdm, on a terminal only)."""

from __future__ import annotations

import io
import sys

import pytest

from gradroute.cli.common import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _advance(bar, n: int) -> None:
    for k in range(n):
        bar.set_postfix_str(f"check s{k}", refresh=False)
        bar.update()
    bar.close()


def test_progress_bar_draws_on_a_terminal() -> None:
    out = _Terminal()
    _advance(progress_bar(3, "bench sd-tiny", file=out), 3)
    text = out.getvalue()
    assert "bench sd-tiny" in text and "3/3" in text and "check s2" in text


@pytest.mark.parametrize(("file", "enabled"), [(io.StringIO(), True), (_Terminal(), False)])
def test_progress_bar_is_quiet_off_a_terminal_or_when_disabled(file: io.StringIO, enabled: bool) -> None:
    _advance(progress_bar(3, "bench", file=file, enabled=enabled), 3)
    assert file.getvalue() == ""


def test_progress_bar_without_tqdm_draws_nothing(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
    _advance(progress_bar(3, "bench"), 3)
    assert capsys.readouterr() == ("", "")
