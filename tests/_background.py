"""Long runs in other processes, in the background of the test session.

A few tests read what long runs in other processes leave (the benchmark runner's CI subset, the
dry GPU session, peak resident memory in a fresh process, the Trainer's and Fabric's runs on two
processes against DDP's): two of the suite's ten minutes, all of it spent waiting in the test
process, while most of the suite is single-threaded Python (hooks, meta kernels, the simulator)
that leaves the second core idle. So these runs start when the
session does, one after another on a thread of their own at the lowest priority, and the tests
that read them (marked ``background(name)``, given the run's result by conftest's ``background``
fixture) run last. Each run gets a folder of its own and the environment as the session began
(tests change os.environ meanwhile); a failed run fails the tests that read it, with its error.
A test that patches a name every thread sees (``subprocess.Popen`` itself) reaches these runs
too: patch the copy a module under test holds instead (tests/test_gpu_session.py does).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

RUNS: dict = {}  # name -> (run(folder, env, results so far), the runs it reads)


def background_run(name, after=()):
    """Register ``run(folder, env, results)`` as the background run ``name``."""
    def register(run):
        RUNS[name] = (run, tuple(after))
        return run

    return register


class BackgroundRuns:
    """The runs ``names`` (and those they read), started now, one after another."""

    def __init__(self, names, env):
        for name in reversed(list(RUNS)):  # (registered after the runs they read)
            if name in names:
                names = set(names) | set(RUNS[name][1])
        self.names = [n for n in RUNS if n in names]
        self.folder = Path(tempfile.mkdtemp(prefix="protrain-background-"))
        self.results, self.errors, self.stopped = {}, {}, False
        self.done = {name: threading.Event() for name in self.names}
        self.thread = threading.Thread(target=self._run, args=(env,), name="background runs", daemon=True)
        self.thread.start()

    def _run(self, env):
        if hasattr(os, "setpriority"):  # this thread, and the processes it starts: only the cores the tests leave idle
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for name in self.names:
            if self.stopped:
                break
            run, after = RUNS[name]
            try:
                failed = [a for a in after if a in self.errors]
                if failed:
                    raise RuntimeError(f"the background run {name!r} reads {failed}, which failed")
                (self.folder / name).mkdir()
                self.results[name] = run(self.folder / name, env, self.results)
            except Exception as e:  # noqa: BLE001 - given to the tests that read the run
                self.errors[name] = e
            finally:
                self.done[name].set()

    def result(self, name, timeout=1800):
        assert self.done[name].wait(timeout), f"the background run {name!r} still runs after {timeout} s"
        if name in self.errors:
            raise AssertionError(f"the background run {name!r} failed: {self.errors[name]}") from self.errors[name]
        return self.results[name]

    def stop(self):
        """At the session's end (an interrupt, ``-x``): no further run starts, and the one running
        ends with the processes this one started (on Linux; elsewhere they end on their own)."""
        self.stopped = True
        if self.thread.is_alive() and os.path.isdir("/proc"):
            for pid in _descendants(os.getpid()):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            shutil.rmtree(self.folder, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc), deepest first."""
    parents = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
    below, level = [], [pid]
    while level:
        level = [p for p, parent in parents.items() if parent in level]
        below = level + below
    return below
