"""benchmarks.run: the cpu-smoke suite trains every system available here and writes the table,
JSON and figures; the GPU suites construct every system and configuration in a dry run.

Each run is a process of its own (seconds each), so CI runs a representative subset: ProTrain
and plain PyTorch through the whole runner (bitwise-equal losses, table, JSON, figures, the study
run), and the
GPU suite's ProTrain configurations in a dry run. The full runs -- every system, the probes,
resume, out-of-memory and timeouts, every dry-run configuration -- are marked ``slow``:
``python -m pytest -m slow tests/test_benchmarks.py``."""

import json

import matplotlib.pyplot as plt
import pytest
import torch

from benchmarks.systems import SYSTEMS, unavailable
from conftest import bench


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    proc = bench("--suite", "cpu-smoke", out=out)
    return out, proc.stdout, json.loads((out / "results.json").read_text())


@pytest.mark.background("smoke-subset")
def test_cpu_smoke_protrain_equals_pytorch_and_writes_the_report(background):
    """The CI subset: the runner end to end with ProTrain and its baseline, in one process and in
    two (the devices=2 gloo row: ProTrain's sharded chunks against DDP)."""
    out, stdout, report = background
    assert {(r["system"], r["label"]) for r in report["runs"]} == {
        (s, label) for s in ("protrain-core", "pytorch") for label in ("tiny-4L", "tiny-4L x2")}
    assert all(r["status"] == "ok" for r in report["runs"])
    for label, devices in (("tiny-4L", 1), ("tiny-4L x2", 2)):
        runs = {r["system"]: r for r in report["runs"] if r["label"] == label}
        ref = runs["pytorch"]["losses"]
        # Two processes: rank 0's losses; DDP's reduction is ProTrain's exactly with two (tests/test_distributed.py).
        assert len(ref) == report["warmup"] + report["steps"] and runs["protrain-core"]["losses"] == ref, label
        core = runs["protrain-core"]
        assert core["plan"].startswith("Plan(") and core["predicted_step_s"] > 0 and core["lower_bound_s"] > 0
        assert core["searched"] and core["profiling_steps"] == 6 < report["warmup"]  # planned in the warm-up
        for r in runs.values():  # every process trains its own batch
            assert r["devices"] == devices
            assert r["tokens_per_s"] == pytest.approx(devices * r["batch"] * r["seq"] / r["step_median_s"])
    # Every CPU run (both systems alike) returns freed large blocks at once: RSS measures what is held.
    assert report["machine"]["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert {r["malloc_mmap_threshold"] for r in report["runs"]} == {"131072"}
    for core in (r for r in report["runs"] if r["system"] == "protrain-core"):  # RSS against the plan (issue 30)
        planned, base, steady = core["planned_host_bytes"], core["rss_baseline_bytes"], core["steady_host_rss_bytes"]
        assert base < steady <= core["peak_host_rss_bytes"]  # the timed steps' peak, within the run's
        assert core["rss_over_plan"] == steady / (planned + base) <= core["rss_over_plan_run"]
    single = [r["losses"] for r in report["runs"] if r["system"] == "pytorch"]
    assert single[0] != single[1]  # the two-process run is not the one-process run again
    md = (out / "results.md").read_text()
    assert md in stdout and "| protrain-core | ok |" in md and "| tiny-4L x2 (215k) | protrain-core | ok |" in md
    figures = ["throughput.png", "memory.png", "fidelity.png", "timeline.png"]  # no probes: no probes.png
    assert report["figures"] == figures and not (out / "probes.png").exists()
    for name in figures:
        assert str(out / name) in stdout
        image = plt.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 300 and image[..., :3].std() > 0.05  # drawn, not blank


@pytest.mark.background("smoke-subset")
def test_cpu_smoke_study_run(background):
    """The study run: the cost models across plans that fit its budget (other plans, same losses
    as plain PyTorch), memory by category, and a timeline whose CPU Adam (the worker thread on a
    CPU) overlaps backward."""
    out, stdout, report = background
    (study,) = report["study"]
    assert study["status"] == "ok" and study["label"] == "tiny-4L study" and study["memory_budget"] == "5MiB"
    pytorch = next(r for r in report["runs"] if r["system"] == "pytorch" and r["label"] == "tiny-4L")
    assert study["losses"] == pytorch["losses"]  # a streamed plan trains like plain PyTorch
    plans = study["plans"]
    assert plans[0]["searched"] and plans[0]["plan"] == study["plan"] and len({p["plan"] for p in plans}) == len(plans) >= 3
    for p in plans:
        assert p["predicted_step_s"] > 0 and len(p["step_s"]) == report["steps"] and p["measured_peak_bytes"] > 0
        assert p["predicted_peak_bytes"] <= 5 * 2**20  # every plan was searched under the budget
    memory = study["memory"]
    assert memory["measured"]["persistent chunks"] == memory["predicted"]["persistent chunks"]
    assert memory["measured"]["host: model states"] == memory["predicted"]["host: model states"] > 0
    timeline = study["timeline"]
    assert timeline["threaded"] and timeline["overlap"] == "cpu-adam-during-backward"
    adam = [s for s in timeline["spans"] if s["lane"] == "CPU Adam"]
    assert adam and all(s["thread"].startswith("protrain-cpu-adam") for s in adam)
    assert study["adam_in_backward"] > 0.5
    md = (out / "results.md").read_text()
    assert "Study run (tiny-4L study, memory budget 5MiB)" in md and f"| {plans[0]['plan']} (searched) |" in md
    assert f"{study['adam_in_backward']:.0%} of the CPU Adam time ran while backward was running" in md


def test_clipping_rows_train_like_plain_pytorch(tmp_path, monkeypatch):
    """A clipping row (clip_grad_norm_(1.0) every step, each system its own way) in this process:
    ProTrain's losses equal plain PyTorch's bitwise, and differ from the unclipped run's."""
    from benchmarks.run import SUITES, clipped, spec_of
    from benchmarks.systems import run

    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path))
    suite = SUITES["cpu-smoke"]
    (w,) = suite.workloads
    losses = {}
    for system in ("protrain-core", "pytorch"):
        for workload in (w, clipped(w)):
            spec = spec_of(suite, system, workload, dry_run=False, warmup=7, steps=1)
            spec["memory_budget"] = "4MiB"  # every chunk streamed: the schedule under test
            result = run(spec)
            assert result["status"] == "ok", result.get("traceback", result)
            assert system == "pytorch" or "n_buffer=0" not in result["plan"]  # some chunk streamed
            losses[system, workload.clip] = result["losses"]
    assert losses["protrain-core", 1.0] == losses["pytorch", 1.0] != losses["pytorch", None]
    assert losses["protrain-core", None] == losses["pytorch", None]
    assert clipped(w).label == "tiny-4L clip1" and any(x.clip == 1.0 for x in SUITES["cpu-small"].workloads)


