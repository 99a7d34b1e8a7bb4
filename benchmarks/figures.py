"""The benchmark report's figures, drawn with matplotlib (the optional ``bench`` extra:
``pip install -e ".[bench]"``).

``write_figures(report, out)`` writes every figure the report has data for into ``out`` and
returns their paths:

- ``throughput.png``: tokens/s of each system on each workload, ordered by model size; a run
  that ran out of memory (or failed) is marked where its bar would be;
- ``memory.png``: each ProTrain run's peak device memory by category (persistent chunks, chunk
  buffers, activations and the rest) and its host memory (model states, swapped activations),
  the search's prediction beside the measurement: the measured peak (CUDA allocator, or the
  tensor tracker on a CPU), split into the chunks and buffers the engine allocated and the rest;
- ``fidelity.png``: predicted against measured step time, for every ProTrain run and for the
  study run's plans, with the line of perfect prediction and a +-10 % band;
- ``timeline.png``: one ProTrain step of the study run, lane by lane (compute phases, host->
  device and device->host copies, collectives, each chunk's CPU Adam and its thread);
- ``probes.png``: the largest-model and largest-batch ladders, tokens/s per rung, failures marked.

Without matplotlib, ``write_figures`` raises ``FiguresUnavailable`` with the install command;
the runner then writes its Markdown and JSON alone and says so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from protrain_core import timeline_figure

INSTALL = 'pip install -e ".[bench]"  (matplotlib)'
save = timeline_figure.save  # every figure is written atomically, with the umask's mode


class FiguresUnavailable(RuntimeError):
    pass


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_figures(report: dict, out: Path) -> list[Path]:
    if not available():
        raise FiguresUnavailable(f"figures need matplotlib, which is not installed: {INSTALL}")
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for name, draw in (("throughput.png", throughput), ("memory.png", memory), ("fidelity.png", fidelity),
                       ("timeline.png", timeline), ("probes.png", probes)):
        fig = draw(report)
        if fig is not None:
            written.append(save(fig, Path(out) / name))
    return written


def _title(report: dict, what: str) -> str:
    where = report["machine"].get("gpu") or f"CPU: {report['machine'].get('cpu', '?')}"
    return f"{report['suite']}: {what}\n{where}, {report['precision']}, {report['date']}"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def short_plan(plan: str) -> str:
    """"Plan(n_persist=1, n_buffer=2, n_swap=0, n_checkpoint=3)" -> "1/2/0/3"."""
    return "/".join(re.findall(r"=(\d+)", plan)) or plan


def _failure(row: dict) -> str:
    return {"oom": "OOM", "timeout": "timeout"}.get(row["status"], row["status"])


def grouped_bars(ax, groups: list[str], series: dict[str, list[dict | None]], value: str, log: bool) -> None:
    """One group of bars per entry of ``groups``, one bar per series; a row that did not
    succeed is written where its bar would be; a missing row leaves a gap."""
    width = 0.8 / max(len(series), 1)
    for i, (name, rows) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [r[value] if r and value in r else 0 for r in rows]
        bars = ax.bar(xs, heights, width * 0.95, label=name)
        for x, bar, r in zip(xs, bars, rows):
            if r is None:
                continue
            if value in r:
                ax.annotate(f"{r[value]:,.0f}", (x, bar.get_height()), ha="center", va="bottom", fontsize=7,
                            rotation=90 if len(series) > 3 else 0, xytext=(0, 2), textcoords="offset points")
            else:
                ax.annotate(_failure(r), (x, 0), ha="center", va="bottom", fontsize=7, rotation=90, color="#c44e52",
                            xytext=(0, 3), textcoords="offset points", xycoords=("data", "axes fraction"))
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def throughput(report: dict):
    import matplotlib.pyplot as plt

    runs = report["runs"]
    if not runs or report.get("dry_run"):
        return None
    by_size = sorted(dict.fromkeys(r["label"] for r in runs), key=lambda lab: next(
        (r["params"], r.get("devices", 1)) for r in runs if r["label"] == lab))
    params = {r["label"]: r["params"] for r in runs}
    systems = list(dict.fromkeys(r["system"] for r in runs))
    row = {(r["system"], r["label"]): r for r in runs}
    series = {s: [row.get((s, lab)) for lab in by_size] for s in systems}
    values = [r["tokens_per_s"] for r in runs if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(by_size) * max(len(systems), 2) / 2), 4.2),
                           layout="constrained")
    grouped_bars(ax, [f"{lab}\n({_count(params[lab])})" for lab in by_size], series, "tokens_per_s",
                 log=bool(values) and max(values) / max(min(values), 1e-9) > 30)
    ax.set_ylabel("tokens/s (more is better)")
    ax.set_title(_title(report, "training throughput by model size"), fontsize=9)
    return fig


def _memory_rows(report: dict) -> list[tuple[str, dict]]:
    rows = [r for r in report["runs"] + report.get("study", []) if r.get("memory")]
    return [(f"{r['label']}\n{r['system'].replace('protrain-', '')}", r["memory"]) for r in rows]


def memory(report: dict):
    import matplotlib.pyplot as plt

    rows = _memory_rows(report)
    if not rows:
        return None
    fig, (dev, host) = plt.subplots(1, 2, figsize=(max(9.0, 3.6 * len(rows)), 4.6), layout="constrained")
    for ax, categories in ((dev, ("persistent chunks", "chunk buffers", "activations and the rest")),
                           (host, ("host: model states", "host: swapped activations"))):
        labels = []
        for i, (name, m) in enumerate(rows):
            for j, kind in enumerate(("predicted", "measured")):
                x = 3 * i + j
                bottom = 0.0
                for k, cat in enumerate(categories):
                    v = (m[kind].get(cat) or 0) / 2**20
                    ax.bar(x, v, 0.9, bottom=bottom, color=f"C{k}", label=cat if i == j == 0 else None,
                           hatch="//" if kind == "predicted" else None, edgecolor="white")
                    bottom += v
                ax.annotate(f"{bottom:.3g}", (x, bottom), ha="center", va="bottom", fontsize=7)
                labels.append((x, "pred." if kind == "predicted" else "meas."))
        ax.set_xticks([x for x, _ in labels], [t for _, t in labels], fontsize=7)
        for i, (name, _) in enumerate(rows):
            ax.annotate(name, (3 * i + 0.5, 0), xytext=(0, -26), textcoords="offset points", ha="center",
                        va="top", fontsize=7, xycoords=("data", "axes fraction"))
        ax.set_ylabel("MiB")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    dev.set_title("peak device memory: predicted (hatched) and measured\n(measured: the peak; of it, the chunks and "
                  "buffers as the engine allocates them)", fontsize=9)
    host.set_title("host memory: predicted (hatched) and measured", fontsize=9)
    fig.suptitle(_title(report, "ProTrain memory by category"), fontsize=9)
    return fig


def _fidelity_points(report: dict) -> list[tuple[float, float, str, str]]:
    points = [(r["predicted_step_s"], r["step_median_s"], f"{r['label']} ({r['system']})", "run")
              for r in report["runs"] if r.get("predicted_step_s") and r.get("step_median_s")]
    for r in report.get("study", []):
        points += [(p["predicted_step_s"], p["measured_step_s"], short_plan(p["plan"]),
                    "study: searched plan" if p["searched"] else "study: other plans")
                   for p in r.get("plans", []) if "measured_step_s" in p]
    return points


def fidelity(report: dict):
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    points = _fidelity_points(report)
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    lo = min(min(p, m) for p, m, _, _ in points) * 0.8
    hi = max(max(p, m) for p, m, _, _ in points) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="measured = predicted")
    ax.fill_between([lo, hi], [lo / 1.1, hi / 1.1], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15, label="±10 %")
    for kind, marker in (("run", "o"), ("study: other plans", "s"), ("study: searched plan", "*")):
        mine = [pt for pt in points if pt[3] == kind]
        if mine:
            ax.scatter([p for p, *_ in mine], [m for _, m, *_ in mine], marker=marker, s=60 if marker == "*" else 30,
                       label=kind, zorder=3)
            for p, m, name, _ in mine:
                ax.annotate(name, (p, m), fontsize=6, xytext=(4, -3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    seconds = FuncFormatter(lambda v, _: f"{v:.3g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(seconds)
        axis.set_minor_formatter(seconds)
    ax.tick_params(which="minor", labelsize=6)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("measured step time (s, median)")
    ax.annotate("study plans: n_persist/n_buffer/n_swap/n_checkpoint", (0.99, 0.01), xycoords="axes fraction",
                ha="right", va="bottom", fontsize=6)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(_title(report, "cost model: predicted against measured step time"), fontsize=9)
    return fig


def timeline(report: dict):
    study = next((r for r in report.get("study", []) if r.get("timeline")), None)
    if study is None:
        return None
    tl = study["timeline"]
    overlap = study.get("adam_in_backward")
    sub = f"{study['label']}, {tl['plan']}; {tl['overlap']}" + (
        f"; {overlap:.0%} of CPU Adam time ran during backward" if overlap is not None else "")
    return timeline_figure.draw(tl, _title(report, "one ProTrain step") + "\n" + sub)


def probes(report: dict):
    import matplotlib.pyplot as plt

    kinds = [k for k in ("max model", "max batch") if any(r.get("probe") == k for r in report.get("probes", []))]
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.4), squeeze=False, layout="constrained")
    for ax, kind in zip(axes[0], kinds):
        rows = [r for r in report["probes"] if r["probe"] == kind]
        rungs = list(dict.fromkeys((r["label"], r["batch"]) for r in rows))
        systems = list(dict.fromkeys(r["system"] for r in rows))
        row = {(r["system"], r["label"], r["batch"]): r for r in rows}
        names = [f"{lab}\n({_count(next(r['params'] for r in rows if r['label'] == lab))})" if kind == "max model"
                 else f"batch {b}" for lab, b in rungs]
        grouped_bars(ax, names, {s: [row.get((s, lab, b)) for lab, b in rungs] for s in systems}, "tokens_per_s",
                     log=False)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{kind}: ascending, the first failure ends a ladder", fontsize=9)
    fig.suptitle(_title(report, "largest model and batch that train"), fontsize=9)
    return fig
