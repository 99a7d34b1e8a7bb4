"""The pytest plugin of the Lightning conformance runner (``run.py`` loads it into Lightning's
own test session with ``-p plugin``): it records every test's outcome, and with
``PROTRAIN_CONFORMANCE_FORCE=1`` it makes the strategy ProTrain wherever a test leaves the
choice to Lightning.

"Leaves the choice to Lightning" means ``strategy="auto"`` -- the argument's default -- for
``Trainer`` and ``Fabric``. A test that names a strategy (``"ddp"``, ``"deepspeed"``, an
instance) tests that strategy and keeps it: forcing ProTrain there would measure nothing about
ProTrain.

Each test's record, one JSON line in ``PROTRAIN_CONFORMANCE_OUT``: its node id, outcome
(passed, failed, error, skipped), the setup/call phase it failed in, the exception's type and
first line, the innermost frame (file and line), whether the exception was raised inside
``lightning_protrain``/``protrain_core`` (and by which statement), and how many Trainers and
Fabrics were forced to ProTrain while it ran.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import traceback

import pytest

FORCE = os.environ.get("PROTRAIN_CONFORMANCE_FORCE") == "1"
OUT = os.environ.get("PROTRAIN_CONFORMANCE_OUT")
OURS = ("lightning_protrain", "protrain_core")
forced = {"count": 0}


def _force(cls) -> None:
    """Wrap ``cls.__init__`` so that ``strategy="auto"`` (given or left out) becomes "protrain"."""
    init = cls.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)  # Lightning reads the signature (its PL_TRAINER_* environment defaults)
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind_partial(self, *args, **kwargs)
        except TypeError:  # bad arguments: Lightning's own error, as without the plugin
            return init(self, *args, **kwargs)
        if bound.arguments.get("strategy", "auto") == "auto":
            bound.arguments["strategy"] = "protrain"
            forced["count"] += 1
        init(*bound.args, **bound.kwargs)

    cls.__init__ = __init__


def pytest_configure(config) -> None:
    if FORCE:
        import lightning.fabric
        import lightning.pytorch

        import lightning_protrain

        lightning_protrain.register()
        _force(lightning.pytorch.Trainer)
        _force(lightning.fabric.Fabric)


def _ours(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return any(name in parts for name in OURS)


def _failure(excinfo) -> dict:
    exc = excinfo.value
    frames = traceback.extract_tb(excinfo.tb)
    inner = frames[-1] if frames else None
    raised_by_us = bool(frames) and _ours(inner.filename)
    lines = str(exc).strip().splitlines() or [""]
    return {
        "type": type(exc).__name__,
        "message": lines[0][:400],
        "where": f"{inner.filename}:{inner.lineno}" if inner else None,
        "statement": (inner.line or "")[:200] if inner else None,
        "raised_by_protrain": raised_by_us,
        "through_protrain": any(_ours(f.filename) for f in frames),
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if OUT is None:
        return
    if call.when == "setup":
        forced["count"] = 0
    failed = report.failed
    done = (call.when == "call") or (call.when == "setup" and (failed or report.skipped)) or (call.when == "teardown" and failed)
    if not done:
        return
    record = {"test": item.nodeid, "when": call.when, "forced": forced["count"]}
    if report.skipped:
        record["outcome"] = "skipped"
    elif failed:
        record["outcome"] = "failed" if call.when == "call" else "error"
        if call.excinfo is not None:
            record.update(_failure(call.excinfo))
    else:
        record["outcome"] = "passed"
    with open(OUT, "a") as f:
        f.write(json.dumps(record) + "\n")