@pytest.mark.parametrize("system", ["protrain-lightning"])
def test_gpu_suite_builds_protrain_in_a_dry_run(system):
    """The CI subset of the dry run, in this process: ProTrain's configurations of gpu-80g's
    workloads and model ladder built on the meta device (blocks, traced order, chunk layout).
    ProTrain core's are built by the dry GPU session (tests/test_gpu_session.py)."""
    from benchmarks.run import SUITES, spec_of
    from benchmarks.systems import run

    suite = SUITES["gpu-80g"]
    for w in suite.workloads + suite.model_ladder:
        result = run(spec_of(suite, system, w, dry_run=True))
        assert result["status"] == "dry-run", result.get("traceback", result)


@pytest.mark.slow
def test_cpu_smoke_trains_every_available_system(smoke):
    _, stdout, report = smoke
    here = [s for s in SYSTEMS if unavailable(s, "cpu") is None]
    assert {"protrain-lightning", "protrain-core", "pytorch", "fsdp2-offload", "fsdp2-offload-ac"} <= set(here)
    runs = {r["system"]: r for r in report["runs"] if r["devices"] == 1}
    assert sorted(runs) == sorted(here)
    two = {r["system"]: r for r in report["runs"] if r["devices"] == 2}  # the devices=2 gloo row
    assert sorted(two) == ["protrain-core", "pytorch"] and two["protrain-core"]["losses"] == two["pytorch"]["losses"]
    for system in SYSTEMS:
        if system not in here:  # skipped with the reason, printed and reported
            assert report["skipped"][system] == unavailable(system, "cpu") and f"skipped {system}" in stdout
    for r in report["runs"]:
        assert r["status"] == "ok", r
        assert len(r["step_s"]) == report["steps"] and min(r["step_s"]) > 0
        assert r["tokens_per_s"] == pytest.approx(r["devices"] * r["batch"] * r["seq"] / r["step_median_s"])
        assert r["tflops"] > 0 and r["peak_host_rss_bytes"] > 2**20
        assert r["step_min_s"] <= r["step_median_s"] <= r["step_max_s"]
    # Same model, data and seed: ProTrain's losses are plain PyTorch's, bit for bit (fp32);
    # FSDP2's all-reduce-free world of one sums in another order, so only closely.
    ref = runs["pytorch"]["losses"]
    assert len(ref) == report["warmup"] + report["steps"]
    assert runs["protrain-core"]["losses"] == ref and runs["protrain-lightning"]["losses"] == ref
    for system in ("fsdp2-offload", "fsdp2-offload-ac"):
        assert runs[system]["losses"] == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
