"""The supported-versions table of ``docs/versions.md``, from the records the ``noxfile.py`` sessions write.

    nox -s tests refused                                        # what `make test-matrix` runs
    python tools/versions_table.py --docs docs/versions.md      # the table from the stored results

Each record (``<results>/<torch>.json``, with one JUnit report per column) becomes one row: ``passed/failed/skipped``
per column (``-`` not run), whether compiled regions are pruned, the version-dependent private APIs that torch has,
the examples' library versions, commit and date. The table goes to ``<results>/table.md`` and, with ``--docs``,
between the markers of that page.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("core", "checkpoint", "generated graphs", "examples", "distributed")
START, END = "<!-- torch-matrix:start -->", "<!-- torch-matrix:end -->"


def report_counts(report: Path) -> dict[str, int]:
    """passed/failed/skipped/xfailed of a JUnit report (no report: one failure, pytest did not get that far)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    if not report.exists():
        counts["failed"] = 1
        return counts
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag: child.get("type", "") for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed"] += 1
        elif kinds.get("skipped") == "pytest.xfail":
            counts["xfailed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def cell(record: dict, column: str) -> str:
    c = record.get("columns", {}).get(column)
    if c is None:
        return "-"
    xfailed = f" ({c['xfailed']} xfail)" if c.get("xfailed") else ""
    return f"{c['passed']}/{c['failed']}/{c['skipped']}{xfailed}"


def row(record: dict) -> list[str]:
    """A record's cells: the columns, the version-dependent private APIs it has, the libraries, commit and date."""
    if "refused" in record:
        first = "refused at import, with the clear error" if record["refused"] else "**not refused as expected**"
        cells = [first] + [""] * (len(COLUMNS) - 1)
    elif "error" in record:
        cells = [record["error"]] + [""] * (len(COLUMNS) - 1)
    else:
        cells = [cell(record, c) for c in COLUMNS]
    apis = ", ".join(k for k, v in record.get("private_apis", {}).items() if v) or "-"
    probe = record.get("prunes_compiled")
    prunes = (
        "-"
        if "prunes_compiled" not in record
        else "probe failed"
        if probe is None
        else "yes"
        if probe["prunes"]
        else "no"
    )
    libs = ", ".join(f"{k} {v}" for k, v in record.get("libraries", {}).items()) or "-"
    commits = sorted({c.get("commit", record["commit"]) for c in record.get("columns", {}).values()})
    return [
        record["torch"],
        *cells,
        prunes,
        apis,
        libs,
        f"{' / '.join(commits or [record['commit']])}, {record['date']}",
    ]


def table(results: Path) -> str:
    records = [json.loads(f.read_text()) for f in results.glob("*.json")]
    for r in records:  # counted again from the reports (records from before xfails were told apart)
        for column, counts in r.get("columns", {}).items():
            report = results / f"{r['torch']}-{column.replace(' ', '-')}.xml"
            if report.exists() and not counts.get("timed_out"):
                counts.update(report_counts(report))
    records.sort(key=lambda r: tuple(int(x) for x in re.findall(r"\d+", r["torch"])))
    head = [
        "torch",
        *COLUMNS,
        "prunes compiled regions",
        "has (private APIs)",
        "libraries (pip's pick)",
        "commit, date",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in records]
    legend = (
        "Cells: passed/failed/skipped (xfail: a test the suite marks as an expected failure); `-`: not run. "
        "Prunes compiled regions: `tools/prune_probe.py` with that torch measured a routed backward through "
        "`gradroute.compile` (aot_eager) modules at the eager routed backward's FLOPs, below `torch.compile`'s, "
        "with the eager gradients."
    )
    return "\n".join(lines) + "\n\n" + legend + "\n"


def update_page(page: Path, text: str) -> None:
    """Replace what lies between the page's markers with ``text``."""
    body = page.read_text()
    start, end = body.index(START) + len(START), body.index(END)
    page.write_text(body[:start] + "\n" + text + body[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "build" / "torch-matrix")
    p.add_argument("--docs", type=Path, help="also replace the table between the markers of this page")
    args = p.parse_args(argv)
    if not list(args.results.glob("*.json")):
        p.error(f"`--results`: no records in {args.results} (run the nox sessions first)")
    text = table(args.results)
    (args.results / "table.md").write_text(text)
    print(text)
    if args.docs:
        update_page(args.docs, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
