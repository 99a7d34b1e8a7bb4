"""One command for a GPU session: every GPU check and benchmark, in pieces that fit the device
tool's 10-minute commands, resumable across calls.

    python -m benchmarks.gpu_session --out DIR          # on the GPU machine: call again until it says "nothing left"
    python -m benchmarks.gpu_session --out DIR --dry    # on a CPU: plan the pieces and run what a CPU can
    options: --budget SECONDS (default 530: a call ends within 9 minutes)  --suite gpu-80g|gpu-141g
             (default: by the GPU's memory)  --retry-failed

The pieces, in order (the first five minutes on what no CPU test can show):
  cuda-tests        python -m pytest -m cuda (passed, failed and skipped, from its JUnit XML), with
                    torch.cuda.set_sync_debug_mode("warn") (PROTRAIN_SYNC_DEBUG: its synchronising
                    calls counted)
  calibration       a plain-PyTorch TinyLlama-1.1B step traced: time by operator class, matmul
                    rates, launch gaps, host time per operator (benchmarks/bench_calibration.py)
  cuda-sanitizer    the CUDA parity tests under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1):
                    stream races on the real device
  transfer          host<->device bandwidth with the pinned host pool (benchmarks/bench_transfer.py)
  timeline          the suite's study run: one ProTrain step's overlap timeline and the cost
                    models across plans (benchmarks/run.py), each plan also simulated on this
                    GPU's preset with the measured copy and CPU Adam figures (simulated against
                    measured: protrain_core/simulator)
  cpu-adam          CPU Adam throughput on the host's cores, and the update of each moment format
                    alone and while host<->GPU copies run both ways (benchmarks/bench_adam.py)
  offload-states    a whole training state to the host and back (benchmarks/bench_offload.py),
                    against the copy bandwidth the profiler measures (goal: at least 80 %)
  compile           torch.compile of each block against eager, ProTrain and plain PyTorch in one
                    run: compilation time and step time (benchmarks/bench_compile.py)
  run: <workload>, <system>
                    the suite's throughput rows, one piece per run: ProTrain, plain PyTorch, FSDP2
                    offload, and DeepSpeed ZeRO-3 offload when it is installed (docs/developers.md: bringing
                    DeepSpeed; a system that is not installed is listed as not run); every
                    one-process ProTrain run is simulated too
  largest-<rung>    the top rungs of ProTrain's largest-model ladder trained for real: LLaMA-13B
                    fully fine-tuned and LLaMA-70B with LoRA over an int8 base, built on the meta
                    device (benchmarks/bench_largest.py)
  probes: <system>  the largest-model and largest-batch ladders of one system

A call runs pending pieces in order while the next one's estimate fits what is left of its
budget (the first always starts), then prints what is left. A piece still running when the budget
is spent is stopped; the next call starts it again, and a suite piece then keeps every run it had
finished (the runner writes its report after each run and resumes from it). A finished piece is
never run again, also when it found failures: that is its result (``--retry-failed`` re-runs
pieces that broke before giving one).

In DIR: session.json (every piece's status, time and result), session.md (the session's
tables), suite/ (the suite's results.json, results.md and figures). The dry mode runs the CUDA
tests (skipped without CUDA; the sanitizer's piece is left out), the calibration trace of a
2-layer model and the micro-benchmarks on the CPU, the cpu-smoke suite's study run
for the timeline, and a dry run of the GPU suite that builds every configuration; its pieces
are the real session's with "(dry)" estimates.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 20  # a stopped piece's SIGTERM grace and the state's last write: kept out of its time
SESSION_SYSTEMS = ("protrain-core", "pytorch", "fsdp2-offload", "deepspeed-zero3-offload")


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str
    estimate_s: float  # a guess before it first ran, for planning the calls
    command: tuple[str, ...]  # run in ROOT; "{out}" is the session's folder
    kind: str  # "tests" (writes {out}/<name>.xml), "json" (writes {out}/<name>.json), "suite"
    env: tuple[tuple[str, str], ...] = ()  # set for its process


class Interrupted(Exception):
    pass


# ----- the plan ---------------------------------------------------------------------------------
def default_suite() -> str:
    """gpu-141g on a GPU of more than 100 GiB, else gpu-80g (this process creates no CUDA
    context: it holds no device memory while the pieces run)."""
    from benchmarks.run import gpu_properties

    return "gpu-141g" if gpu_properties()[1] > 100 * 2**30 else "gpu-80g"


def billions(row_params: int) -> float:
    return row_params / 1e9


def plan_pieces(suite_name: str, dry: bool) -> list[Piece]:
    """The session's pieces in order. ``dry``: what a CPU can run of each."""
    from benchmarks import run as R
    from benchmarks import systems as S

    suite = R.SUITES[suite_name]
    py = sys.executable
    runner = (py, "-m", "benchmarks.run", "--suite", suite_name, "--resume", "--out", "{out}/suite")
    one_file = ("tests/test_offload_states.py",) if dry else ()  # (all skip on a CPU; collecting every file: 30 s)
    # Estimates: the times of the lent H200's session of 2026-11-29 and a fifth more, rounded up.
    pieces = [
        Piece("cuda-tests", 20 if dry else 120, (py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                                "--junitxml", "{out}/cuda-tests.xml") + one_file, "tests",
              (("PROTRAIN_SYNC_DEBUG", "warn"),)),
        Piece("calibration", 10 if dry else 30, (py, "-m", "benchmarks.bench_calibration", "--json", "{out}/calibration.json")
              + (("--tiny", "--batch", "2", "--seq", "32") if dry else ()), "json"),
        *([] if dry else [Piece("cuda-sanitizer", 70, (py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                                       "-k", "bitwise or parity or equal", "--junitxml",
                                                       "{out}/cuda-sanitizer.xml"), "tests",
                                (("TORCH_CUDA_SANITIZER", "1"),))]),  # (on a CPU: the cuda-tests piece again)
        Piece("transfer", 5 if dry else 15, (py, "-m", "benchmarks.bench_transfer", "--mib", "16" if dry else "256",
                                             "--json", "{out}/transfer.json"), "json"),
    ]
    # Then the study run's timeline (simulated beside it), before the longer micro-benchmarks.
    if dry:  # the timeline of the CPU suite's study run; the GPU suite built on the meta device
        study = R.study_workload(R.SUITES["cpu-smoke"])
        pieces.append(Piece("timeline", 30, (py, "-m", "benchmarks.run", "--suite", "cpu-smoke", "--systems",
                                             "protrain-core", "--workloads", study.label, "--no-probes", "--resume",
                                             "--out", "{out}/suite"), "suite"))
    elif (study := R.study_workload(suite)) is not None:  # + each study plan simulated on the meta device
        pieces.append(Piece("timeline", 90 + 25 * billions(S.param_counts(study.model)[0]),
                            runner + ("--systems", "protrain-core", "--workloads", study.label, "--no-probes"), "suite"))
    pieces += host_pieces(py, dry)
    pieces.append(Piece("compile", 10 if dry else 180, (py, "-m", "benchmarks.bench_compile", "--json", "{out}/compile.json")
                        + (("--backend", "eager", "--layers", "2", "--steps", "2", "--warmup", "1") if dry else
                           ("--device", "cuda", "--layers", "12", "--hidden", "1024", "--seq", "1024",
                            "--precision", "bf16-mixed", "--plan", "persistent")), "json"))
    if dry:
        pieces.append(Piece(f"rows and probes: {suite_name} (dry run)", 20,
                            (py, "-m", "benchmarks.run", "--suite", suite_name, "--dry-run", "--systems",
                             ",".join(SESSION_SYSTEMS), "--out", "{out}/suite-dry"), "suite"))
        return pieces
    for w in suite.workloads + R.multi_workloads(suite):
        size = billions(S.param_counts(w.model)[0])
        for system in SESSION_SYSTEMS:
            if w.systems is None or system in w.systems:
                # model set-up, profiling, steps (ProTrain: and the run simulated on the meta device)
                estimate = 30 + 2 * size if system == "pytorch" else 50 + 16 * size
                pieces.append(Piece(f"run: {w.label}, {system}", min(estimate, R.SUITES[suite_name].timeout_s + 30),
                                    runner + ("--systems", system, "--workloads", w.label, "--no-probes"), "suite"))
    # The top rungs of the largest-model ladder (issue 57): built on the meta device, filled chunk by chunk.
    for name, model, extra in (("largest-llama-13b-full", "llama-13b", ()),
                               ("largest-llama-70b-lora-int8", "llama-70b", ("--lora-rank", "16", "--frozen-dtype", "int8"))):
        pieces.append(Piece(name, 480, (py, "-m", "benchmarks.bench_largest", "--model", model, "--device", "cuda",
                                        "--json", "{out}/" + name + ".json") + extra, "json"))
    for system in SESSION_SYSTEMS:
        if suite.probe_systems is None or system in suite.probe_systems:
            pieces.append(Piece(f"probes: {system}", 300, runner + ("--systems", system, "--workloads", ""), "suite"))
    return pieces