def test_cpu_smoke_reports_protrain_plan_fidelity_and_bound(smoke):
    _, _, report = smoke
    for system in ("protrain-core", "protrain-lightning"):
        r = next(r for r in report["runs"] if r["system"] == system)
        assert r["plan"].startswith("Plan(") and r["predicted_step_s"] > 0 and r["predicted_peak_bytes"] > 0
        bound = r["bound"]
        assert r["lower_bound_s"] == max(bound["compute_s"], bound["transfer_s"], bound["cpu_adam_s"]) > 0
        assert r["vs_lower_bound"] == pytest.approx(r["step_median_s"] / r["lower_bound_s"])
    core = next(r for r in report["runs"] if r["system"] == "protrain-core")
    assert core["peak_device_bytes_tracked"] > 0  # the CPU "device": measured by the tensor tracker


@pytest.mark.slow
def test_cpu_smoke_probes(smoke):
    _, _, report = smoke
    probes = report["probes"]
    assert {p["system"] for p in probes} == {"protrain-core"}  # the suite probes one system (seconds)
    (run,) = [r for r in report["runs"] if r["system"] == "protrain-core" and r["devices"] == 1]
    for kind in ("max model", "max batch"):
        tried = [p for p in probes if p["probe"] == kind]
        assert len(tried) == 2 and all(p["status"] == "ok" for p in tried)
        # The ladders' second step is the throughput run's configuration: its result is reused.
        assert len(tried[0]["step_s"]) == 2 and tried[1]["step_s"] == run["step_s"]
    model = [p["params"] for p in probes if p["probe"] == "max model"]
    batch = [p["batch"] for p in probes if p["probe"] == "max batch"]
    assert model[0] < model[1] and batch == [2, 4]  # ascending ladders


@pytest.mark.slow
def test_cpu_smoke_writes_table_json_and_figures(smoke):
    out, stdout, report = smoke
    md = (out / "results.md").read_text()
    assert md in stdout  # the table is printed as well
    for r in report["runs"]:
        assert f"| {r['system']} | ok | {r['tokens_per_s']:,.0f} |" in md
    assert "lower bound" in md and "| max batch | protrain-core | batch 4 | none of the ladder |" in md
    assert report["figures"] == ["throughput.png", "memory.png", "fidelity.png", "timeline.png", "probes.png"]
    for name in report["figures"]:
        assert plt.imread(out / name)[..., :3].std() > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["gpu-80g", "gpu-141g"])
