"""Wrapping a model held in bf16 never holds two copies of it: the peak host RSS during
``wrap`` stays within the RSS before it (the model included) plus the model-state bytes plus
one chunk. Measured in a fresh process (``VmHWM`` reset through ``/proc/self/clear_refs``) on
a 169 M-parameter LLaMA (322 MiB in bf16)."""

import os
import subprocess
import sys
import textwrap

import pytest

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
    cfg = LlamaConfig(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256)
    if how == "from_pretrained":
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[2])
        gc.collect()
        model = LlamaForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)
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
    config = pt.ProTrainConfig(frozen_dtype="int8" if how == "lora-int8" else None)  # the base quantised chunk by chunk
    engine = pt.wrap(model, opt, pt.Plan(n_persist=0, n_buffer=1), precision=precision, device="cpu", config=config)
    peak = status("VmHWM")
    states = engine.memory.host_bytes() + sum(c.device_bytes() for c in engine.chunks if c.persistent)
    print(json.dumps(dict(model=model_bytes, states=states, chunk=engine.layout.chunk_size * 2, before=before,
                          peak=peak)))
""")


def _measure(how, tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, how, str(tmp_path / "model")], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
# lora-int8 with -m "slow or not slow" (CI: test_frozen_dtypes' chunk-by-chunk test)
@pytest.mark.parametrize("how", ["lora", pytest.param("lora-int8", marks=pytest.mark.slow),
                                 pytest.param("cast", marks=pytest.mark.slow),
                                 pytest.param("from_pretrained", marks=pytest.mark.slow)])
def test_peak_host_memory_of_wrap(how, tmp_path):
    m = _measure(how, tmp_path)
    rise = m["peak"] - m["before"]
    assert m["model"] > 300 * 2**20
    assert rise <= m["states"] + m["chunk"], {k: v / 2**20 for k, v in m.items()}
    # A second full copy of the model would have shown: the peak stays well below it.
    assert rise < m["states"] + m["model"] / 2
