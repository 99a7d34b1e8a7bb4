"""LLaMA-7B on a simulated H100 (or H200): the GPU contract's runs, and the figures the issue
notes give before and after a runtime change ([Note: the simulated device]).

    python -m benchmarks.bench_simulator [--hardware h100] [--seq 2048] [--json FILE]

No GPU is needed: the model lives on the meta device and the simulated device times the
runtime's CUDA path. Batch 32 x 2048 is compute-bound (a block's backward takes longer than
its chunk's copies, and the CPU Adam keeps pace with backward); batch 2 x 2048 is bound by
the host link, where both copy directions must run at once. For each plan (all persistent; all
streamed with 2 and 3 buffers; mixed; with swapped and checkpointed blocks) and variant
(bf16-mixed; with norm clipping at 1.0; 16-mixed) it prints the simulated step, the cost
model's prediction for the same plan and schedule, the compute stream's idle time by cause,
the host waits during backward that [Note: host waits] does not name, the time both copy
directions run at once in backward (and copies queued behind the other direction's), and the
share of the CPU Adam time inside backward, and the simulated peak of device memory (most
plans could not hold batch 32's activations on the device: these runs study schedules, and the
memory is counted, not refused); then the sharded runs (2 and 4 simulated ranks).
tests/test_simulator.py holds the runtime to the same runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import protrain_core as pt
from protrain_core import models
from protrain_core.runtime.device import BACKWARD_HOST_WAITS
from protrain_core.simulator.device import LAUNCH_QUEUE_FULL, SimulatedDevice
from protrain_core.simulator.run import Simulation, simulate
from protrain_core.utils import format_bytes, format_seconds

PLANS = {
    "all-persistent": pt.Plan(n_persist=34, n_buffer=0),
    "streamed-buf2": pt.Plan(n_persist=0, n_buffer=2),
    "streamed-buf3": pt.Plan(n_persist=0, n_buffer=3),
    "mixed": pt.Plan(n_persist=8, n_buffer=2),
    "swap": pt.Plan(n_persist=0, n_buffer=2, n_swap=4),
    "checkpoint": pt.Plan(n_persist=0, n_buffer=2, n_checkpoint=16),
    "mixed-swap-checkpoint": pt.Plan(n_persist=8, n_buffer=2, n_swap=2, n_checkpoint=12),
}
VARIANTS = {"bf16": ("bf16-mixed", None), "bf16-clip": ("bf16-mixed", ("norm", 1.0)), "fp16": ("16-mixed", None)}
COMPUTE_BOUND, LINK_BOUND = 32, 2  # batch sizes (x 2048 tokens)
# (plan, variant) at the compute-bound batch: every plan in bf16-mixed, the streaming ones also
# with norm clipping and in 16-mixed.
RUNS = [(plan, "bf16") for plan in PLANS] + [
    (plan, variant) for plan in ("streamed-buf2", "mixed", "swap", "mixed-swap-checkpoint") for variant in ("bf16-clip", "fp16")]
DUPLEX = ["streamed-buf2", "streamed-buf3", "mixed", "checkpoint"]  # at the link-bound batch
SHARDED = [(plan, world) for plan in ("streamed-buf2", "mixed") for world in (2, 4)]


def unnamed_backward_waits(result: Simulation):
    """Host waits of the thread that drives the device during backward at a call site that
    [Note: host waits] does not name (a full launch queue is the device's work, not a wait the
    runtime makes)."""
    return [w for w in result.report.host_waits if w.phase in ("backward", "recompute")
            and w.site.split(" < ")[0] not in BACKWARD_HOST_WAITS and w.label != LAUNCH_QUEUE_FULL]


class Runner:
    """Simulates the runs on one model and batch, reusing one profile per precision and world."""

    def __init__(self, hardware: str = "h100", batch: int = 32, seq: int = 2048, model: str = "llama-7b") -> None:
        self.hardware = hardware
        config = models.load_config(model)
        self.model, self.optimizer = models.build(config, "meta")
        self.batch = models.token_batch(config, batch, seq, "meta")
        self.profiles: dict = {}

    def run(self, plan: str | pt.Plan, variant: str = "bf16", world: int = 1) -> Simulation:
        """``plan``: a name of ``PLANS`` (LLaMA-7B's 34 chunks) or a Plan. The schedules are
        studied at batches whose activations most plans could not hold on the device: its memory
        is counted (``Simulation.device_peak_bytes``), not refused."""
        precision, clipping = VARIANTS[variant]
        key = (precision, world)
        device = SimulatedDevice(self.hardware, out_of_memory=False)
        result = simulate(self.model, self.optimizer, self.batch, device=device,
                          plan=PLANS.get(plan, plan), precision=precision, config=pt.ProTrainConfig(clipping=clipping),
                          world_size=world, profile=self.profiles.get(key))
        self.profiles[key] = result.profile
        return result


def row(plan: str, variant: str, world: int, result: Simulation, batch: int) -> dict:
    r = result.report
    waits = unnamed_backward_waits(result)
    top = sorted(r.idle_s.items(), key=lambda kv: -kv[1])[:3]
    return {
        "plan": plan, "variant": variant, "world": world, "batch": batch, "simulated_s": r.step_s,
        "predicted_s": result.predicted.total_s,
        "error": result.error, "idle_s": r.idle_total_s, "idle_top": [[cause, s] for cause, s in top],
        "unnamed_backward_waits": len(waits), "unnamed_backward_wait_s": sum(w.seconds for w in waits),
        "duplex_backward_s": r.duplex_backward_s, "copy_backward_s": r.copy_busy_backward_s, "half_duplex_s": r.half_duplex_s,
        "cpu_adam_s": r.cpu_adam_s, "cpu_adam_in_backward": r.cpu_adam_inside_backward, "backward_s": r.backward_s,
        "collectives": r.collectives, "reduce_scatter_waits_backward_s": sum(r.waits_for_backward("reduce-scatter")),
        "device_peak_bytes": result.device_peak_bytes, "device_memory_bytes": result.device_memory_bytes,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| plan | variant | batch | ranks | simulated | cost model | error | compute idle | largest idle causes | "
             "backward host waits not named | copies in backward: h2d / d2h / both at once / behind the other "
             "direction | CPU Adam inside backward | device memory, simulated peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        causes = "; ".join(f"{c} {format_seconds(s)}" for c, s in x["idle_top"]) or "-"
        copies = " / ".join(format_seconds(v) for v in (*x["copy_backward_s"].values(), x["duplex_backward_s"],
                                                        x["half_duplex_s"]))
        lines.append(
            f"| {x['plan']} | {x['variant']} | {x['batch']} | {x['world']} | {format_seconds(x['simulated_s'])} | "
            f"{format_seconds(x['predicted_s'])} | {100 * x['error']:+.1f} % | {format_seconds(x['idle_s'])} | {causes} | "
            f"{x['unnamed_backward_waits']} ({format_seconds(x['unnamed_backward_wait_s'])}) | {copies} | "
            f"{100 * x['cpu_adam_in_backward']:.0f} % | {format_bytes(x['device_peak_bytes'])}"
            f"{' (over the device)' if x['device_peak_bytes'] > x['device_memory_bytes'] else ''} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h100", help="h100, h200 or a JSON file (protrain_core/simulator/hardware.py)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    runner, linked = Runner(args.hardware, COMPUTE_BOUND, args.seq), Runner(args.hardware, LINK_BOUND, args.seq)
    rows = [row(plan, variant, 1, runner.run(plan, variant), COMPUTE_BOUND) for plan, variant in RUNS]
    rows += [row(plan, "bf16", 1, linked.run(plan, "bf16"), LINK_BOUND) for plan in DUPLEX]
    rows += [row(plan, "bf16", world, runner.run(plan, "bf16", world), COMPUTE_BOUND) for plan, world in SHARDED]
    print(f"LLaMA-7B, sequences of {args.seq}, on {SimulatedDevice(args.hardware).spec.name} "
          f"({time.perf_counter() - start:.0f} s of real time)\n")
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