def test_gpu_suites_dry_run_constructs_every_configuration(tmp_path, suite):
    bench("--suite", suite, "--dry-run", out=tmp_path)
    report = json.loads((tmp_path / "results.json").read_text())
    statuses = {(r["system"], r["label"], r["batch"]): r["status"] for r in report["runs"]}
    assert set(statuses.values()) == {"dry-run"}, [r for r in report["runs"] if r["status"] != "dry-run"]
    from benchmarks.run import SUITES

    s = SUITES[suite]
    here = [x for x in SYSTEMS if unavailable(x, "cuda") is None]
    probing = [x for x in here if s.probe_systems is None or x in s.probe_systems]
    expected = sum(len([x for x in here if w.systems is None or x in w.systems]) for w in s.workloads)
    assert len(statuses) == expected + len(probing) * len(s.model_ladder + s.batch_ladder)
    assert {r["label"] for r in report["runs"]} >= {w.label for w in s.workloads}
    # At least one model fits the device with plain PyTorch, and at least one does not.
    gib = [16 * r["params"] / 2**30 for r in report["runs"] if r["system"] == "pytorch"
           and r["label"] in {w.label for w in s.workloads}]
    device_gib = 80 if suite == "gpu-80g" else 141
    assert min(gib) < device_gib / 2 and max(gib) > device_gib


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_suite_without_a_gpu_says_what_to_do(tmp_path):
    from benchmarks.run import main

    with pytest.raises(SystemExit) as exit_:
        main(["--suite", "gpu-80g", "--out", str(tmp_path)])
    assert "--dry-run" in str(exit_.value.code) and "needs a CUDA GPU" in str(exit_.value.code)


@pytest.mark.slow
def test_out_of_memory_and_timeout_are_results(tmp_path):
    """No ProTrain plan fitting the budget is reported as OOM; a run past its time limit as a
    timeout -- and the report is still written."""
    bench("--suite", "cpu-smoke", "--systems", "protrain-core", "--no-probes", "--memory-budget", "64KiB",
          out=tmp_path / "oom")
    for run in json.loads((tmp_path / "oom" / "results.json").read_text())["runs"]:  # one process and two
        assert run["status"] == "oom" and "No ProTrain plan fits" in run["error"]
    assert "| protrain-core | OOM: " in (tmp_path / "oom" / "results.md").read_text()
    bench("--suite", "cpu-smoke", "--systems", "pytorch", "--no-probes", "--timeout", "1", out=tmp_path / "slow")
    for run in json.loads((tmp_path / "slow" / "results.json").read_text())["runs"]:
        assert run["status"] == "timeout" and "timed out after 1 s" in run["error"]


@pytest.mark.slow
def test_resume_keeps_the_runs_of_the_previous_report(tmp_path):
    bench("--suite", "cpu-smoke", "--systems", "pytorch", "--no-probes", "--timeout", "1", out=tmp_path)
    first = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["status"] for r in first] == ["timeout", "timeout"]  # one process and two
    bench("--suite", "cpu-smoke", "--systems", "pytorch", "--no-probes", "--resume", out=tmp_path)
    again = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert again == first  # a timeout is a result: kept, not run again
    bench("--suite", "cpu-smoke", "--systems", "pytorch,protrain-core", "--no-probes", "--resume", "--timeout", "1",
          out=tmp_path)
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["system"] for r in runs] == ["protrain-core", "pytorch"] * 2 and [runs[1], runs[3]] == first


