"""Drawing a step's ``Timeline`` (runtime/timeline.py), recorded on a GPU or on the simulated
device, lane by lane: the compute phases, host->device and device->host copies (chunks dark,
swapped activations light), collectives, and each chunk's CPU Adam with its thread. matplotlib
is optional (``pip install matplotlib``, or the ``bench`` extra); ``draw`` says so when it is
missing. The benchmark report's figures (benchmarks/figures.py) use the same two functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from protrain_core.utils import atomic_file

LANE_COLOURS = {"compute": "#4c72b0", "host->device": "#55a868", "device->host": "#c44e52",
                "collectives": "#8172b2", "CPU Adam": "#dd8452"}
PHASE_COLOURS = {"forward": "#4c72b0", "backward": "#64b5cd", "step": "#8c8c8c"}


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def draw(timeline: dict, title: str):
    """A matplotlib figure of ``timeline`` (``Timeline.to_json()``) under ``title``."""
    if not available():
        raise RuntimeError('Drawing a timeline needs matplotlib: pip install matplotlib (or pip install -e ".[bench]").')
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = timeline["spans"]
    lanes = [lane for lane in LANE_COLOURS if any(s["lane"] == lane for s in spans)]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(lanes) + 1.8))
    visible = 2e-3 * max(s["end"] for s in spans) * 1e3  # the narrowest bar drawn (ms): 0.2 % of the step
    for y, lane in enumerate(reversed(lanes)):
        mine = [s for s in spans if s["lane"] == lane]
        colours = [PHASE_COLOURS.get(s["label"], LANE_COLOURS[lane]) if lane == "compute" else LANE_COLOURS[lane]
                   for s in mine]
        # activation swaps lighter than the chunks' copies
        colours = [matplotlib.colors.to_rgba(c, 0.35 if s["label"] == "activations" else 1.0)
                   for c, s in zip(colours, mine)]
        ax.broken_barh([(s["start"] * 1e3, max((s["end"] - s["start"]) * 1e3, visible)) for s in mine], (y - 0.35, 0.7),
                       facecolors=colours, edgecolor="none")
        if lane in ("compute", "CPU Adam"):
            for s in mine:
                text = s["label"].replace("chunk ", "c")
                ax.annotate(text, ((s["start"] + s["end"]) / 2 * 1e3, y), ha="center", va="center", fontsize=6,
                            color="white" if lane == "compute" else "black")
    threads = sorted({s["thread"] for s in spans if s["lane"] == "CPU Adam" and s["thread"]})
    names = {"CPU Adam": f"CPU Adam\n({', '.join(threads)})" if threads else "CPU Adam"}
    ax.set_yticks(range(len(lanes)), [names.get(lane, lane) for lane in reversed(lanes)], fontsize=8)
    ax.set_xlabel("ms since the recording began (copies: dark = a chunk, light = swapped activations)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)
    return fig


def save(fig, path) -> Path:
    """Write a figure as a PNG file atomically (``utils.atomic_file``), then close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_file(path) as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return Path(path)
