"""benchmarks/figures.py: each figure draws the report's numbers (read back from the matplotlib
artists), the files decode, and without matplotlib the runner writes its tables and says why
there are no figures."""

import json

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.collections import PathCollection, PolyCollection

from benchmarks import figures, run

MIB = 2**20


def _run(system, label, params, tps=None, status="ok", **extra):
    row = {"system": system, "label": label, "params": params, "batch": 4, "seq": 64, "status": status, **extra}
    if tps is not None:
        row.update(tokens_per_s=tps, step_median_s=256 / tps, step_min_s=256 / tps, step_max_s=256 / tps, tflops=0.1)
    return row


def _memory(persistent, buffers, rest, states, swapped):
    return {"persistent chunks": persistent * MIB, "chunk buffers": buffers * MIB, "activations and the rest": rest * MIB,
            "host: model states": states * MIB, "host: swapped activations": swapped * MIB}


SPANS = [("compute", "forward", 0.0, 0.010, "MainThread"), ("compute", "backward", 0.010, 0.030, "MainThread"),
         ("compute", "step", 0.030, 0.031, "MainThread"), ("host->device", "chunk 1", 0.001, 0.002, "MainThread"),
         ("device->host", "chunk 1", 0.015, 0.016, "MainThread"),
         ("CPU Adam", "chunk 1", 0.016, 0.020, "protrain-cpu-adam_0")]


@pytest.fixture()
def report():
    return {
        "suite": "synthetic", "precision": "32-true", "date": "2026-11-23 00:00 UTC", "dry_run": False,
        "machine": {"cpu": "test CPU"},
        "runs": [
            _run("protrain-core", "big", 7_000_000, 300.0, predicted_step_s=0.9, memory={
                "predicted": _memory(10, 4, 20, 100, 5), "measured": _memory(10, 4, 18, 100, 6)}),
            _run("pytorch", "big", 7_000_000, status="oom", error="OutOfMemoryError: CUDA out of memory"),
            _run("protrain-core", "small", 1_000_000, 2000.0, predicted_step_s=0.12),
            _run("pytorch", "small", 1_000_000, 2500.0),
        ],
        "study": [_run("protrain-core", "small study", 1_000_000, 1900.0, plans=[
            {"plan": "Plan(n_persist=1, n_buffer=2, n_swap=0, n_checkpoint=1)", "searched": True,
             "predicted_step_s": 0.13, "measured_step_s": 0.14, "predicted_peak_bytes": 9 * MIB,
             "measured_peak_bytes": 8 * MIB},
            {"plan": "Plan(n_persist=0, n_buffer=2, n_swap=1, n_checkpoint=0)", "searched": False,
             "predicted_step_s": 0.2, "measured_step_s": 0.18, "predicted_peak_bytes": 7 * MIB,
             "measured_peak_bytes": 7 * MIB}],
            adam_in_backward=1.0,
            timeline={"plan": "Plan(n_persist=1, n_buffer=2, n_swap=0, n_checkpoint=1)",
                      "overlap": "cpu-adam-during-backward", "threaded": True,
                      "lanes": ["compute", "host->device", "device->host", "CPU Adam"],
                      "spans": [dict(zip(("lane", "label", "start", "end", "thread"), s)) for s in SPANS]})],
        "probes": [_run("protrain-core", "l2", 500_000, 900.0, probe="max model"),
                   _run("protrain-core", "l4", 1_000_000, status="oom", probe="max model", error="x")],
    }


def _bars(ax):
    return [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle) and p.get_width() < 1]


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_throughput_bars_by_model_size_with_oom_marked(report):
    fig = figures.throughput(report)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["small\n(1.0M)", "big\n(7.0M)"]  # ordered by model size, not by the report
    heights = [b.get_height() for b in _bars(ax)]
    assert heights == [2000.0, 300.0, 2500.0, 0]  # protrain-core's bars, then pytorch's (big: OOM)
    assert "OOM" in _texts(ax) and "2,000" in _texts(ax) and "2,500" in _texts(ax)
    assert ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["protrain-core", "pytorch"]
    report["runs"][0]["tokens_per_s"] = 10.0  # a 250x spread: a log axis
    assert figures.throughput(report).axes[0].get_yscale() == "log"
    plt.close("all")


