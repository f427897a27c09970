"""BENCHMARKS.md, generated from the measurement records in ``benchmarks/results/*.json``.

    python benchmarks/render.py            # rewrite BENCHMARKS.md (what `make benchmarks-md` runs)
    python benchmarks/render.py --check    # exit 1 if BENCHMARKS.md is not what the records give

One record per measurement (a table): ``section``, ``order`` (its place), ``title``, ``workload``, ``regime``,
``command`` (one per line), ``hardware``, ``torch``, ``commit``, ``date``, optional ``conditions``; the figures
as ``metric``, ``columns`` and ``rows``; optional ``target`` and ``notes``. A record without ``rows`` is a
measurement still to make: it goes to the "Not measured yet" list with its ``why``. To update a figure, edit or
replace its record (the raw outputs of ``benchmarks/run.sh`` and ``benchmarks/gpu.sh`` go to ``build/benchmarks``)
and run ``make benchmarks-md``; ``tests/test_benchmarks_md.py`` fails while BENCHMARKS.md differs from this
script's output. The strategies and the method, the fixed part, are in ``benchmarks/head.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TARGET = ROOT / "BENCHMARKS.md"
REQUIRED = ("section", "order", "title", "workload", "regime", "command", "hardware", "torch", "commit", "date")

#: the fixed part: the strategies and the method
HEAD = ROOT / "benchmarks" / "head.md"


def load(results: Path = RESULTS) -> list[dict]:
    """Every record, in the order they are shown; a record missing a required field is an error."""
    records = []
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ValueError(f"{path.name}: missing {', '.join(missing)}")
        records.append(record)
    return sorted(records, key=lambda r: (r["order"], r["title"]))


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _commands(command: str) -> str:
    return "; ".join(f"`{line}`" for line in command.splitlines())


def measured(record: dict) -> list[str]:
    """One measurement: title, where and how, the table, then target and notes in one paragraph."""
    commit = re.sub(r"\b[0-9a-f]{7,40}\b", r"`\g<0>`", record["commit"])
    where = [commit, record["date"], f"torch {record['torch']}", record["hardware"]]
    if record.get("conditions"):
        where.append(record["conditions"])
    about = (
        f"**{record['title']}.** {record['workload']}, {record['regime']}: {record['metric']}. "
        f"Measured at {', '.join(where)}. Command: {_commands(record['command'])}"
    )
    after = ([f"Target: {record['target']}."] if record.get("target") else []) + record.get("notes", [])
    lines = [about, "", *_table(record["columns"], record["rows"]), ""]
    return lines + ([" ".join(after), ""] if after else [])


def pending(record: dict) -> str:
    """One line of the "Not measured yet" list."""
    return (
        f"- **{record['title']}** ({record['regime']}; {record['hardware']}): {record['why']}. "
        f"Command: {_commands(record['command'])}"
    )


def render(records: list[dict]) -> str:
    lines = HEAD.read_text().splitlines()
    section = None
    for record in (r for r in records if r.get("rows")):
        if record["section"] != section:
            section = record["section"]
            lines += ["", f"## {section}", ""]
        lines += measured(record)
    todo = [pending(r) for r in records if not r.get("rows")]
    if todo:
        lines += ["", "## Not measured yet", "", *todo]
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md differs from the records")
    p.add_argument("--output", type=Path, default=TARGET)
    args = p.parse_args(argv)
    text = render(load())
    if args.check:
        same = args.output.exists() and args.output.read_text() == text
        print(f"{args.output.name} is {'up to date' if same else 'stale: run `make benchmarks-md`'}")
        return 0 if same else 1
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