def test_unknown_system_is_refused(tmp_path, capsys):
    from benchmarks.run import main

    with pytest.raises(SystemExit) as exit_:
        main(["--suite", "cpu-smoke", "--systems", "protrain-core,megatron", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "unknown system(s) megatron" in capsys.readouterr().err


def test_precision_drift_benchmark_runs_and_its_fp32_row_is_exact(capsys):
    """benchmarks.bench_precision (benchmarks/HISTORY.md): the two bf16-mixed recipes against fp32;
    ProTrain's 32-true run equals the fp32 reference bitwise (a check of the set-up)."""
    import argparse

    from benchmarks.bench_precision import batches, build, main, plain, protrain

    args = argparse.Namespace(steps=3, layers=1, hidden=64, seq=16, batch=2, vocab=512, lr=1e-3)
    model, data = build(args), batches(args)
    assert protrain(model, data, "32-true", args.lr) == plain(model, data, False, args.lr)
    assert main(["--steps", "3", "--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "2"]) == 0
    rows = {line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert {"fp32", "lightning-bf16", "protrain-bf16", "protrain-fp32"} <= rows


def _fake_launch(outcomes):
    """benchmarks.run.launch without processes: each spec's result from ``outcomes[label]``."""
    def launch(specs, timeout, log_dir):
        results = []
        for s in specs:
            ok = outcomes[s["label"]]
            results.append({"status": "ok", "step_s": [0.01] * s["steps"], "losses": [1.0]} if ok
                           else {"status": "error", "error": "RuntimeError: broken"})
        return results
    return launch


def test_a_relative_out_directory_is_where_the_systems_write(tmp_path, monkeypatch):
    """The systems run with the repository as their working directory: ``--out smoke`` given
    elsewhere made every one fail to write its result (and the runner still exited 0)."""
    from benchmarks import run

    dirs = []
    monkeypatch.setattr(run, "launch", lambda specs, timeout, log_dir: dirs.append(log_dir) or
                        _fake_launch({s["label"]: True for s in specs})(specs, timeout, log_dir))
    monkeypatch.chdir(tmp_path)
    assert run.main(["--suite", "cpu-smoke", "--systems", "pytorch", "--no-probes", "--out", "smoke"]) == 0
    assert dirs and all(d.is_absolute() and d.is_relative_to(tmp_path / "smoke") for d in dirs), dirs
    assert (tmp_path / "smoke" / "results.json").is_file()


def test_resume_keeps_errors_it_does_not_rerun_and_replaces_those_it_does(tmp_path, monkeypatch):
    """A piece of a session (--resume --workloads) keeps the other pieces' rows, their errors
    included; an error of a selected workload is run again and replaced."""
    from benchmarks import run

    kw = dict(systems=["pytorch"], dry_run=False, probes=False, timeout=10, out=tmp_path, resume=True)
    suite = run.SUITES["cpu-smoke"]
    monkeypatch.setattr(run, "launch", _fake_launch({"tiny-4L": False, "tiny-4L x2": True}))
    run.run_suite("cpu-smoke", suite, workloads={"tiny-4L"}, **kw)
    run.run_suite("cpu-smoke", suite, workloads={"tiny-4L x2"}, **kw)
    rows = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["label"], r["status"]) for r in rows] == [("tiny-4L", "error"), ("tiny-4L x2", "ok")]
    assert "error: RuntimeError: broken" in (tmp_path / "results.md").read_text()
    monkeypatch.setattr(run, "launch", _fake_launch({"tiny-4L": True, "tiny-4L x2": False}))
    run.run_suite("cpu-smoke", suite, workloads={"tiny-4L"}, **kw)  # the error again: now it trains
    run.run_suite("cpu-smoke", suite, workloads=None, **kw)  # every run is done: nothing runs
    rows = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["label"], r["status"]) for r in rows] == [("tiny-4L", "ok"), ("tiny-4L x2", "ok")]


def test_a_figure_that_cannot_be_drawn_loses_no_result(tmp_path, monkeypatch, capsys):
    from benchmarks import figures, run

    def broken(report, out):
        raise ValueError("a drawing bug")

    monkeypatch.setattr(figures, "write_figures", broken)
    monkeypatch.setattr(run, "launch", _fake_launch({"tiny-4L": True, "tiny-4L x2": True}))
    report = run.run_suite("cpu-smoke", run.SUITES["cpu-smoke"], systems=["pytorch"], dry_run=False, probes=False,
                           timeout=10, out=tmp_path, workloads={"tiny-4L"})
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"] == report["runs"] and report["runs"][0]["status"] == "ok"
    assert saved["figures"] == "drawing the figures failed: ValueError: a drawing bug"


def test_resume_refuses_another_machines_report(tmp_path, monkeypatch):
    from benchmarks import run

    monkeypatch.setattr(run, "launch", _fake_launch({"tiny-4L": True}))
    kw = dict(systems=["pytorch"], dry_run=False, probes=False, timeout=10, out=tmp_path, workloads={"tiny-4L"})
    run.run_suite("cpu-smoke", run.SUITES["cpu-smoke"], **kw)
    saved = json.loads((tmp_path / "results.json").read_text())
    saved["machine"]["gpu"] = "NVIDIA H200, 141 GiB"
    (tmp_path / "results.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="would mix them"):
        run.run_suite("cpu-smoke", run.SUITES["cpu-smoke"], resume=True, **kw)


def test_the_ddp_benchmark_lists_each_profiled_systems_operators():
    """``bench_ddp --profile N``: a table of rank 0's operators by self CPU time under each
    system that was profiled, after the timing table (whose rows stay as they were)."""
    from benchmarks.bench_ddp import markdown

    row = {"size": "8M", "params": 7.9e6, "times_s": [0.5], "last_loss": 1.0}
    ops = [{"op": "aten::mm", "calls": 435, "self_ms": 1756.44}, {"op": "aten::fill_", "calls": 335, "self_ms": 18.3}]
    md = markdown([{**row, "system": "ddp", "median_s": 0.5, "profile": ops},
                   {**row, "system": "protrain all-persistent", "median_s": 0.625, "profile": []}])
    assert "| 8M (7.9M) | protrain all-persistent | 625.0 ms | 0.500 | 0.80x | 1.0000 |" in md
    table = md.split("8M, ddp: operators by self CPU time, rank 0, the profiled steps")[1]
    assert "| aten::mm | 435 | 1756.4 ms |\n| aten::fill_ | 335 | 18.3 ms |" in table
    assert "all-persistent: operators" not in md  # not profiled: no table


def test_the_ddp_benchmark_tables_each_systems_phases_and_its_rounds():
    """``bench_ddp``: the medians of each step's forward, backward and update per system, and of
    the page faults in each, after the step table, saying when the systems ran in turn
    (``--rounds``)."""
    from benchmarks.bench_ddp import markdown

    row = {"size": "8M", "params": 7.9e6, "times_s": [0.5, 0.7], "last_loss": 1.0, "rounds": 2}
    md = markdown([{**row, "system": "ddp", "median_s": 0.6, "phases_s": [0.2, 0.38, 0.02], "faults": [3.0, 2300.5, 0]},
                   {**row, "system": "protrain all-persistent", "median_s": 0.625, "phases_s": [0.2, 0.4, 0.025],
                    "faults": [1, 7800, 0]}])
    assert "Medians of each phase, rank 0 (2 rounds, the systems in turn)" in md
    assert ("| 8M | ddp | 200.0 ms | 380.0 ms | 20.0 ms | 3 / 2300 / 0 |\n"
            "| 8M | protrain all-persistent | 200.0 ms | 400.0 ms | 25.0 ms | 1 / 7800 / 0 |") in md
    one = markdown([{**row, "rounds": 1, "system": "ddp", "median_s": 0.6, "phases_s": [0.2, 0.38, 0.02]}])
    assert "Medians of each phase, rank 0\n" in one and "rounds" not in one


def test_the_collectives_benchmark_runs_every_way_and_checks_each_result():
    """``bench_collectives`` (2 gloo processes): every way to reduce and to gather a chunk,
    ProTrain's included, on the same buffers, each result compared with the first way's bit for
    bit (two ranks: each way adds the same two numbers)."""
    from benchmarks.bench_collectives import markdown, measure

    rows = measure([0.004], reps=1, rounds=1)
    assert [(r["kind"], r["way"]) for r in rows] == [
        ("reduction", "all-reduce"), ("reduction", "reduce-scatter"), ("reduction", "all-to-all"),
        ("reduction", "messages"), ("gather", "all-gather"), ("gather", "broadcasts")]
    assert all(r["same"] for r in rows), rows
    md = markdown(rows)
    assert md.count("| 0.0 MB | reduction |") == 4 and "| 1.00x | yes |" in md


def test_the_deepcopy_benchmark_copies_the_wrapped_model_as_plain_pytorch_copies_its_own():
    """``bench_deepcopy``: a deep copy of the wrapped model holds the same tensor bytes as a
    deep copy of the model trained by plain PyTorch (32-true: the same fp32 parameters and
    buffers); before, it took the engine's chunks along (masters, moments, host buffers)."""
    from benchmarks.bench_deepcopy import main

    rows = main(["--layers", "1", "--hidden", "64", "--precision", "32-true", "--reps", "1"])
    assert [name for name, _, _ in rows] == ["pytorch", "protrain, every chunk streamed", "protrain, every chunk persistent"]
    assert rows[0][2] > 0 and all(nbytes == rows[0][2] for _, _, nbytes in rows), rows


def test_the_param_access_benchmark_counts_only_the_models_own_calls():
    """``bench_param_access``: per step ManagedParameter sees the model's uses of its weights
    only (each block's 7 projections and 2 norms, recomputed ones again, the head, the final
    norm, the embedding), none of the runtime's own re-pointing and gradient moves."""
    from benchmarks.bench_param_access import main

    costs, counts = main(["--layers", "2", "--rounds", "1", "--calls", "10"])
    assert [what for what, *_ in costs] == ["F.linear(x, w), x 8 x 64", "w.grad"]
    assert counts["all-persistent"] == {"linear": 2 * 7 + 1, "mul": 2 * 2 + 1, "embedding": 1}
    assert counts["streamed, every block checkpointed"] == {"linear": 2 * 2 * 7 + 1, "mul": 2 * 2 * 2 + 1, "embedding": 1}


def test_the_adam_benchmark_rates_every_moment_format_alone_and_beside_copies():
    """bench_adam's format rows (issue 54, item 5): each format on each thread count, alone
    and while a copy load runs both ways, with its bytes and page-locked bytes per parameter
    (no speed is asserted: CI shares its cores)."""
    from benchmarks import bench_adam

    rows = bench_adam.format_rows(hidden=64, iters=1, threads=(1,))
    assert [(r["format"], r["load"]) for r in rows] == [(f, load) for f in ("fp32", "bf16", "8bit") for load in (False, True)]
    assert [r["bytes_per_param"] for r in rows[::2]] == [32, 24, 20]
    assert all(r["pinned_bytes_per_param"] == 2.0 and r["params_per_s"] > 0 for r in rows)
    assert all((r["copy_bytes_per_s"] > 0) is r["load"] for r in rows)
    assert "| bf16 | 1 | both ways |" in bench_adam.format_markdown(rows, 1)


def test_the_largest_model_benchmark_trains_a_rung_built_on_the_meta_device():
    """benchmarks/bench_largest.py (a GPU session's top rungs) on the CPU with the tiny LLaMA:
    built on the meta device, initialised chunk by chunk, a searched plan after the live
    profile, finite losses and every figure reported; LoRA over an int8 base alike."""
    from benchmarks.bench_largest import run

    for lora in (None, 4):
        r = run("tiny-llama", device="cpu", batch_size=1, seq_len=16, steps=1, warmup=1, lora_rank=lora,
                frozen_dtype="int8" if lora else None)
        assert r["plan"].startswith("Plan(") and len(r["step_s"]) == 2 and r["median_step_s"] > 0
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["trained"] < r["parameters"] if lora else r["trained"] == r["parameters"]
        assert r["host_peak_rss_bytes"] > 0 and r["device_peak_bytes"] is None
