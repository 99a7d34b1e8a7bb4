"""Wrapping a model held in bf16 never holds two copies of it: the peak host RSS during
``wrap`` stays within the RSS before it (the model included) plus the model-state bytes plus
one chunk; a model built on the meta device adds no copy of itself at all. Measured in a fresh
process (``VmHWM`` reset through ``/proc/self/clear_refs``; benchmarks/bench_wrap_memory.py) on
a 169 M-parameter LLaMA (322 MiB in bf16)."""

import os

import pytest

from benchmarks.bench_wrap_memory import measure as _measure


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


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_a_meta_model_filled_from_its_checkpoint_holds_no_host_copy_of_it(tmp_path):
    """[Note: weights straight into chunks]: ``wrap`` of the model built on the meta device and
    filled from save_pretrained's directory raises the peak by at most the states and one chunk
    (the values of the chunk being filled, the file's own pages) and a constant of 32 MiB (the
    allocator's arenas, Python's objects: 5 MiB measured here, none at 1.1B) -- never by the
    model: the RSS before ``wrap`` holds none of it."""
    m = _measure("meta", tmp_path)
    rise = m["peak"] - m["before"]
    assert m["model"] > 300 * 2**20 and m["model"] > 2 * m["chunk"] + 32 * 2**20
    assert rise <= m["states"] + m["chunk"] + 32 * 2**20, {k: v / 2**20 for k, v in m.items()}
