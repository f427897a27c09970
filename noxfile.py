"""The test suite against each supported torch release, one virtualenv per release (``make test-matrix``).

    nox -s "tests(torch='2.6.0')"                               # every column against one release
    nox -R -s "tests(torch='2.5.1')" -- --columns core          # the core test files only, the venv reused
    nox -s refused                                              # the last older release is refused at import
    python tools/versions_table.py --docs docs/versions.md      # the table, from what the sessions wrote

A ``tests`` session installs that torch (the CUDA wheels from the registry; they run on the CPU) and
``-e .[test,demo,diffusers,peft,accelerate,lightning]``, with the library versions pip picks for that torch
(``PINS`` where pip's pick does not run on it), then runs one pytest per column with a JUnit report and writes
``<results>/<torch>.json``: the counts, the examples' library versions, the private APIs that torch has, whether
``gradroute.compile`` prunes compiled regions there (``tools/prune_probe.py``), commit and date. Options after
``--``: ``--columns``, ``--examples {ends,all,none}`` (``ends``: the integration examples at the oldest and the
newest release only), ``--results DIR`` (default ``build/torch-matrix``), ``--drop`` (delete the venv afterwards:
the CUDA builds take about 5 GB each), ``--merge`` (keep a stored record's columns that this run skips).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from versions_table import COLUMNS, report_counts  # noqa: E402

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
EXTRAS = "test,demo,diffusers,peft,accelerate,lightning"
EXAMPLE_LIBS = ("diffusers", "transformers", "peft", "accelerate", "lightning")
#: our machines cap torch through a constraints file; the sessions install exact pins
PIP_ENV = {"PIP_CONSTRAINT": "/dev/null"}

nox.options.sessions = ["tests", "refused"]
nox.options.default_venv_backend = "venv"


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


def _options(posargs: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nox -s tests --")
    p.add_argument("--columns", nargs="*", default=list(COLUMNS), choices=COLUMNS)
    p.add_argument("--examples", choices=("ends", "all", "none"), default="ends")
    p.add_argument("--results", type=Path, default=ROOT / "build" / "torch-matrix")
    p.add_argument("--drop", action="store_true", help="delete the session's venv afterwards")
    p.add_argument("--merge", action="store_true", help="keep a stored record's columns that this run skips")
    return p.parse_args(posargs)


def _probe(session: nox.Session, code: str, *args: str) -> dict | None:
    """The JSON that ``code`` prints last, run by the session's python (None if it failed)."""
    python = Path(session.bin) / "python"
    res = subprocess.run([str(python), *(["-c", code] if code else []), *args], capture_output=True, text=True)
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]) if res.returncode == 0 and lines else None


_VERSIONS = """
import importlib.metadata as m, json, sys
out = {}
for n in sys.argv[1:]:
    try: out[n] = m.version(n)
    except m.PackageNotFoundError: pass
print(json.dumps(out))
"""
# which of the version-dependent private APIs of gradroute._compat this torch has
_PRIVATE_APIS = """
import json, torch, torch._functorch.config as f
print(json.dumps({'SavedTensor.data': hasattr(torch._C._autograd.SavedTensor, 'data'),
    'SavedTensor.unpack': hasattr(torch._C._autograd.SavedTensor, 'unpack'),
    '_get_graph_exec_group': hasattr(torch._C, '_get_graph_exec_group'),
    'donated_buffer': hasattr(f, 'donated_buffer')}))
"""


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src", "tests"], capture_output=True, text=True, cwd=ROOT
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _store(record: dict, results: Path, merge: bool) -> None:
    stored = results / f"{record['torch']}.json"
    if merge and stored.exists():
        old = json.loads(stored.read_text())
        kept = {k: {"commit": old["commit"], **c} for k, c in old.get("columns", {}).items()}
        record["columns"] = {**kept, **record["columns"]}
    stored.write_text(json.dumps(record, indent=1))


@nox.session
@nox.parametrize("torch", SUPPORTED)
def tests(session: nox.Session, torch: str) -> None:
    """The test columns against one torch release; the record goes to ``<results>/<torch>.json``."""
    opts = _options(session.posargs)
    opts.results.mkdir(parents=True, exist_ok=True)
    pins = PINS.get(".".join(torch.split(".")[:2]), ())
    session.install(f"torch=={torch}", *pins, f"-e.[{EXTRAS}]", env=PIP_ENV)
    record: dict = {"torch": torch, "commit": _commit(), "date": dt.date.today().isoformat(), "columns": {}}
    examples = opts.examples == "all" or (opts.examples == "ends" and torch in (SUPPORTED[0], SUPPORTED[-1]))
    for column in opts.columns:
        if column == "examples" and not examples:
            continue
        report = opts.results / f"{torch}-{column.replace(' ', '-')}.xml"
        report.unlink(missing_ok=True)
        args = ["-q", "-p", "no:cacheprovider", f"--junitxml={report}", *column_files(column)]
        session.run("python", "-m", "pytest", *args, success_codes=range(256))
        record["columns"][column] = {**report_counts(report), "commit": record["commit"]}
    record["libraries"] = _probe(session, _VERSIONS, *EXAMPLE_LIBS) or {}
    record["private_apis"] = _probe(session, _PRIVATE_APIS) or {}
    record["prunes_compiled"] = _probe(session, "", str(ROOT / "tools" / "prune_probe.py"))
    _store(record, opts.results, opts.merge)
    if opts.drop:
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)
    failed = {c: n["failed"] for c, n in record["columns"].items() if n["failed"]}
    if failed:
        session.error(f"torch {torch}: failures per column {failed}")


@nox.session
@nox.parametrize("torch", REFUSED)
def refused(session: nox.Session, torch: str) -> None:
    """A release below gradroute's minimum: ``import gradroute`` must fail with the error naming the versions."""
    opts = _options(session.posargs)
    opts.results.mkdir(parents=True, exist_ok=True)
    session.install(f"torch=={torch}", env=PIP_ENV)
    python = Path(session.bin) / "python"
    probe = subprocess.run(
        [str(python), "-c", "import gradroute"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    last = (probe.stderr.strip().splitlines() or [""])[-1]
    ok = probe.returncode != 0 and "gradroute needs torch" in last
    record = {"torch": torch, "commit": _commit(), "date": dt.date.today().isoformat(), "refused": last if ok else None}
    _store(record, opts.results, merge=False)
    if opts.drop:
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)
    if not ok:
        session.error(f"torch {torch}: `import gradroute` was not refused with the clear error: {last!r}")
