"""Run the test suite against several torch releases, each in a venv of its own, and write the table.

    python tools/torch_matrix.py --versions 2.5.1 2.15.0            # what `make test-matrix` runs, for two
    python tools/torch_matrix.py --versions 2.6.0 --keep            # `make test-torch TORCH_SPEC=torch==2.6.0`
    python tools/torch_matrix.py --table-only --readme docs/versions.md    # the docs table from the stored results

For each version: a venv ``<cache>/venv-<version>`` with that torch and ``-e .[test,demo,...]`` with the
libraries of the integration examples (``pip`` picks their versions for that torch), then one
pytest run per column (core, checkpoint, generated graphs, examples, distributed) with a JUnit report, and
a JSON record ``<results>/<version>.json`` (counts, library versions, the private APIs that torch has,
whether it prunes compiled regions as ``tools/prune_probe.py`` measures it, commit, date, time taken). A version
below gradroute's minimum is checked for the clear error at import instead. The venv is deleted afterwards
unless ``--keep`` (the CUDA builds take about 5 GB each). Downloads go through ``<cache>/pip``
(``PIP_CACHE_DIR``). One version at a time: the CPU is the bottleneck.

The table: one row per version, ``passed/failed/skipped`` per column (``-`` not run), and the examples'
library versions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: every torch minor release in the registry from gradroute's minimum (latest patch), then the last refused one
SUPPORTED = ("2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
REFUSED = ("2.4.1",)
#: what pip would pick but does not run on that torch (undeclared by the library): the newest that does
PINS = {
    # diffusers 0.41 and transformers 5.19 read torch.accelerator (torch 2.6+) when imported; transformers 4
    # cannot run CLIP in float64 (its causal mask overflows), which the tests do; from 5.2 transformers wraps
    # its models' forward in utils/output_capturing.py (a module that imports torch for type checking only),
    # and under torch 2.5's dynamo that frame raises "NameError: name 'torch' is not defined" (torch.compile of
    # CLIP; 5.1 runs it); 5.18 also calls torch.compiler.is_exporting (torch 2.6+) in code dynamo traces
    "2.5": ("diffusers<0.41", "transformers>=5,<5.2"),
}
COLUMNS = ("core", "checkpoint", "generated graphs", "examples", "distributed")
EXAMPLE_LIBS = ("diffusers", "transformers", "peft", "accelerate", "lightning")
START, END = "<!-- torch-matrix:start -->", "<!-- torch-matrix:end -->"


def column_files(column: str) -> list[str]:
    """The test files of a column, found by name so that moved or new test files land in one."""
    tests = ROOT / "tests"
    if column == "examples":
        return ["tests/integration"]
    if column == "distributed":
        return ["tests/distributed"]
    files = sorted(
        p.relative_to(ROOT).as_posix()
        for p in tests.rglob("test_*.py")
        if not {"integration", "distributed"} & set(p.relative_to(tests).parts)
    )
    if column == "checkpoint":
        return [f for f in files if "checkpoint" in f]
    if column == "generated graphs":
        return [f for f in files if "generated" in f]
    return [f for f in files if "checkpoint" not in f and "generated" not in f]


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"timed out after {timeout} s\n")
            return 124


def pip_env(cache: Path) -> dict[str, str]:
    # PIP_CONSTRAINT: our machines cap torch through a constraints file; the matrix installs exact pins
    return {**os.environ, "PIP_CACHE_DIR": str(cache / "pip"), "PIP_CONSTRAINT": "/dev/null"}


def install(version: str, venv: Path, extras: str, cache: Path, log: Path) -> bool:
    if not (venv / "bin" / "python").exists() and run([sys.executable, "-m", "venv", str(venv)], log):
        return False
    py = str(venv / "bin" / "python")
    spec = f"-e.[{extras}]" if extras else None
    pins = PINS.get(".".join(version.split(".")[:2]), ()) if extras else ()
    cmd = [py, "-m", "pip", "install", "-q", f"torch=={version}", *pins] + ([spec] if spec else [])
    return run(cmd, log, env=pip_env(cache)) == 0


def pytest_counts(py: str, files: list[str], report: Path, log: Path, timeout: float) -> dict[str, int]:
    report.unlink(missing_ok=True)
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
    rc = run(cmd, log, timeout=timeout)
    counts = report_counts(report)
    if rc == 124:
        counts["failed"] += 1
        counts["timed_out"] = 1
    return counts


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


def versions_of(py: str, names: tuple[str, ...]) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    res = subprocess.run([py, "-c", code, *names], capture_output=True, text=True, cwd=ROOT)
    return json.loads(res.stdout) if res.returncode == 0 else {}


def private_apis(py: str) -> dict[str, bool]:
    """Which of the version-dependent private APIs of ``gradroute._compat`` this torch has."""
    code = (
        "import json, torch, torch._functorch.config as f, gradroute._compat as c\n"
        "print(json.dumps({'SavedTensor.data': hasattr(torch._C._autograd.SavedTensor, 'data'),\n"
        "    'SavedTensor.unpack': hasattr(torch._C._autograd.SavedTensor, 'unpack'),\n"
        "    '_get_graph_exec_group': hasattr(torch._C, '_get_graph_exec_group'),\n"
        "    'donated_buffer': hasattr(f, 'donated_buffer')}))"
    )
    res = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return json.loads(res.stdout) if res.returncode == 0 else {}


def prunes_compiled(py: str) -> dict | None:
    """``tools/prune_probe.py`` run with this torch: whether routed passes through ``gradroute.compile`` skip the
    weight gradients they do not need (``{"prunes": bool, "why": str}``), None if the probe itself failed."""
    res = subprocess.run([py, str(ROOT / "tools" / "prune_probe.py")], capture_output=True, text=True, cwd=ROOT)
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]) if res.returncode == 0 and lines else None


def commit() -> str:
    """The commit tested (``GRADROUTE_MATRIX_COMMIT`` when run from an exported copy of it)."""
    if os.environ.get("GRADROUTE_MATRIX_COMMIT"):
        return os.environ["GRADROUTE_MATRIX_COMMIT"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src", "tests"], capture_output=True, text=True, cwd=ROOT
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def check_version(version: str, args: argparse.Namespace) -> dict:
    """Install ``version``, run the columns, return the record."""
    cache, results = args.cache, args.results
    venv = cache / f"venv-{version}"
    log = results / f"{version}.log"
    log.unlink(missing_ok=True)
    record: dict = {"torch": version, "commit": commit(), "date": dt.date.today().isoformat(), "columns": {}}
    started = time.monotonic()
    refused = version in REFUSED
    examples = not refused and (args.examples == "all" or (args.examples == "ends" and version in args.ends))
    # the examples' libraries everywhere: some core and checkpoint tests use diffusers and transformers
    extras = "" if refused else "test,demo,diffusers,peft,accelerate,lightning"
    if not install(version, venv, extras, cache, log):
        record["error"] = "install failed (see the log)"
        return record
    record["install_s"] = round(time.monotonic() - started)
    py = str(venv / "bin" / "python")
    if refused:
        probe = subprocess.run(
            [py, "-c", "import gradroute"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": "src"},
        )
        last = (probe.stderr.strip().splitlines() or [""])[-1]
        record["refused"] = last if probe.returncode and "gradroute needs torch" in last else None
    else:
        for column in args.columns:
            if column == "examples" and not examples:
                continue
            t0 = time.monotonic()
            report = results / f"{version}-{column.replace(' ', '-')}.xml"
            counts = pytest_counts(py, column_files(column), report, log, args.timeout)
            record["columns"][column] = {**counts, "seconds": round(time.monotonic() - t0), "commit": record["commit"]}
        record["libraries"] = versions_of(py, EXAMPLE_LIBS)
        record["private_apis"] = private_apis(py)
        record["prunes_compiled"] = prunes_compiled(py)
    record["seconds"] = round(time.monotonic() - started)
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
    return record


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


def update_readme(readme: Path, text: str) -> None:
    body = readme.read_text()
    start, end = body.index(START) + len(START), body.index(END)
    readme.write_text(body[:start] + "\n" + text + body[end:])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--versions", nargs="*", default=None, help="torch versions (default: every supported + refused)")
    p.add_argument("--columns", nargs="*", default=list(COLUMNS), choices=COLUMNS)
    p.add_argument(
        "--examples", choices=("ends", "all", "none"), default="ends", help="where the integration examples run"
    )
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "gradroute-matrix")
    p.add_argument("--results", type=Path, default=ROOT / "build" / "torch-matrix")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per pytest run")
    p.add_argument("--keep", action="store_true", help="keep each version's venv")
    p.add_argument("--table-only", action="store_true", help="only write the table from the stored results")
    p.add_argument("--readme", type=Path, help="also replace the table between the README's markers")
    p.add_argument("--merge", action="store_true", help="keep a version's stored columns that this run skips")
    args = p.parse_args(argv)
    args.versions = [v.removeprefix("torch==") for v in (args.versions or [*REFUSED, *SUPPORTED])]
    for v in args.versions:
        if not re.fullmatch(r"\d+\.\d+\.\d+", v):
            p.error(f"`--versions`: exact releases such as 2.6.0 or torch==2.6.0, got {v!r}")
    args.ends = {SUPPORTED[0], SUPPORTED[-1]}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    bad = 0
    if not args.table_only:
        for version in args.versions:
            print(f"torch {version} ...", flush=True)
            record = check_version(version, args)
            stored = args.results / f"{version}.json"
            if args.merge and stored.exists():
                old = json.loads(stored.read_text())
                kept = {k: {"commit": old["commit"], **c} for k, c in old.get("columns", {}).items()}
                record["columns"] = {**kept, **record["columns"]}
            stored.write_text(json.dumps(record, indent=1))
            failed = "error" in record or record.get("refused", "") is None
            failed |= any(c["failed"] for c in record["columns"].values())
            bad += failed
            print(f"torch {version}: {'FAILED' if failed else 'ok'} {json.dumps(record['columns'])}", flush=True)
    text = table(args.results)
    (args.results / "table.md").write_text(text)
    print(text)
    if args.readme:
        update_readme(args.readme, text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
