import copy
import gc
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import protrain_core as pt
from _background import BackgroundRuns, background_run

logging.getLogger("transformers").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*loss_type=None.*")

VOCAB = 96
SEQ = 16
ROOT = Path(__file__).resolve().parents[1]


def tiny_gpt2(n_layer=4, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def tiny_llama(n_layer=4, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def batches(n, seed=1, batch=2, device="cpu", distinct=2):
    """``n`` batches cycling through ``distinct`` random ones (so the loss visibly falls)."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, VOCAB, (batch, SEQ), generator=g).to(device) for _ in range(distinct)]
    return [pool[i % distinct] for i in range(n)]


def n_chunks(model):
    """Number of chunks the automatic layout gives ``model``."""
    block_path, blocks = pt.find_blocks(model)
    return pt.build_layout(model, block_path, len(blocks)).n_chunks


def standard_plans(model):
    """Chunk plans that exercise every placement: all persistent, all streamed through one
    buffer, mixed with two buffers, and mixed with swapped and checkpointed blocks."""
    n = n_chunks(model)
    return {
        "all-persistent": pt.Plan(n_persist=n, n_buffer=0),
        "streamed-buf1": pt.Plan(n_persist=0, n_buffer=1),
        "mixed-buf2": pt.Plan(n_persist=1, n_buffer=2),
        "swap-checkpoint": pt.Plan(n_persist=1, n_buffer=2, n_swap=1, n_checkpoint=2),
    }


def train_engine(engine, data, *, accumulate=1, before_micro_batch=None, after_step=None):
    """The steps' losses; ``before_micro_batch(engine)`` runs before every micro-batch's forward,
    ``after_step(engine)`` between ``step`` and ``zero_grad`` (a re-plan, a round trip of the states)."""
    losses = []
    for i in range(0, len(data), accumulate):
        micro = data[i : i + accumulate]
        total = 0.0
        for j, x in enumerate(micro):
            if before_micro_batch is not None:
                before_micro_batch(engine)
            ctx = engine.no_sync() if j < len(micro) - 1 else _null()
            with ctx:
                loss = engine.module(input_ids=x, labels=x).loss / len(micro)
                engine.backward(loss)
            total += loss.item()
        engine.step()
        if after_step is not None:
            after_step(engine)
        engine.zero_grad()
        losses.append(total)
    return losses


def fabric_steps(fabric, model, opt, data) -> list[float]:
    """One Fabric step per batch of ``data`` (the language model's loss on it); the losses."""
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_reference(model, opt, data, *, accumulate=1, scheduler=None, clip=None):
    """Plain PyTorch; ``clip(params)`` (e.g. clip_grad_norm_) runs on the optimizer's
    parameters before every step."""
    losses = []
    for i in range(0, len(data), accumulate):
        micro = data[i : i + accumulate]
        total = 0.0
        for x in micro:
            loss = model(input_ids=x, labels=x).loss / len(micro)
            loss.backward()
            total += loss.item()
        if clip is not None:
            clip([p for group in opt.param_groups for p in group["params"]])
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# Adam's eps where a CUDA run is compared with a reference computed by other kernels (the CPU
# Adam against CUDA's fused AdamW, chunk-packed tensors against separate ones) with weights
# within rtol 1e-5, atol 1e-6: Adam divides a gradient by sqrt(v) + eps, so a gradient that is
# itself rounding noise (GPT-2's key bias gets zero in exact arithmetic; a LLaMA has such entries
# too) moves its weight by up to lr * noise / eps per step, and a last-bit difference anywhere
# changes that noise entirely. Measured on the CPU (``python -m benchmarks.bench_tolerance``: plain
# fused AdamW, 10 steps, every initial weight moved by one ulp against the unmoved run): the worst
# weight difference is 19x (GPT-2) and 31x (LLaMA) the tolerance with eps=1e-8, 0.11x and 0.17x
# with eps=1e-4, where the update is Lipschitz in the gradient with constant lr / eps.
COMPARED_ACROSS_KERNELS_EPS = 1e-4


def assert_same_weights(engine_sd, ref_model, rtol=0.0, atol=0.0):
    ref = ref_model.state_dict()
    assert set(engine_sd) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(engine_sd[k], v.detach().float().cpu() if v.is_floating_point() else v, rtol=rtol,
                                   atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_same_runs(a, b):
    """Two runs' ``(losses, model state dict, optimizer state dict, *more)`` -- ``more``: e.g. the
    loss scaler's state -- are equal bit for bit."""
    (l0, sd0, osd0, *more0), (l1, sd1, osd1, *more1) = a, b
    assert l0 == l1 and more0 == more1
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert osd0["state"].keys() == osd1["state"].keys()
    for i, entry in osd0["state"].items():
        assert entry.keys() == osd1["state"][i].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(osd1["state"][i][k])) for k, v in entry.items())


@pytest.fixture
def deepcopy():
    return copy.deepcopy


def bench(*args, out, check=True, env=None):
    """``python -m benchmarks.run ARGS --out OUT`` (its profile cache in ``out``)."""
    env = dict(env or os.environ, PROTRAIN_CACHE_DIR=str(out / "cache"))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


_background: list[BackgroundRuns] = []  # (started once the tests are collected)


@pytest.fixture
def background(request):
    """The result of the background run the test is marked with (``@pytest.mark.background(name)``;
    None for a test, or a parameter of one, without the mark)."""
    marker = request.node.get_closest_marker("background")
    return None if marker is None else _background[0].result(marker.args[0])


@background_run("smoke-subset")
def _smoke_subset(folder, env, results):
    """The cpu-smoke suite's CI subset: ProTrain core and plain PyTorch, one process and two, and
    the study run (test_benchmarks.py reads it; the dry GPU session resumes it)."""
    proc = bench("--suite", "cpu-smoke", "--systems", "protrain-core,pytorch", "--no-probes", out=folder, env=env)
    return folder, proc.stdout, json.loads((folder / "results.json").read_text())


def pytest_configure(config):
    config.addinivalue_line("markers", "grid(ci): a parameter grid whose combinations ci(**params) rejects are slow")
    config.addinivalue_line("markers", "background(name): reads the background run name (conftest.py), runs last")
    # The one-pass CPU Adam kernel compiles once per machine (~10 s): here, before any test, so that
    # processes started by the tests find it built instead of building it inside a timed run.
    from protrain_ops import onepass

    onepass.kernel()
    _trace_once_per_structure()
    # One intra-op thread in this process and in those it starts: the suite's processes share 2
    # cores (the background runs beside the tests), and an OpenMP team whose second thread waits
    # for a core spins at every parallel operator -- a test then took 10 times as long. The tiny
    # models gain nothing from a second thread (the same tests, one thread against two: 22.2 s
    # and 22.7 s).
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    # benchmarks.gpu_session runs the CUDA tests with PROTRAIN_SYNC_DEBUG=warn: every host-device
    # synchronisation warns (its log counts them).
    mode = os.environ.get("PROTRAIN_SYNC_DEBUG")
    if mode and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def _trace_once_per_structure():
    """Every ``wrap`` traces its model's forward on the meta device (structure/trace.py), and
    meta kernels are Python: 30 ms for a tiny test model, 3/4 of its ``wrap``, a quarter of the
    suite's time in the tests that wrap. The suite wraps the same few tiny models over and over,
    so here a trace is remembered by everything it can depend on -- each module's name, class and
    ``forward``, its parameters' and buffers' names, shapes, dtypes and sharing, its other
    attributes (configs, flags such as LoRA's ``merged``), train or eval mode; the block path and
    the inputs' structure -- and run again for any other model. A model with hooks or an instance
    ``forward`` (a wrapped model, a patched one) and a trace that fell back to registration order
    (its warning is a result) are never remembered. ``build_layout`` is the one caller; the trace's
    own tests call it, and each new structure still runs it."""
    import protrain_core.structure.layout as layout

    real, remembered = layout.trace, {}

    def trace(model, block_path, example_inputs=None):
        key = _structure(model, block_path, example_inputs)
        if key in remembered:
            return remembered[key]
        result = real(model, block_path, example_inputs)
        if key is not None and result.source == "traced":
            remembered[key] = result
        return result

    layout.trace = trace


def _structure(model, block_path, example_inputs):
    """What a trace of ``model`` can depend on, as a key (None: not to be remembered)."""
    shared, described = {}, {}

    def value(v):
        if isinstance(v, (bool, int, float, str, type(None))):
            return v
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.dtype, v.device.type, shared.setdefault(id(v), len(shared)))
        if isinstance(v, (list, tuple)):
            return tuple(value(x) for x in v)
        if isinstance(v, dict):
            return tuple((k, value(x)) for k, x in v.items())
        if id(v) not in described:  # a config, a function, any other object: its repr, once
            described[id(v)] = v.to_json_string() if hasattr(v, "to_json_string") else repr(v)
        return described[id(v)]

    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        if "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return None
        states = {**m._parameters, **m._buffers}
        attributes = {k: v for k, v in vars(m).items() if not k.startswith("_")}
        modules.append((name, type(m), type(m).forward, value(states), value(attributes)))
    return tuple(modules), block_path, value(example_inputs)


def pytest_collection_finish(session):
    """What is alive once the tests are collected (torch, transformers, Lightning, the test
    modules: about 560k objects) lives to the end: frozen out of the collector's sight, each full
    collection during the tests visits only what the tests made (the suite's full collections
    took 40 s, 33 s with the imports frozen; the simulator's tests 14 s, 6 s)."""
    gc.collect()
    gc.freeze()
    if session.config.option.collectonly:
        return
    wanted = {m.args[0] for item in session.items for m in item.iter_markers("background")}
    if wanted:  # (tests/_background.py)
        _background.append(BackgroundRuns(wanted, dict(os.environ)))


def pytest_sessionfinish(session):
    if _background:
        _background[0].stop()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Grids: mark the combinations outside a test's CI subset ``slow`` (the representative
    combinations run in CI, every one with ``-m "slow or not slow"``). CUDA tests: skipped
    without a GPU. The tests that read background runs: last (in order otherwise)."""
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)
    for item in items:
        grid = item.get_closest_marker("grid")
        if grid is not None and not grid.kwargs["ci"](**item.callspec.params):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class SaveKilled(BaseException):
    """A save stopped dead at a rename (as ``kill -9`` would stop it)."""


def stop_saves_at(step: int):
    """Make ``protrain_core.checkpoint``'s renames and removals of a directory save raise
    ``SaveKilled`` at the ``step``-th (from 0) ([Note: replacing a checkpoint directory]); the
    returned function puts them back."""
    import protrain_core.checkpoint as C

    steps, rename, remove = [], C._rename, C._remove

    def stopping(real):
        def step_(*args):
            if len(steps) == step:
                raise SaveKilled
            steps.append(args)
            return real(*args)
        return step_

    C._rename, C._remove = stopping(rename), stopping(remove)

    def restore() -> None:
        C._rename, C._remove = rename, remove
    return restore
