"""The measured steps the simulator is held to, replayed on it (issue 55, item 3).

    python -m benchmarks.bench_holdout

Each row of benchmarks/holdout/rows.json (a GPU session's measured step: hardware preset, model
shape, batch, precision, system, and for ProTrain its plan with the chunks it kept) is simulated
on the meta device -- plain PyTorch by ``simulate_plain``, ProTrain by ``simulate`` with the
row's plan -- and printed next to the measurement. The presets are fitted from plain PyTorch and
microbenchmarks, never from ProTrain's rows, so ProTrain's errors are hold-out errors (a plain
PyTorch row the preset was fitted on is in-sample). tests/test_simulator.py requires each row
within 10 %.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROWS = Path(__file__).with_name("holdout") / "rows.json"


def rows() -> list[dict]:
    return json.loads(ROWS.read_text())["rows"]


def replay(row: dict) -> float:
    """The row's step in simulated seconds."""
    from benchmarks.systems import build_model
    from protrain_core import models
    from protrain_core.simulator.device import SimulatedDevice
    from protrain_core.simulator.run import simulate, simulate_plain

    shape = dict(row["model"], seq=row["seq"])
    model = build_model(shape, "meta")
    config = model.config
    batch = models.token_batch(config, row["batch"], row["seq"], "meta")
    device = SimulatedDevice(row["hardware"])
    if row["system"] == "pytorch":
        return simulate_plain(model, batch, device=device, precision=row["precision"])
    plan = dict(zip(("n_persist", "n_buffer", "n_swap", "n_checkpoint"), map(int, row["plan"].split("/"))),
                persistent_chunks=tuple(row["persistent_chunks"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return simulate(model, optimizer, batch, device=device, plan=plan, precision=row["precision"]).step_s


def main() -> None:
    print("| row | measured | simulated | error |\n|---|---|---|---|")
    for row in rows():
        simulated = replay(row)
        print(f"| {row['name']} | {row['measured_s'] * 1e3:.2f} ms | {simulated * 1e3:.2f} ms "
              f"| {simulated / row['measured_s'] - 1:+.1%} |")


if __name__ == "__main__":
    main()
