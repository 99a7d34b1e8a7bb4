"""Peak host memory of ``wrap`` (issue 57 item 1): a LLaMA in bf16 wrapped with every chunk
streamed, each way it can arrive -- built on the host (``cast``), ``from_pretrained``, LoRA
over it, and built on the meta device with its weights read straight into the chunks
(``meta``, [Note: weights straight into chunks]) -- each in a fresh process: the RSS before
``wrap`` and its peak during it (``VmHWM``, reset through ``/proc/self/clear_refs``), beside the
model's, the states' and one chunk's bytes. tests/test_wrap_memory.py runs the 169M shape.

    python -m benchmarks.bench_wrap_memory [--shape 1b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SMALL = (8, 1024, 2816)  # layers, hidden, intermediate: 169M parameters
SHAPES = {"169m": SMALL, "1b": (22, 2048, 5632)}  # 1b: TinyLlama-1.1B's shape

SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import protrain_core as pt

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    how = sys.argv[1]
    torch.manual_seed(0)
    layers, hidden, inter = json.loads(sys.argv[3])
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter, num_attention_heads=hidden // 128,
                      num_key_value_heads=hidden // 128, vocab_size=32000, max_position_embeddings=256)
    if how == "save":
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[2])
        sys.exit()
    weights = None
    if how == "from_pretrained":
        model = LlamaForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)
    elif how == "meta":  # weights straight into the chunks, no host copy of the model
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        weights = sys.argv[2]
    else:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    precision = "bf16-true"
    if how.startswith("lora"):
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        precision = "bf16-mixed"
    for p in model.parameters():  # touch every page the model owns (a file mapping counts only once read)
        p.data.sum()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    config = pt.ProTrainConfig(frozen_dtype="int8" if how == "lora-int8" else None,  # the base quantised chunk by chunk
                               weights=weights)
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=1), precision=precision, device="cpu", config=config)
    peak = status("VmHWM")
    states = engine.memory.host_bytes() + engine.memory.device_bytes()  # (the persistent chunks')
    print(json.dumps(dict(model=model_bytes, states=states, chunk=engine.layout.chunk_size * 2, before=before,
                          peak=peak, largest=max(p.numel() * p.element_size() for p in model.parameters()))))
""")


def measure(how: str, directory, shape=SMALL) -> dict:
    """One way of wrapping, in a fresh process: the model's, the states', a chunk's and the
    largest tensor's bytes, the RSS before ``wrap`` and its peak during it."""
    if how in ("from_pretrained", "meta"):  # the checkpoint written by another process
        _run("save", directory, shape)
    return json.loads(_run(how, directory, shape).stdout.strip().splitlines()[-1])


def _run(how: str, directory, shape):
    r = subprocess.run([sys.executable, "-c", SCRIPT, how, str(Path(directory) / "model"), json.dumps(shape)],
                       capture_output=True, text=True, timeout=3600, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if r.returncode != 0:
        raise RuntimeError(f"{how}: {r.stderr[-3000:]}")
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="169m")
    parser.add_argument("--ways", default="cast,from_pretrained,meta")
    args = parser.parse_args()
    mib = 2**20
    print("| way | model | states | chunk | RSS before wrap | peak rise during wrap |")
    print("|---|---|---|---|---|---|")
    for how in args.ways.split(","):
        with tempfile.TemporaryDirectory() as d:
            m = measure(how, d, SHAPES[args.shape])
        print(f"| {how} | {m['model'] / mib:,.0f} MiB | {m['states'] / mib:,.0f} MiB | {m['chunk'] / mib:,.0f} MiB | "
              f"{m['before'] / mib:,.0f} MiB | {(m['peak'] - m['before']) / mib:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
