"""ProTrainConfig: one frozen configuration for wrap and both strategies, checked where it is
written; environment switches as defaults; the old keyword arguments with a warning; every
field settable from a LightningCLI file; the runtime switches acting on the engine."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
from torch import nn

import protrain_core as pt
from conftest import MODELS, batches, train_engine
from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy

PLAN = pt.Plan(n_persist=1, n_buffer=1)
ENV = ("PROTRAIN_NO_PIN", "PROTRAIN_CPU_ADAM_THREAD", "PROTRAIN_ONEPASS", "PROTRAIN_REPROFILE", "PROTRAIN_CACHE_DIR")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PROTRAIN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("make,match", [
    (lambda: pt.PlanningConfig(plan=PLAN, memory_budget="1GiB"), "either plan"),
    (lambda: pt.PlanningConfig(memory_budget="lots"), "lots"),
    (lambda: pt.PlanningConfig(max_tokens=0), "max_tokens=0"),
    (lambda: pt.PlanningConfig(chunk_size=-5), "chunk_size=-5"),
    (lambda: pt.PlanningConfig(blocks=[]), "names no block list"),
    (lambda: pt.PlanningConfig(plan={"n_persist": 1, "n_buffers": 2}), "Unknown Plan field"),
    (lambda: pt.PlanningConfig(reprofile="yes"), "reprofile must be True or False"),
    (lambda: pt.ClippingConfig(algorithm="l1", value=1.0), "must be 'norm'"),
    (lambda: pt.ClippingConfig(value=0.0), "finite max_norm > 0"),
    (lambda: pt.CheckpointConfig(state_dict_type="dcp"), "'full'.*'sharded'"),
    (lambda: pt.RuntimeConfig(pin_memory=1), "pin_memory must be True or False"),
    (lambda: pt.ProTrainConfig(planning={"budget": "1GiB"}), "no field 'budget'"),
    (lambda: pt.ProTrainConfig(runtime=3), "must be a RuntimeConfig"),
    (lambda: pt.ProTrainConfig(clipping="norm"), "clipping must be"),
    (lambda: pt.PlanningConfig(cache_dir=123), "cache_dir must be a directory path"),
    (lambda: pt.PlanningConfig(blocks=123), "blocks must name the blocks' nn.ModuleList"),
    (lambda: pt.ProTrainConfig(grad_accumulator=0), "grad_accumulator must be True, False or None, got 0"),
    (lambda: pt.RuntimeConfig(worker_cores=[True]), "worker_cores must be a non-empty list"),
    (lambda: pt.ProTrainConfig().replace(planning={"budget": "1GiB"}), "ProTrainConfig.planning has no field 'budget'"),
    (lambda: pt.ProTrainConfig().replace(budget="1GiB"), "ProTrainConfig has no field 'budget'"),
])
def test_every_part_checks_its_fields_when_created(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_nested_parts_may_be_dicts_tuples_or_plans_and_the_config_is_frozen():
    config = pt.ProTrainConfig(planning={"plan": {"n_persist": 1, "n_buffer": 1}, "blocks": ["a", "b"]},
                               clipping=("value", 0.5), checkpoint={"state_dict_type": "sharded"})
    assert config.planning == pt.PlanningConfig(plan=PLAN, blocks=("a", "b"))
    assert config.clipping == pt.ClippingConfig(algorithm="value", value=0.5)
    assert config.checkpoint.state_dict_type == "sharded"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.planning.chunk_size = 4
    # replace() merges a nested dict into the part it replaces
    again = config.replace(planning={"chunk_size": 4096})
    assert again.planning.plan == PLAN and again.planning.chunk_size == 4096 and again.clipping == config.clipping


@pytest.mark.parametrize("variable,value,field,default,changed", [
    ("PROTRAIN_NO_PIN", "1", ("runtime", "pin_memory"), True, False),
    ("PROTRAIN_CPU_ADAM_THREAD", "1", ("runtime", "cpu_adam_thread"), False, True),
    ("PROTRAIN_ONEPASS", "0", ("runtime", "one_pass_kernel"), True, False),
    ("PROTRAIN_REPROFILE", "1", ("planning", "reprofile"), False, True),
])
def test_an_environment_variable_sets_a_default_and_a_given_field_wins(monkeypatch, variable, value, field, default,
                                                                        changed):
    part, name = field
    assert getattr(getattr(pt.ProTrainConfig(), part), name) is default
    monkeypatch.setenv(variable, value)
    assert getattr(getattr(pt.ProTrainConfig(), part), name) is changed
    given = pt.ProTrainConfig(**{part: {name: default}})
    assert getattr(getattr(given, part), name) is default


# ----- one way to say each setting ---------------------------------------------------------------
def test_the_old_keyword_arguments_are_gone_and_a_config_or_a_plan_is_the_way():
    """Issue 56, item 3: no compatibility layer for a project that has not released: the keyword
    arguments ProTrainConfig's fields replaced are Python's own TypeError (the README's and the
    examples' calls use the configuration); a strategy takes a config, a dict of its fields or a
    Plan."""
    model = MODELS["gpt2"]()
    for old in ({"memory_budget": "1GiB"}, {"check_invariants": True}, {"gradient_clipping": ("norm", 1.0)}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
            pt.wrap(model, torch.optim.AdamW(model.parameters()), PLAN, device="cpu", **old)
    for make, old in ((ProTrainStrategy, {"plan": PLAN}), (ProTrainStrategy, {"state_dict_type": "sharded"}),
                      (ProTrainFabricStrategy, {"gradient_clip_val": 0.5})):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
            make(**old)
    with pytest.raises(ValueError, match="a plan and a config whose planning.plan is set"):
        pt.wrap(model, torch.optim.AdamW(model.parameters()), PLAN, device="cpu",
                config=pt.ProTrainConfig(planning={"plan": PLAN}))
    with pytest.raises(TypeError, match="wrap\\(config=...\\) takes a protrain_core.ProTrainConfig, got dict"):
        pt.wrap(model, torch.optim.AdamW(model.parameters()), PLAN, device="cpu", config={"planning": {}})
    assert ProTrainStrategy(PLAN).config == pt.ProTrainConfig(planning={"plan": PLAN})
    assert ProTrainStrategy({"n_persist": 1, "n_buffer": 1}).config == ProTrainStrategy(PLAN).config
    config = pt.ProTrainConfig(planning={"plan": PLAN}, checkpoint={"state_dict_type": "sharded"})
    assert ProTrainStrategy(config=config).state_dict_type == "sharded"
    fabric = ProTrainFabricStrategy(pt.ProTrainConfig(clipping={"algorithm": "value", "value": 0.5}))
    assert fabric.config.clipping == pt.ClippingConfig(algorithm="value", value=0.5)


def test_the_strategies_refuse_what_lightning_decides():
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=1.0, gradient_clip_algorithm='norm'\)"):
        ProTrainStrategy(pt.ProTrainConfig(clipping=("norm", 1.0)))
    for cls in (ProTrainStrategy, ProTrainFabricStrategy):
        with pytest.raises(ValueError, match="optimizer_states=False.*the strategy decides"):
            cls(pt.ProTrainConfig(planning={"plan": PLAN}, optimizer_states=False))
        with pytest.raises(ValueError, match="takes a protrain_core.ProTrainConfig"):
            cls("protrain")


# ----- the runtime switches act on the engine ----------------------------------------------------
def _engine(precision="32-true", plan=pt.Plan(n_persist=0, n_buffer=1), **runtime):
    model = MODELS["llama"]()
    return pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), plan, precision=precision, device="cpu",
                   config=pt.ProTrainConfig(runtime=runtime))


def test_cpu_adam_thread_puts_the_updates_on_the_worker_thread():
    assert not _engine().scheduler.worker.threaded
    assert _engine(cpu_adam_thread=True).scheduler.worker.threaded


def test_one_pass_kernel_off_runs_the_separate_passes_with_the_same_results(monkeypatch):
    from protrain_ops import onepass

    calls = []
    for name in ("update", "land"):
        original = getattr(onepass, name)
        monkeypatch.setattr(onepass, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    data = batches(3)
    results = []
    for on in (True, False):
        calls.clear()
        engine = _engine("bf16-mixed", one_pass_kernel=on)
        results.append(train_engine(engine, data))
        assert ("one_pass_kernel=False" in engine.summary()) is not on
        kernel = onepass.kernel() is not None
        assert bool(calls) is (on and kernel), calls[:3]
        engine.close()
    assert results[0] == results[1]


def test_the_profile_cache_directory_is_a_field(tmp_path):
    model = MODELS["gpt2"]()
    x = batches(1)[0]
    where = tmp_path / "mine"
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), example_inputs={"input_ids": x, "labels": x},
                     device="cpu", report=lambda *a, **k: None,
                     config=pt.ProTrainConfig(planning={"memory_budget": "1GiB", "cache_dir": str(where)}))
    engine.close()
    assert len(list((where / "profiles").glob("*.json"))) == 1
    assert not (tmp_path / "cache").exists()  # not $PROTRAIN_CACHE_DIR


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pin_memory_off_keeps_the_host_copies_pageable():
    for pin in (True, False):
        model = MODELS["llama"]()
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=0, n_buffer=1),
                         device="cuda", config=pt.ProTrainConfig(runtime={"pin_memory": pin}))
        assert (engine.memory.host_locked_bytes() > 0) is pin
        engine.close()


# ----- LightningCLI ----------------------------------------------------------------------------
class _Tiny(__import__("lightning").pytorch.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)


def test_a_lightning_cli_file_sets_every_field(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    expected = pt.ProTrainConfig(
        planning=pt.PlanningConfig(memory_budget="3GiB", max_tokens=4096, blocks="layers", chunk_size=65536,
                                   profile_cache=False, cache_dir=str(tmp_path), reprofile=True),
        runtime=pt.RuntimeConfig(check_invariants=True, pin_memory=False, cpu_adam_thread=True, one_pass_kernel=False),
        checkpoint=pt.CheckpointConfig(state_dict_type="sharded"), optimizer_state_format="bf16",
        frozen_dtype="int8", grad_accumulator=False, weights=str(tmp_path / "hf"),
        compile={"mode": "default", "dynamic": False},
    )
    unset = {f.name for f in dataclasses.fields(pt.ProTrainConfig)} - {"planning", "runtime", "checkpoint",
                                                                       "optimizer_state_format", "frozen_dtype",
                                                                       "grad_accumulator", "weights", "compile"}
    assert unset == {"clipping", "optimizer_states"}  # the Trainer's gradient_clip_val; the strategy's own
    file = tmp_path / "config.yaml"
    file.write_text(textwrap.dedent(f"""
        trainer:
          accelerator: cpu
          logger: false
          strategy:
            class_path: lightning_protrain.ProTrainStrategy
            init_args:
              config:
                planning: {{memory_budget: 3GiB, max_tokens: 4096, blocks: layers, chunk_size: 65536,
                            profile_cache: false, cache_dir: {str(tmp_path)!r}, reprofile: true}}
                runtime: {{check_invariants: true, pin_memory: false, cpu_adam_thread: true, one_pass_kernel: false}}
                checkpoint: {{state_dict_type: sharded}}
                optimizer_state_format: bf16
                frozen_dtype: int8
                grad_accumulator: false
                weights: {str(tmp_path / "hf")!r}
                compile: {{mode: default, dynamic: false}}
    """))
    cli = LightningCLI(_Tiny, run=False, args=["--config", str(file)])
    assert cli.trainer.strategy.config == expected
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(textwrap.dedent("""
        trainer:
          accelerator: cpu
          logger: false
          strategy:
            class_path: lightning_protrain.ProTrainStrategy
            init_args: {config: {planning: {plan: {n_persist: 2, n_buffer: 1, n_checkpoint: 1}, blocks: [enc, dec]}}}
    """))
    cli = LightningCLI(_Tiny, run=False, args=["--config", str(plan_file)])
    assert cli.trainer.strategy.config.planning == pt.PlanningConfig(
        plan=pt.Plan(n_persist=2, n_buffer=1, n_checkpoint=1), blocks=("enc", "dec"))
