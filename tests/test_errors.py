"""Bad input gets a clear error before anything expensive happens."""

import dataclasses

import pytest
import torch

import protrain_core as pt
from conftest import batches, n_chunks, tiny_gpt2


def _wrap(**kw):
    model = kw.pop("model", None) or tiny_gpt2()
    opt = kw.pop("optimizer", None) or torch.optim.AdamW(model.parameters())
    plan = kw.pop("plan", pt.Plan(n_persist=1, n_buffer=1))
    if isinstance(kw.get("config"), dict):  # built inside the caller's pytest.raises
        kw["config"] = pt.ProTrainConfig(**kw["config"])
    kw.setdefault("device", "cpu")
    return pt.wrap(model, opt, plan, **kw)


def test_plan_validation():
    with pytest.raises(ValueError, match="n_persist must be >= 0"):
        pt.Plan(n_persist=-1, n_buffer=1)
    with pytest.raises(ValueError, match="must be an int"):
        pt.Plan(n_persist=1.5, n_buffer=1)
    with pytest.raises(ValueError, match="Unknown Plan field"):
        pt.Plan.from_dict({"n_persist": 1, "n_buffers": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        pt.Plan(n_persist=1, n_buffer=1).n_persist = 2


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(plan=None, config={"planning": {"max_tokens": 0}}), "max_tokens=0: give the most tokens"),
        (dict(plan=None, config={"planning": {"max_tokens": 64.0}}), "max_tokens=64.0"),
        (dict(config={"planning": {"max_tokens": 64}}), "max_tokens is used to search a plan"),
        (dict(plan=None, config={"optimizer_states": False}), "pass its plan="),
        (dict(plan=pt.Plan(n_persist=99, n_buffer=1)), "has only"),
        (dict(plan=pt.Plan(n_persist=0, n_buffer=0)), "Use n_buffer >= 1"),
        (dict(plan=pt.Plan(n_persist=0, n_buffer=1, n_swap=3, n_checkpoint=2)), "n_swap \\+ n_checkpoint <= 4"),
        (dict(plan=pt.Plan(n_persist=0, n_buffer=1, n_checkpoint=5)), "only 4 transformer blocks"),
        (dict(precision="16-true"), "bf16-true"),
        (dict(precision="8-bit"), "does not support precision='8-bit'"),
    ],
)
def test_wrap_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _wrap(**kw)


def test_a_model_or_optimizer_of_another_type_is_refused_with_the_fix():
    """Before: AttributeErrors from inside wrap ('Parameter' object has no attribute 'param_groups')."""
    model = tiny_gpt2()
    with pytest.raises(TypeError, match=r"takes a torch.optim.Optimizer .* got Parameter: .*AdamW\(model"):
        pt.wrap(model, list(model.parameters()), device="cpu")
    with pytest.raises(TypeError, match="takes a torch.nn.Module, got str"):
        pt.wrap("model", torch.optim.AdamW(model.parameters()), device="cpu")


def test_negative_activation_counts():
    with pytest.raises(ValueError, match="n_swap must be >= 0"):
        pt.Plan(n_persist=1, n_buffer=1, n_swap=-1)
    with pytest.raises(ValueError, match="n_checkpoint must be >= 0"):
        pt.Plan(n_persist=1, n_buffer=1, n_checkpoint=-2)


def test_hugging_face_gradient_checkpointing_is_refused():
    model = tiny_gpt2()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        _wrap(model=model, plan=pt.Plan(n_persist=1, n_buffer=1, n_checkpoint=2))


def test_unsupported_optimizer():
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="cannot run Adafactor per chunk.*Use an elementwise torch.optim optimizer"):
        _wrap(model=model, optimizer=torch.optim.Adafactor(model.parameters()))


class _NeedsClosure(torch.optim.AdamW):
    def step(self, closure):
        closure()
        return super().step()


class _Centralised(torch.optim.AdamW):
    """Gradient centralisation: edits the gradients, then AdamW's step."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() > 1:
                    p.grad -= p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True)
        return super().step(closure)


class _Named(torch.optim.AdamW):
    """A subclass that keeps AdamW's step: accepted."""


@pytest.mark.parametrize("cls", [_NeedsClosure, _Centralised])
def test_an_optimizer_subclass_with_its_own_step_is_refused(cls):
    """Its step would never run (ProTrain runs Adam's update per chunk): one needing a closure
    crashed deep in the engine, one editing gradients before super().step() was skipped silently."""
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=f"{cls.__name__} overrides step\\(\\).*Use torch.optim.AdamW"):
        _wrap(model=model, optimizer=cls(model.parameters(), lr=1e-3))
    _wrap(model=model, optimizer=_Named(model.parameters(), lr=1e-3)).close()