def host_pieces(py: str, dry: bool) -> list[Piece]:
    """The host-side micro-benchmarks: CPU Adam beside copies both ways, the offload round trip."""
    return [
        Piece("cpu-adam", 5 if dry else 290, (py, "-m", "benchmarks.bench_adam", "--numel", str(2**20 if dry else 2**24),
                                              "--json", "{out}/cpu-adam.json")
              + (("--iters", "2", "--hidden", "256") if dry else ("--copies", "cuda")), "json"),
        Piece("offload-states", 10 if dry else 80,
              (py, "-m", "benchmarks.bench_offload", "--layers", "2" if dry else "24", "--hidden", "256" if dry else "2048",
               "--json", "{out}/offload-states.json") + (() if dry else ("--device", "cuda")), "json"),
    ]


# ----- running ----------------------------------------------------------------------------------
def run_piece(piece: Piece, out: Path, timeout: float) -> dict:
    """Run one piece as a process of its own; its result. Raises Interrupted past ``timeout``
    (the process is stopped with SIGTERM, then killed)."""
    cmd = [c.replace("{out}", str(out)) for c in piece.command]
    for stale in (out / f"{piece.name}.xml", out / f"{piece.name}.json"):  # an earlier call's: not this result
        if piece.kind in ("tests", "json"):
            stale.unlink(missing_ok=True)
    log = out / "logs" / (piece.name.replace(":", "").replace(" ", "_").replace("(", "").replace(")", "") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", **dict(piece.env))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            stop(proc)
            raise Interrupted(f"stopped after {timeout:.0f} s (the call's budget)") from None
        except BaseException:
            stop(proc)
            raise
    tail = log.read_text()[-2000:]
    result = {"exit_status": code, "log": str(log.relative_to(out)), "log_tail": tail}
    if piece.kind == "tests":
        result.update(junit(out / f"{piece.name}.xml"))
        result["sync_warnings"] = log.read_text().count("called a synchronizing CUDA operation")
        ok = code in (0, 5) or (code == 1 and result.get("failed", 0) + result.get("errors", 0) > 0)
    elif piece.kind == "json":
        path = out / f"{piece.name}.json"
        ok = code == 0 and path.exists()
        if ok:
            result["data"] = json.loads(path.read_text())
    else:
        ok = code == 0
    result["status"] = "done" if ok else "failed"
    return result


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the piece's process group (the runner kills its run in flight), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def junit(path: Path) -> dict:
    """Counts and failing tests of a pytest JUnit XML report."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
    return {"tests": counts["tests"], "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failing": failing}


def load_state(out: Path, suite: str, dry: bool) -> dict:
    path = out / "session.json"
    if path.exists():
        state = json.loads(path.read_text())
        if (state["suite"], state["dry"]) != (suite, dry):
            raise SystemExit(f"{out} holds a session of suite {state['suite']} (dry: {state['dry']}); give another "
                             f"--out for suite {suite} (dry: {dry}), or delete {path}.")
        return state
    return {"suite": suite, "dry": dry, "pieces": {}, "calls": []}


def save_state(state: dict, out: Path) -> None:
    from benchmarks.run import write_text

    write_text(out / "session.json", json.dumps(state, indent=1))
    write_text(out / "session.md", markdown(state, out))


def pending(pieces: list[Piece], state: dict, retry_failed: bool) -> list[Piece]:
    def left(p):
        status = state["pieces"].get(p.name, {}).get("status")
        return status not in ("done", "failed") or (retry_failed and status == "failed")

    return [p for p in pieces if left(p)]


def run_session(out: Path, suite: str, *, dry: bool, budget: float, retry_failed: bool = False,
                start: float | None = None) -> dict:
    """Run the pending pieces within ``budget`` seconds from ``start`` (default: now)."""
    start = time.monotonic() if start is None else start
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = load_state(out, suite, dry)
    pieces = plan_pieces(suite, dry)
    todo = pending(pieces, state, retry_failed)
    call = {"date": now(), "ran": []}
    state["calls"].append(call)
    for i, piece in enumerate(todo):
        left = budget - (time.monotonic() - start)
        if i > 0 and piece.estimate_s > left:
            break
        print(f"[{piece.name}] (estimate {piece.estimate_s:.0f} s, {left:.0f} s of this call's budget left)", flush=True)
        entry = state["pieces"].setdefault(piece.name, {"seconds": 0.0, "calls": 0})
        began = time.monotonic()
        try:
            entry.update(run_piece(piece, out, timeout=left - STOP_GRACE_S))
        except Interrupted as exc:
            entry.update(status="interrupted", note=str(exc))
        entry["seconds"] += time.monotonic() - began
        entry["calls"] += 1
        if entry["status"] == "interrupted" and piece.kind != "suite" and entry["calls"] >= 2:
            # It starts from scratch each time (only the suite's pieces keep their finished runs):
            # twice stopped, it would stop every call.
            entry.update(status="failed", note=f"{entry['note']}, twice: it takes longer than a call; run it by hand")
        call["ran"].append(piece.name)
        print(f"[{piece.name}] {entry['status']} in {time.monotonic() - began:.0f} s", flush=True)
        save_state(state, out)
        if entry["status"] == "interrupted":
            break
    call["seconds"] = time.monotonic() - start
    save_state(state, out)
    left = pending(pieces, state, retry_failed=False)
    if left:
        print(f"\nleft ({len(left)} pieces, about {sum(p.estimate_s for p in left) / 60:.0f} min by the estimates): "
              + "; ".join(p.name for p in left))
        print(f"run the same command again: python -m benchmarks.gpu_session --out {out}" + (" --dry" if dry else ""))
    else:
        print(f"\nnothing left: every piece has run. Results: {out / 'session.md'}, {out / 'suite'}")
    return state


# ----- the report ---------------------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def markdown(state: dict, out: Path) -> str:
    lines = [f"## GPU session{' (dry mode, on a CPU)' if state['dry'] else ''}: suite {state['suite']}", "",
             "Calls: " + "; ".join(f"{c['date']} ({', '.join(c['ran']) or 'nothing'})" for c in state["calls"]), "",
             "| piece | status | seconds | calls |", "|---|---|---|---|"]
    for name, p in state["pieces"].items():
        lines.append(f"| {name} | {p['status']} | {p['seconds']:.0f} | {p['calls']} |")
    for name, what in (("cuda-tests", "CUDA tests (sync debug mode: warn)"), ("cuda-sanitizer", "CUDA sanitizer")):
        tests = state["pieces"].get(name, {})
        if "tests" in tests:
            lines += ["", f"{what}: {tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
                      f"{tests['skipped']} skipped; {tests.get('sync_warnings', 0)} synchronising calls warned"
                      + "".join(f"\n- failing: `{t}`" for t in tests["failing"])]
    from benchmarks import bench_adam, bench_calibration, bench_compile, bench_offload, bench_transfer

    calibration = state["pieces"].get("calibration", {}).get("data")
    if calibration:
        lines += ["", "Plain PyTorch traced (`benchmarks/bench_calibration.py`):", "",
                  bench_calibration.markdown(calibration)]

    transfer = state["pieces"].get("transfer", {}).get("data")
    if transfer:
        lines += ["", "Host<->device copies (`benchmarks/bench_transfer.py`):", "",
                  bench_transfer.markdown(transfer["rows"], transfer["device"], transfer["mib"])]
    offload = state["pieces"].get("offload-states", {}).get("data")
    if offload:
        lines += ["", "Offloading the training state and back (`benchmarks/bench_offload.py`):", "",
                  offload["setting"], "", bench_offload.markdown(offload["rows"])]
    compiled = state["pieces"].get("compile", {}).get("data")
    if compiled:
        lines += ["", "torch.compile against eager (`benchmarks/bench_compile.py`):", "", compiled["setting"], "",
                  bench_compile.markdown(compiled["rows"])]
    adam = state["pieces"].get("cpu-adam", {}).get("data")
    if adam:
        lines += ["", "CPU Adam (`benchmarks/bench_adam.py`):", "", bench_adam.markdown(adam["rows"], iters=20)]
        if adam.get("formats"):
            lines += ["", "The update per moment format, alone and beside copies both ways:", "",
                      bench_adam.format_markdown(adam["formats"], iters=20)]
    for folder in ("suite", "suite-dry"):
        report = out / folder / "results.md"
        if report.exists():
            lines += ["", f"The suite's report ({folder}/results.md):", "", report.read_text()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu-session",
                    help="the session's folder (default benchmarks/results/gpu-session, ignored by git)")
    ap.add_argument("--dry", action="store_true", help="on a CPU: plan the pieces and run what a CPU can")
    ap.add_argument("--suite", choices=("gpu-80g", "gpu-141g"), default=None)
    ap.add_argument("--budget", type=float, default=530.0, help="seconds this call may take (default 530)")
    ap.add_argument("--retry-failed", action="store_true", help="run again the pieces that broke")
    args = ap.parse_args(argv)
    start = time.monotonic()
    # Stopped from outside (the device tool's time limit): the piece in flight is stopped with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    if not args.dry and not torch.cuda.is_available():  # (no CUDA context is created by asking)
        ap.error("this machine has no CUDA GPU: run with --dry to plan the session and run what a CPU can")
    suite = args.suite or ("gpu-80g" if args.dry else default_suite())
    run_session(args.out, suite, dry=args.dry, budget=args.budget, retry_failed=args.retry_failed, start=start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
