"""Peak resident memory of a training run against what its plan allocates (issue 30), printed as
one JSON line per case and process: ``python tests/scripts/host_rss.py CASE[,CASE...] [WORLD]``
(run with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then returns freed activation memory to the
system at once, so the resident size is what is alive; by default it grows the threshold to
the largest freed block and keeps such blocks resident for reuse).

The plan is searched ahead (``example_inputs``) under a budget that makes it stream chunks and
swap activations, so the explanation's host line has every part. On a CPU device the device is
host RAM too: the planned bytes are the plan's host bytes plus its predicted device peak. The
peak is the kernel's high-water mark (``VmHWM``) over steady training steps, reset after the
first steps (``/proc/self/clear_refs``); the baseline is the resident size before ``wrap``.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch



def _resident() -> tuple[int, int]:
    """(resident now, high-water mark) in bytes."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _model(case: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=6, n_head=4,
                                      bos_token_id=0, eos_token_id=0, use_cache=False))
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        base = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], lora_dropout=0.0))
    return base


def run(rank: int, world: int, case: str) -> dict:
    import protrain_core as pt

    model = _model(case)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (8, SEQ), generator=g) for _ in range(2)]
    gc.collect()  # the previous case's engine and model
    baseline = _resident()[0]
    x = data[0]
    engine = pt.wrap(model, opt, device="cpu", example_inputs={"input_ids": x, "labels": x},
                     report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(memory_budget=BUDGETS[case], profile_cache=False)))
    m = engine.choice.memory
    for step in range(6):
        if step == 2:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark from here: steady steps
        x = data[step % 2]
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
    peak = _resident()[1]
    out = {"case": case, "rank": rank, "plan": str(engine.plan), "baseline": baseline, "peak": peak,
           "planned_host": m.planned_host_bytes, "planned_device": m.peak_bytes,
           "planned_states": m.host_bytes - m.swap_host_bytes,
           "host_allocated": engine.memory.host_bytes(), "explain": engine.explain()}
    engine.close()
    return out


VOCAB, SEQ = 96, 64
BUDGETS = {"streamed": os.environ.get("BUDGET", "40MiB"), "lora": os.environ.get("BUDGET", "40MiB"),
           "two-processes": os.environ.get("BUDGET", "80MiB")}


def _rank(rank: int, world: int, port: int, case: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        print(json.dumps(run(rank, world, case)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    cases, world = sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if world == 1:
        for case in cases:  # one after the other: each from its own baseline
            print(json.dumps(run(0, 1, case)), flush=True)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(world, port, cases[0]), nprocs=world, start_method="spawn")