def test_the_optimizers_own_step_names_engine_step():
    """optimizer.step() instead of engine.step() updated nothing, silently (the next backward then
    pointed at no_sync); it is refused with the call to make."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = _wrap(model=model, optimizer=opt)
    x = batches(1)[0]
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match=r"AdamW.step\(\) was called .* Call engine.step\(\)"):
        opt.step()
    engine.step()
    engine.close()
    opt.step()  # a closed engine's optimizer is the user's again


def test_dict_plan_and_double_wrap():
    model = tiny_gpt2()
    engine = _wrap(model=model, plan={"n_persist": 1, "n_buffer": 2})
    assert engine.plan == pt.Plan(n_persist=1, n_buffer=2)
    with pytest.raises(ValueError, match="already wrapped"):
        _wrap(model=model)


def test_cuda_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        _wrap(device="cuda")


# (LOCAL_RANK, LOCAL_WORLD_SIZE, GPUs this process sees, its current GPU, the GPU it trains on)
LOCAL_GPUS = [
    ("2", "4", 4, 0, 2),  # torchrun, nothing chose a GPU: the local rank's, not GPU 0 for every rank
    ("2", "4", 4, 3, 3),  # the script called torch.cuda.set_device: its choice
    ("1", "2", 1, 0, 0),  # each process sees one GPU (CUDA_VISIBLE_DEVICES per rank)
    ("3", "8", 4, 0, 0),  # more processes than GPUs: the user's own arrangement
    (None, None, 4, 0, 0),  # one process
]


@pytest.mark.parametrize("local_rank,local_world,gpus,current,expected", LOCAL_GPUS)
def test_a_cuda_device_without_an_index_is_the_processes_own_gpu(monkeypatch, local_rank, local_world, gpus,
                                                                   current, expected):
    from protrain_core.runtime.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    for name, value in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert resolve_device(None) == resolve_device("cuda") == torch.device("cuda", expected)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # named: as named


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_under_32_true_are_refused(dtype):
    """Issue 18, case 6: under "32-true" a bf16 or fp16 parameter would be trained in fp32 here,
    in its dtype (or not at all: a dtype mismatch) by plain PyTorch. Refused with the fix, before
    anything is allocated; the same model trains under the precision of its dtype."""
    model = tiny_gpt2()
    model.transformer.h[1].to(dtype)
    with pytest.raises(ValueError, match=rf"'32-true'.*{str(dtype)[6:]}.*transformer\.h\.1\..*model\.float\(\)"):
        _wrap(model=model, plan=pt.Plan(n_persist=1, n_buffer=1))
    assert all(p.device.type == "cpu" for p in model.parameters()) and getattr(model, "_protrain_engine", None) is None
    whole = tiny_gpt2().to(torch.bfloat16)
    engine = pt.wrap(whole, torch.optim.AdamW(whole.parameters()), pt.Plan(n_persist=1, n_buffer=1), precision="bf16-true",
                     device="cpu")
    engine.close()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fp64_parameters_under_a_mixed_precision_are_refused(precision):
    """The mixed modes keep fp32 masters: an fp64 parameter's updates would be rounded to fp32,
    where Lightning's default strategy updates it in fp64. Refused with the fix before anything is
    allocated; a bf16 parameter gets an fp32 master, as the mixed modes promise."""
    model = tiny_gpt2()
    model.transformer.ln_f.to(torch.float64)
    with pytest.raises(ValueError, match=rf"'{precision}' trains fp32 masters.*float64.*transformer\.ln_f\..*model\.float\(\)"):
        _wrap(model=model, plan=pt.Plan(n_persist=1, n_buffer=1), precision=precision)
    assert all(p.device.type == "cpu" for p in model.parameters()) and getattr(model, "_protrain_engine", None) is None
    model.transformer.ln_f.to(torch.bfloat16)
    engine = _wrap(model=model, plan=pt.Plan(n_persist=1, n_buffer=1), precision=precision)
    assert engine.state_dict()["transformer.ln_f.weight"].dtype == torch.float32
    engine.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["streamed", "persistent"])
def test_compiling_the_wrapped_model_is_refused_at_its_first_call(persistent):
    """Issue 53, item 10: ``torch.compile(engine.module)`` failed deep in inductor after 22 s
    (the compiled graph saw a streamed chunk's placeholders). Its first call, of the model, of
    ``module.compile()`` or of one compiled block, now ends with the reason before any graph is
    compiled; the model still trains uncompiled afterwards."""
    model = tiny_gpt2()
    plan = pt.Plan(n_persist=n_chunks(model) if persistent else 0, n_buffer=0 if persistent else 1)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), plan, device="cpu")
    (x,) = batches(1)
    block = engine.module.transformer.h[1]
    for call in (lambda: torch.compile(engine.module)(input_ids=x),
                 lambda: torch.compile(block)(torch.randn(2, x.shape[1], 32)),
                 lambda: (engine.module.compile(), engine.module(input_ids=x))):
        with pytest.raises(RuntimeError, match="torch.compile of a ProTrain-wrapped model.*after wrap is not supported"):
            call()
        torch.compiler.reset()
    del engine.module._compiled_call_impl  # what nn.Module.compile() set
    engine.backward(engine.module(input_ids=x, labels=x).loss)
    engine.step()
    assert all(torch.isfinite(p).all() for p in engine.state_dict().values())
    engine.close()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_the_built_in_tiny_configs_have_special_tokens_inside_their_vocabulary(name):
    """tiny-gpt2 kept GPT-2's bos/eos id 50256 with a 256-token vocabulary: two warnings in every
    run of the examples and the CLI."""
    from protrain_core.models import load_config

    config = load_config(name)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, field, None)
        assert value is None or 0 <= value < config.vocab_size, (field, value)


def test_too_little_host_memory_names_the_fix_for_the_device(monkeypatch):
    """On a CPU device every state is in host memory whatever the plan: the refusal no longer
    suggests keeping chunks on the device or bf16-mixed (the hints a GPU would get)."""
    import protrain_core.utils

    monkeypatch.setattr(protrain_core.utils, "available_host_bytes", lambda: 1024)
    with pytest.raises(MemoryError, match=r"host memory for offloaded model states.*On a CPU device every model state "
                                          r"is in this machine's memory.*protrain plan --simulate") as raised:
        _wrap(plan=pt.Plan(n_persist=0, n_buffer=1), precision="bf16-mixed")
    assert "n_persist" not in str(raised.value)
