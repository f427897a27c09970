"""BENCHMARKS.md is generated from benchmarks/results/*.json by benchmarks/render.py: it cannot go stale."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _render_module():
    spec = importlib.util.spec_from_file_location("benchmarks_render", ROOT / "benchmarks" / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_benchmarks_md_is_what_the_records_render_to():
    render = _render_module()
    expected = render.render(render.load())
    assert (ROOT / "BENCHMARKS.md").read_text() == expected, "BENCHMARKS.md is stale: run `make benchmarks-md`"


def test_every_measured_record_says_where_and_how_it_was_measured():
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("rows"):
            for key in ("command", "hardware", "torch", "commit", "date", "metric", "columns"):
                assert record.get(key), f"{path.name}: `{key}` is empty"
            assert all(len(row) == len(record["columns"]) for row in record["rows"]), path.name
        else:
            assert record.get("why"), f"{path.name}: a record without figures says why in `why`"


def test_a_record_missing_a_required_field_is_refused(tmp_path: Path):
    render = _render_module()
    (tmp_path / "r.json").write_text(json.dumps({"title": "t", "order": 1}))
    with pytest.raises(ValueError, match=r"r\.json: missing section"):
        render.load(tmp_path)
