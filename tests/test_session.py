"""Routing state is per call: concurrent routed backwards and plain backwards in other threads.

Two routers train two independent model pairs (each with ``gradroute.checkpoint`` segments) from two threads
while the main thread runs plain backwards through ``gradroute.checkpoint`` (``tests/_threaded_routing.py``, in a
process of its own: NOTE [Why the threaded test runs in a process of its own] there). Every routed backward
must be exact, every plain backward must recompute its segment exactly once, and when the threads are done no
routing session may be left current or alive (the leak the issue reported: a session left current after two
overlapping calls, whose pending callbacks grew by one on every later plain backward).
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradroute
from gradroute import _checkpoint, _session
from tests._threaded_routing import pair

D = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def _stacks_of(pid: int) -> str:
    """Every thread's C stack of process ``pid`` (gdb, where it is installed and may attach), else why not."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb for the C stacks)"
    try:
        run = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "(gdb did not answer in 60 s)"
    return run.stdout[-20000:] + run.stderr[-2000:]


def _run_threaded_scenario() -> dict:
    """The scenario's JSON result; a hang fails the test with every thread's Python and C stacks (it takes
    seconds; its Python stacks are on its stderr from 80 s, gdb adds the C stacks at 100 s)."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests._threaded_routing"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = child.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        stacks = _stacks_of(child.pid)
        child.kill()
        err = child.communicate()[1]
        pytest.fail(f"the threaded scenario hung; its stacks:\n{err[-6000:]}\nC stacks (gdb):\n{stacks[-8000:]}")
    assert child.returncode == 0, f"the threaded scenario failed ({child.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def test_concurrent_routed_backwards_and_plain_backwards_leave_nothing_behind() -> None:
    result = _run_threaded_scenario()
    assert result["hung"] == 0, "a training thread still ran after 60 s (stacks in the scenario's stderr)"
    assert result["errors"] == []
    assert min(result["steps"]) >= 20
    # the calls did overlap: routed with routed, plain with routed
    assert result["routed_overlapping"] > 0
    assert result["plain_overlapping"] > 0
    assert result["recomputations"] == [2]  # 1 forward + 1 recomputation, in every plain backward
    assert result["recomputations_after"] == [2] * 5
    assert result["session_left"] is False
    assert result["sessions_alive"] == 0


def _device_thread_sessions(*, segment: bool) -> list[tuple[object, object]]:
    """What ``_session.current()`` answers on a simulated device thread (no thread-local session) in the
    unpacks of a routed backward, with the local session for comparison; ``segment``: ``b`` runs in a
    ``gradroute.checkpoint`` segment."""
    a, b = pair(0)
    seen: list[tuple[object, object]] = []

    def unpack(x: torch.Tensor) -> torch.Tensor:  # where gradroute.checkpoint asks for the session
        local = _session._local.session
        _session._local.session = None  # as on autograd's device threads
        try:
            seen.append((_session.current(), local))
        finally:
            _session._local.session = local
        return x

    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, unpack):
        h = a(torch.randn(4, 6, dtype=D))
        out = gradroute.checkpoint(b, h) if segment else b(h)
    gradroute.Router(a=a, b=b).backward(a=out.pow(2).mean(), b=out.abs().mean())
    assert _session.current() is None
    return seen


def test_engine_threads_find_the_routed_call_by_graph_task() -> None:
    """A device thread (CUDA work) has no thread-local session: while a gradroute.checkpoint segment is alive
    (its unpacks are what asks), it finds the call by its graph task."""
    seen = _device_thread_sessions(segment=True)
    assert len(seen) > 2
    assert all(found is local is not None for found, local in seen)


def test_engine_threads_are_not_watched_without_a_live_segment() -> None:
    """No gradroute.checkpoint segment alive anywhere: nothing would ask, so no session is opened at all, neither
    the engine calls' pre-hooks nor the calling thread's record (a host cost per backward)."""
    gc.collect()  # segments of earlier tests
    assert not _checkpoint.maybe_live(), "a segment of an earlier test is still alive"
    seen = _device_thread_sessions(segment=False)
    assert len(seen) > 4
    assert all(found is None and local is None for found, local in seen)
