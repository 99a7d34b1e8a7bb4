"""How fast a failing 2-process Trainer run ends, and what it prints (issue 27): each case of
``tests/scripts/failing_run.py`` (training_step raising on rank 0 or 1, a checkpoint directory
that cannot be created, rank 1's disk full under a sharded save, ctrl-C to every process), with
the seconds from the failure -- the first rank's ``on_exception``, or the SIGINT -- to each
process's end (a rank killed by Lightning's launcher writes no end stamp), and the errors the
ranks printed.

    python -m benchmarks.bench_failures
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "failing_run.py"
CASES = ("raise-rank0", "raise-rank1", "unwritable", "full-disk", "interrupt")


def run(case: str, limit: float = 300.0, env: dict | None = None) -> dict:
    """One case: {case, returncode, timed_out, output, wall_s, ended_after_s, errors}; the
    processes are killed after ``limit`` seconds (``timed_out``)."""
    out = Path(tempfile.mkdtemp(prefix=f"protrain-{case}-"))
    start = time.time()
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}  # SIGABRT prints every thread's stack
    proc = subprocess.Popen([sys.executable, str(SCRIPT), case, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    sigint, timed_out = None, False
    if case == "interrupt":  # ctrl-C in a terminal: SIGINT to the whole process group, mid-training
        while not all((out / f"running{r}").exists() for r in (0, 1)) and proc.poll() is None:
            time.sleep(0.1)
        if proc.poll() is None:  # (a run that ended first is reported as it ended)
            sigint = time.time()
            os.killpg(proc.pid, signal.SIGINT)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:  # where each process hangs (faulthandler), then the end
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            output = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0]
        output, timed_out = output + f"\n(killed after {limit:.0f} s)", True
    stamps = {f.name: float(f.read_text()) for f in out.iterdir() if f.name.startswith(("failed", "ended")) and not f.name.endswith(".tmp")}
    shutil.rmtree(out, ignore_errors=True)
    failed = [v for k, v in stamps.items() if k.startswith("failed")]
    origin = sigint or (min(failed) if failed else start)
    errors = [line[:160] for line in output.splitlines() if line.startswith("[rank") and "Error" in line]
    return {"case": case, "returncode": proc.returncode, "timed_out": timed_out, "output": output,
            "wall_s": time.time() - start,
            "ended_after_s": {k[5:]: round(v - origin, 2) for k, v in sorted(stamps.items()) if k.startswith("ended")},
            "errors": errors[-3:]}


def main() -> None:
    print("| case | exit | whole run | each rank's end after the failure | errors printed (last 3) |")
    print("|---|---|---|---|---|")
    for case in CASES:
        r = run(case)
        ends = ", ".join(f"rank {k} {v:.2f} s" for k, v in r["ended_after_s"].items()) or "-"
        print(f"| {case} | {r['returncode']} | {r['wall_s']:.1f} s | {ends} | {'<br>'.join(r['errors'])} |", flush=True)


if __name__ == "__main__":
    main()