def test_memory_stacks_each_category_predicted_beside_measured(report):
    fig = figures.memory(report)
    device, host = fig.axes[:2]
    # one run with memory: predicted then measured, each a stack of the categories (MiB)
    assert [b.get_height() for b in _bars(device)] == [10, 4, 20, 10, 4, 18]
    assert [b.get_height() for b in _bars(host)] == [100, 5, 100, 6]
    assert [b.get_hatch() for b in _bars(device)] == ["//"] * 3 + [None] * 3
    assert "34" in _texts(device) and "32" in _texts(device)  # the totals
    plt.close("all")


def test_fidelity_plots_every_prediction_against_its_measurement(report):
    fig = figures.fidelity(report)
    ax = fig.axes[0]
    points = sorted(tuple(map(float, xy)) for c in ax.collections if isinstance(c, PathCollection)
                    for xy in c.get_offsets())
    assert points == sorted([(0.9, 256 / 300), (0.12, 256 / 2000), (0.13, 0.14), (0.2, 0.18)])
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert {"1/2/0/1", "0/2/1/0"} <= set(_texts(ax))  # the study's plans, short
    plt.close("all")


def test_timeline_draws_every_span_in_its_lane(report):
    fig = figures.timeline(report)
    ax = fig.axes[0]
    lanes = [t.get_text() for t in ax.get_yticklabels()]
    assert lanes == ["CPU Adam\n(protrain-cpu-adam_0)", "device->host", "host->device", "compute"]
    rows = {}
    for c in ax.collections:
        if isinstance(c, PolyCollection):  # broken_barh's
            y = round(float(c.get_paths()[0].vertices[:, 1].mean()))
            rows[y] = sorted(round(float(p.vertices[:, 0].min()), 6) for p in c.get_paths())
    assert rows[3] == [0.0, 10.0, 30.0]  # compute: forward, backward, step (ms)
    assert rows[0] == [16.0]  # CPU Adam of chunk 1, during backward
    assert "100% of CPU Adam time ran during backward" in ax.get_title()
    plt.close("all")


def test_probes_show_each_ladder_with_its_first_failure(report):
    fig = figures.probes(report)
    ax = fig.axes[0]
    assert [b.get_height() for b in _bars(ax)] == [900.0, 0]
    assert "OOM" in _texts(ax)
    plt.close("all")


def test_write_figures_writes_png_files_atomically(report, tmp_path):
    written = figures.write_figures(report, tmp_path)
    assert [p.name for p in written] == ["throughput.png", "memory.png", "fidelity.png", "timeline.png", "probes.png"]
    for p in written:
        assert plt.imread(p).shape[0] > 200
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)  # no temporary files
    assert not plt.get_fignums()  # every figure closed


def test_a_report_without_data_for_a_figure_skips_it(report, tmp_path):
    report["study"], report["probes"] = [], []
    for r in report["runs"]:
        r.pop("memory", None)
    assert [p.name for p in figures.write_figures(report, tmp_path)] == ["throughput.png", "fidelity.png"]


def test_without_matplotlib_the_runner_writes_its_tables_and_says_why(report, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "available", lambda: False)
    with pytest.raises(figures.FiguresUnavailable, match=r'pip install -e "\.\[bench\]"'):
        figures.write_figures(report, tmp_path)
    report.update(command="python -m benchmarks.run --suite synthetic", description="synthetic", warmup=1, steps=2,
                  skipped={})
    report["machine"].update(cpu_threads=2, host_ram_gib=1, torch="x")
    assert run.write(report, tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "figures need matplotlib" in saved["figures"] and "bench" in saved["figures"]
    assert "| small (1.0M) | pytorch | ok |" in (tmp_path / "results.md").read_text()
