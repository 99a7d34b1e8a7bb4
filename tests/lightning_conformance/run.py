"""Lightning's own tests under ProTrain: the conformance check of issue 28 (a developer's tool,
outside CI: it needs Lightning's source and runs for a quarter of an hour on two cores).

Each module of Lightning's tests below runs twice in Lightning's own pytest session: as it is,
and with the strategy forced to ProTrain wherever the test leaves it to Lightning (``plugin.py``
says exactly where). Per module the table gives the tests that passed as they are, how many of
those pass forced, and the forced failures by class:

  (a) a documented refusal with a clear error -- raised by ``lightning_protrain`` or
      ``protrain_core`` itself, or a refusal ``reviewed.json`` names with the reason;
  (b) a test asserting another strategy's class or internals -- ``reviewed.json`` names each,
      with the reason;
  (c) anything else: a defect until shown otherwise.

Lightning's source, at the release of the installed Lightning (or the nearest tag)::

    git clone https://github.com/Lightning-AI/pytorch-lightning && git -C pytorch-lightning checkout 2.6.5
    python tests/lightning_conformance/run.py --lightning-src pytorch-lightning [--modules ...] [--report docs/conformance.md]

Nothing of Lightning's is copied here: the runner points pytest at the checkout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODULES = (
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/loops",
    "tests_pytorch/checkpointing",
    "tests_pytorch/callbacks",
    "tests_pytorch/trainer/logging_",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/trainer/test_trainer.py",
    "tests_fabric/test_fabric.py",
)
REFUSALS = ("ValueError", "TypeError", "RuntimeError", "NotImplementedError", "MisconfigurationException")


def run_module(src: Path, module: str, force: bool, out: Path, timeout: float, reuse: bool = False) -> dict:
    """One pytest session over ``module`` of Lightning's tests; its records by test id
    (``reuse``: the records a previous run left in ``out``, classified again)."""
    records = out / f"{module.replace('/', '_')}.{'forced' if force else 'as-is'}.jsonl"
    if reuse:
        saved = out / "uncollected.json"
        uncollected = json.loads(saved.read_text()).get(module, []) if saved.exists() else []
        return {**_records(records), "seconds": 0.0, "timed_out": False, "tail": "", "uncollected": uncollected}
    records.unlink(missing_ok=True)
    env = {**os.environ, "PROTRAIN_CONFORMANCE_OUT": str(records), "PROTRAIN_CONFORMANCE_FORCE": "1" if force else "0",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PROTRAIN_CACHE_DIR": str(out / "cache")}
    command = [sys.executable, "-m", "pytest", module, "-q", "-p", "plugin", "-p", "no:cacheprovider",
               "-W", "ignore", "--continue-on-collection-errors"]
    start = time.time()
    try:
        proc = subprocess.run(command, cwd=src / "tests", env=env, capture_output=True, text=True, timeout=timeout)
        output, timed_out = proc.stdout, False
    except subprocess.TimeoutExpired as e:
        output, timed_out = (e.stdout or b"").decode(errors="replace"), True
    results = _records(records)["results"]
    # Test files that did not import (a missing optional dependency): named in the table.
    uncollected = sorted(set(re.findall(r"^ERROR (\S+\.py)( |$)", output, flags=re.M)))
    uncollected = [f for f, _ in uncollected]
    return {"results": results, "seconds": time.time() - start, "timed_out": timed_out, "tail": output[-2000:],
            "uncollected": uncollected}


def _records(path: Path) -> dict:
    results = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            previous = results.get(record["test"])
            if previous is None or previous["outcome"] == "passed":  # a failed teardown after a passed call
                results[record["test"]] = record
    return {"results": results}


def classify(record: dict, reviewed: dict) -> tuple[str, str]:
    """(class, reason) of a forced failure of a test that passes as it is."""
    if record["test"] in reviewed["tests"]:
        kind, reason = reviewed["tests"][record["test"]]
        return kind, reason
    if record.get("raised_by_protrain") and record.get("type") in REFUSALS and (record.get("statement") or "").startswith("raise"):
        return "a", f"ProTrain's refusal: {record['message']}"
    for pattern, (kind, reason) in reviewed["patterns"].items():
        if re.search(pattern, f"{record.get('type')}: {record.get('message')}"):
            return kind, reason
    return "c", f"{record.get('type')}: {record.get('message')} ({_short(record.get('where'))})"


def _short(where: str | None) -> str:
    if not where:
        return "?"
    for marker in ("site-packages/", "/tests/", "/work/main/"):
        if marker in where:
            return where.split(marker, 1)[1]
    return where


def summarise(module: str, as_is: dict, forced: dict, reviewed: dict) -> dict:
    passed = {t for t, r in as_is["results"].items() if r["outcome"] == "passed"}
    rows = {"module": module, "tests": len(as_is["results"]), "passed_as_is": len(passed), "passed_forced": 0,
            "a": [], "b": [], "c": [], "forced_here": 0,
            "timed_out": as_is["timed_out"] or forced["timed_out"], "uncollected": as_is["uncollected"]}
    for test in sorted(passed):
        record = forced["results"].get(test)
        if record is None:
            rows["c"].append((test, "no result forced (the session ended before it)"))
            continue
        rows["forced_here"] += record.get("forced", 0) > 0
        if record["outcome"] == "passed":
            rows["passed_forced"] += 1
        elif record["outcome"] == "skipped":
            rows["c"].append((test, "skipped when forced"))
        else:
            kind, reason = classify(record, reviewed)
            rows[kind].append((test, reason))
    return rows


def report(rows: list[dict], lightning: str, seconds: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    import lightning as L
    import torch

    lines = [
        "# Lightning's own tests under ProTrain",
        "",
        f"{datetime.date.today().isoformat()}, lightning-protrain {commit}; Lightning {L.__version__} installed, its "
        f"tests from {lightning}; torch {torch.__version__}; {platform.machine()}, {os.cpu_count()} cores; "
        f"{seconds / 60:.0f} min.",
        "",
        "    python tests/lightning_conformance/run.py --lightning-src PATH --report docs/conformance.md",
        "",
        "Forced: ``strategy=\"auto\"`` (given or left out) becomes ``\"protrain\"`` for every Trainer and Fabric; "
        "tests naming another strategy keep it. Columns: tests collected, passed as they are, of those "
        "passed forced (and how many of them built a ProTrain Trainer or Fabric at all), forced failures by class: "
        "(a) documented refusal with a clear error, (b) asserting another strategy's class or internals, (c) defect.",
        "",
        "| module | tests | passed as is | passed forced (ran ProTrain) | (a) | (b) | (c) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = " (timed out)" if r["timed_out"] else ""
        if r["uncollected"]:
            note += f" (not importable here: {', '.join(Path(f).name for f in r['uncollected'])})"
        lines.append(f"| {r['module']}{note} | {r['tests']} | {r['passed_as_is']} | {r['passed_forced']} ({r['forced_here']}) "
                     f"| {len(r['a'])} | {len(r['b'])} | {len(r['c'])} |")
    total = {k: sum(len(r[k]) if isinstance(r[k], list) else r[k] for r in rows)
             for k in ("tests", "passed_as_is", "passed_forced", "forced_here", "a", "b", "c")}
    lines.append(f"| **all** | {total['tests']} | {total['passed_as_is']} | {total['passed_forced']} ({total['forced_here']}) "
                 f"| {total['a']} | {total['b']} | {total['c']} |")
    for kind, title in (("c", "(c) defects"), ("b", "(b) another strategy's class or internals"), ("a", "(a) refusals")):
        entries = [(t, reason) for r in rows for t, reason in r[kind]]
        lines += ["", f"## {title}: {len(entries)}", ""]
        lines += [f"- `{t}`: {reason}" for t, reason in entries] or ["None."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lightning-src", type=Path, required=True, help="a checkout of Lightning's source (holds tests/)")
    ap.add_argument("--modules", default=",".join(MODULES), help="comma-separated, relative to its tests/")
    ap.add_argument("--out", type=Path, default=None, help="where the per-test records go (default: a temporary folder)")
    ap.add_argument("--report", type=Path, default=None, help="write the table there (e.g. docs/conformance.md)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest session")
    ap.add_argument("--reuse", action="store_true", help="classify the records already in --out again, run nothing")
    args = ap.parse_args()
    src = args.lightning_src.resolve()
    if not (src / "tests" / "tests_pytorch").is_dir():
        sys.exit(f"{src} is not a checkout of Lightning's source: it has no tests/tests_pytorch")
    out = args.out or Path(tempfile.mkdtemp(prefix="protrain-conformance-"))
    out.mkdir(parents=True, exist_ok=True)
    reviewed = json.loads((HERE / "reviewed.json").read_text())
    start, rows = time.time(), []
    uncollected = {}
    for module in args.modules.split(","):
        as_is = run_module(src, module, False, out, args.timeout, args.reuse)
        forced = run_module(src, module, True, out, args.timeout, args.reuse)
        uncollected[module] = as_is["uncollected"]
        rows.append(summarise(module, as_is, forced, reviewed))
        r = rows[-1]
        print(f"{module}: {r['tests']} tests, {r['passed_as_is']} passed as is, {r['passed_forced']} forced; "
              f"(a) {len(r['a'])} (b) {len(r['b'])} (c) {len(r['c'])} [{as_is['seconds']:.0f} s + {forced['seconds']:.0f} s]",
              flush=True)
    text = report(rows, _describe(src), time.time() - start)
    print(text)
    if args.report:
        args.report.write_text(text)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    if not args.reuse:
        (out / "uncollected.json").write_text(json.dumps(uncollected))


def _describe(src: Path) -> str:
    tag = subprocess.run(["git", "describe", "--tags", "--always"], cwd=src, capture_output=True, text=True).stdout.strip()
    return f"its source at {tag}" if tag else str(src)


if __name__ == "__main__":
    main()
