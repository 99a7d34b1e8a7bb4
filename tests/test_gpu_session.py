"""benchmarks.gpu_session: the dry mode runs on a CPU (what CI can check of a GPU session), calls
resume where the last one stopped and never run a finished piece again, and a piece that
outlasts its call is stopped with everything it started."""

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from benchmarks import gpu_session as G
from _background import background_run

ROOT = Path(__file__).resolve().parents[1]


def session(out, *args, timeout=600, env=None):
    env = dict(env or os.environ, PROTRAIN_CACHE_DIR=str(out.parent / "cache"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_session", "--out", str(out), "--dry", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "session.json").read_text())


@background_run("dry-session", after=("smoke-subset",))
def _dry_session(folder, env, results):
    """Three calls of the dry session: one with a budget of one second, then two with the real
    budget. The timeline piece resumes the suite's report, as a real session's suite pieces do:
    here the cpu-smoke subset's, whose study run is the piece's (test_benchmarks.py checks that
    run)."""
    out = folder / "session"
    shutil.copytree(results["smoke-subset"][0], out / "suite", ignore=shutil.ignore_patterns("cache"))
    return out, [session(out, "--budget", budget, env=env) for budget in ("1", "530", "530")]


@pytest.mark.background("dry-session")
def test_dry_session_plans_resumes_and_runs_what_a_cpu_can(background):
    out, ((stdout, state), (stdout2, state2), (stdout3, again)) = background
    names = [p.name for p in G.plan_pieces("gpu-80g", dry=True)]
    # A budget of one second: the first piece starts (and is stopped), nothing else does.
    assert list(state["pieces"]) == ["cuda-tests"] and state["pieces"]["cuda-tests"]["status"] == "interrupted"
    assert f"left ({len(names)} pieces" in stdout and "; ".join(names) in stdout
    # The next call runs every piece, the interrupted one again.
    stdout, state = stdout2, state2
    assert list(state["pieces"]) == names and all(p["status"] == "done" for p in state["pieces"].values()), state
    assert "nothing left" in stdout
    tests = state["pieces"]["cuda-tests"]
    assert tests["calls"] == 2 and tests["tests"] > 0 and tests["failed"] == tests["errors"] == 0
    assert tests["skipped"] == tests["tests"]  # no CUDA here: every CUDA-marked test skips
    calibration = state["pieces"]["calibration"]["data"]
    assert calibration["step_s"] > 0 and calibration["classes"]["matmul"]["calls"] > 0 and calibration["matmuls"]
    transfer = state["pieces"]["transfer"]["data"]["rows"]
    assert {r["direction"] for r in transfer} == {"host->device", "device->host", "both at once"}
    assert all(r["gb_per_s"] > 0 for r in transfer)
    adam = state["pieces"]["cpu-adam"]["data"]["rows"]
    assert adam[0]["kernel"].startswith("protrain_ops.adam_step") and adam[0]["params_per_s"] > 0
    formats = state["pieces"]["cpu-adam"]["data"]["formats"]
    assert {r["format"] for r in formats} == {"fp32", "bf16", "8bit"} and {r["load"] for r in formats} == {False, True}
    compiled = state["pieces"]["compile"]["data"]["rows"]
    assert [r["system"] for r in compiled] == ["pytorch", "pytorch compiled", "protrain", "protrain compiled"]
    assert all(r["step_s"] > 0 for r in compiled)
    offload = state["pieces"]["offload-states"]["data"]["rows"]
    assert len(offload) == 3 and all(r["bytes"] > 0 and r["offload_s"] > 0 and r["onload_s"] > 0 for r in offload)
    study = json.loads((out / "suite" / "results.json").read_text())["study"][0]
    assert study["status"] == "ok" and study["timeline"]["spans"] and (out / "suite" / "timeline.png").exists()
    dry = json.loads((out / "suite-dry" / "results.json").read_text())
    assert dry["runs"] and {r["status"] for r in dry["runs"]} == {"dry-run"}
    assert {r["system"] for r in dry["runs"]} >= {"protrain-core", "pytorch", "fsdp2-offload"}
    md = (out / "session.md").read_text()
    assert "| cuda-tests | done |" in md and "Host<->device copies" in md and "CPU Adam" in md
    assert "sync debug mode: warn" in md and "Plain PyTorch traced" in md
    assert "The update per moment format, alone and beside copies both ways" in md
    assert "Offloading the training state and back" in md and "torch.compile against eager" in md
    assert "Study run (tiny-4L study" in md and "Dry run: every configuration constructed" in md
    # Nothing is left: a third call runs nothing.
    stdout = stdout3
    assert "nothing left" in stdout and again["calls"][-1]["ran"] == []
    assert {k: v["calls"] for k, v in again["pieces"].items()} == {k: v["calls"] for k, v in state["pieces"].items()}


def test_the_gpu_session_plan():
    """The real session's pieces (planned here without a GPU): tests, micro-benchmarks, the
    timeline, one piece per workload with the session's systems, then the probes; every suite
    piece resumes the one report."""
    from benchmarks.run import SUITES, multi_workloads

    pieces = G.plan_pieces("gpu-80g", dry=False)
    suite = SUITES["gpu-80g"]
    runs = [f"run: {w.label}, {s}" for w in suite.workloads + multi_workloads(suite) for s in G.SESSION_SYSTEMS
            if w.systems is None or s in w.systems]
    assert [p.name for p in pieces] == (["cuda-tests", "calibration", "cuda-sanitizer", "transfer", "timeline",
                                         "cpu-adam", "offload-states", "compile"] + runs
                                        + ["largest-llama-13b-full", "largest-llama-70b-lora-int8"]
                                        + [f"probes: {s}" for s in G.SESSION_SYSTEMS])
    assert "run: llama-6.7B, deepspeed-zero3-offload" in runs and "run: llama-1.1B, pytorch" in runs
    assert not any("lora, fsdp2" in r or "protrain-lightning" in r for r in runs)
    for p in pieces[8:]:
        if p.name.startswith("largest"):
            assert p.kind == "json" and "benchmarks.bench_largest" in p.command and f"{{out}}/{p.name}.json" in p.command
            continue
        assert p.kind == "suite" and "--resume" in p.command and "{out}/suite" in p.command
        assert p.command[p.command.index("--systems") + 1] in G.SESSION_SYSTEMS
    assert all(p.estimate_s < 530 for p in pieces)  # each fits one call's budget by its estimate


def test_a_session_folder_of_another_suite_is_refused(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "session.json").write_text(json.dumps({"suite": "gpu-141g", "dry": False, "pieces": {}, "calls": []}))
    with pytest.raises(SystemExit, match="holds a session of suite gpu-141g"):
        G.run_session(out, "gpu-80g", dry=True, budget=1)


def test_a_piece_past_its_time_is_stopped_with_its_children(tmp_path):
    """The runner stopped by the session (SIGTERM) kills the run it started; the report keeps
    only what had finished."""
    out = tmp_path / "suite"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runner = subprocess.Popen([sys.executable, "-m", "benchmarks.run", "--suite", "cpu-smoke", "--systems", "pytorch",
                               "--workloads", "tiny-4L", "--no-probes", "--out", str(out)], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not any(out.glob("logs/*.log")) and time.monotonic() < deadline:
        time.sleep(0.1)
    G.stop(runner)
    assert runner.returncode != 0
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, "the run the runner had started is still running"
    assert not (out / "results.json").exists() or not json.loads((out / "results.json").read_text())["runs"]


def test_a_runner_stopped_while_it_starts_a_run_stops_that_run(tmp_path, monkeypatch):
    """SIGTERM that lands inside Popen (the run forked, its pid not yet known to launch) is held
    until the pid is known: the runner still exits, and the run it had just started dies with it."""
    import signal

    from benchmarks import run

    started = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(cmd, **kw):
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, before Popen returns
        time.sleep(0.2)
        return started[-1]

    # (benchmarks.run's own copy of the module: subprocess.Popen itself is every thread's, and the
    # suite's background runs start processes meanwhile -- once one got this sleeper instead.)
    patched = types.ModuleType("subprocess")
    patched.__dict__.update(vars(subprocess), Popen=popen_then_sigterm)
    monkeypatch.setattr(run, "subprocess", patched)
    previous = signal.signal(signal.SIGTERM, run._stopping)
    try:
        with pytest.raises(SystemExit) as stopped:
            run.launch([{"system": "pytorch", "label": "x", "batch": 1, "dry_run": False}], 60, tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
        run._stopping.pending = False
    assert stopped.value.code == 143
    assert started and started[0].poll() is not None, "the run started as the runner was stopped is still running"


def test_interrupted_piece(tmp_path):
    piece = G.Piece("sleeper", 1, (sys.executable, "-c", "import time; time.sleep(60)"), "json")
    t = time.monotonic()
    with pytest.raises(G.Interrupted, match="stopped after 1 s"):
        G.run_piece(piece, tmp_path, timeout=1)
    assert time.monotonic() - t < 20


def test_without_a_gpu_the_real_session_says_to_use_dry(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    with pytest.raises(SystemExit):
        G.main(["--out", str(tmp_path)])
    assert "--dry" in capsys.readouterr().err

