"""Several processes: chunks sharded ZeRO-3 style over a gloo process group on the CPU, against
DDP (issue 17). Every test here starts processes, so they are few and each covers a lot.

Tolerances. With 2 processes the reduction is DDP's exactly: DDP multiplies each rank's
gradient by 1/2 (exact) and all-reduces the sum; ProTrain multiplies by 1/2 and reduce-scatters
the sum; a + b is the same float either way, and Adam is elementwise, so a shard of a tensor
updates exactly as the whole would: bitwise. Three things change the order of floating-point
additions, and only they get a tolerance: 3 processes (gloo's all-reduce and reduce-scatter add
the three ranks' values in different orders, and x/3 is not exact), gradient accumulation
(DDP sums the micro-batches locally and reduces once; ProTrain reduces each micro-batch into
its shard), and norm clipping (the global norm is the square root of the ranks' summed squared
norms instead of the norm of all per-tensor norms). Each is a rounding of the last bit of a
gradient element; through a few Adam steps at lr 1e-2 (each moves a weight by at most about lr)
that stays below 1e-4 in the weights and 1e-5 in the losses (measured: at most 8e-6 and 1e-6).
The mixed modes are bitwise with 2 processes too; with 3 see LOW_WEIGHT_ATOL.
"""

from __future__ import annotations

import copy
import signal
import socket
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import protrain_core as pt
from _background import background_run
from _distributed import _null, ddp_reduce, ddp_reference, free_port, protrain_run, spawn
from conftest import SEQ, VOCAB, batches, standard_plans, tiny_llama, train_engine
from test_parity import reference_mixed

WEIGHT_ATOL, LOSS_ATOL = 1e-4, 1e-5
# bf16 / fp16 with 3 processes: the gradients are reduced in the compute dtype (as DDP reduces
# them), and three values summed in another order can round differently by one low-precision
# unit; where they nearly cancel that flips the sign of Adam's first update (+-lr each). Each of
# the 4 steps moves a weight by at most about lr, so the runs stay within 2 lr per step; the
# losses within a few bf16 units. Measured: 1.7e-2 and 2.2e-3.
LOW_WEIGHT_ATOL, LOW_LOSS_ATOL = 4 * 2 * 1e-2, 5e-3
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "lightning_run.py")

# (plan, options, frozen): every plan kind, accumulation, clipping, frozen parameters, weight decay
SCENARIOS = [
    ("all-persistent", {}, False),
    ("streamed-buf1", {}, False),
    ("mixed-buf2", {"accumulate": 2}, False),
    ("swap-checkpoint", {"clip": 0.5}, False),
    ("mixed-buf2", {"weight_decay": 0.1, "clip": 0.1}, True),
    ("streamed-buf1", {"accumulate": 2}, True),
]


def _model(frozen: bool, seed: int = 0):
    model = tiny_llama(seed=seed)
    if frozen:  # LoRA-like: chunks with frozen and trainable members, and wholly frozen ones
        for name, p in model.named_parameters():
            if "mlp" in name or "embed" in name:
                p.requires_grad_(False)
    return model


def _scenarios(rank, world):
    """Each scenario: DDP and ProTrain on the same model and per-rank data; the per-rank losses,
    and on rank 0 the largest weight difference (the engine's gathered state dict)."""
    out = []
    for plan_name, kw, frozen in SCENARIOS:
        model = _model(frozen)
        data = batches(4, seed=10 + rank)
        ref_losses, ref_weights = ddp_reference(model, data, **kw)
        losses, engine = protrain_run(_model(frozen), data, standard_plans(model)[plan_name], **kw)
        weights = engine.state_dict()
        assert (weights == {}) == (rank != 0)  # consolidated on rank 0 only
        engine.close()
        diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) if rank == 0 else None
        out.append((ref_losses, losses, diff))
    return {"cases": out + _mixed_scenarios(rank, world), "inf_skipped": _one_rank_overflows(rank, world)}


def _one_rank_overflows(rank, world) -> bool:
    """fp16: an inf in the last rank's gradients only skips the step on every rank (found-inf is
    all-reduced), and every rank's loss scale halves, as GradScaler does."""
    model = tiny_llama(seed=0)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), standard_plans(model)["streamed-buf1"],
                     precision="16-mixed", device="cpu")
    x = batches(1, seed=10 + rank)[0]
    before, scale = engine.state_dict(rank0_only=False), engine.scaler.scale.item()
    loss = engine.module(input_ids=x, labels=x).loss
    engine.backward(loss * float("inf") if rank == world - 1 else loss)
    engine.step()
    engine.zero_grad()
    after = engine.state_dict(rank0_only=False)
    skipped = all(torch.equal(before[k], after[k]) for k in before) and engine.scaler.scale.item() == scale / 2
    engine.close()
    return skipped


# (plan, precision): the mixed modes against DDP over the same recipe (bf16 / fp16 compute copies,
# fp32 masters); fp16 with its loss scaler.
MIXED = [("mixed-buf2", "bf16-mixed"), ("streamed-buf1", "16-mixed")]


def _mixed_scenarios(rank, world):
    out = []
    for plan_name, precision in MIXED:
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        model = tiny_llama(seed=0)
        data = batches(4, seed=10 + rank)
        scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None  # the engine's defaults
        ref_losses, ref_master, _ = reference_mixed(model, dtype, data, lr=1e-2, scaler=scaler, reduce=ddp_reduce)
        losses, engine = protrain_run(tiny_llama(seed=0), data, standard_plans(model)[plan_name], precision=precision,
                                      weight_decay=0.01)  # reference_mixed's AdamW default
        if engine.scaler is not None:
            assert engine.scaler.scale.item() == scaler.get_scale(), "the loss scale moved alike"
        weights = engine.state_dict()
        engine.close()
        diff = max((weights[k] - ref_master[k].detach()).abs().max().item() for k in ref_master) if rank == 0 else None
        out.append((ref_losses, losses, diff))
    return out


# (CI time: 3 processes with the slow tests; uneven shards are also in the world-size checkpoint test.)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_engines_train_like_ddp(world, tmp_path):
    results = spawn(_scenarios, world, tmp_path)
    cases = SCENARIOS + [(plan_name, {"precision": precision}, False) for plan_name, precision in MIXED]
    for s, (plan_name, kw, frozen) in enumerate(cases):
        exact = world == 2 and "accumulate" not in kw and "clip" not in kw
        low = "precision" in kw and world > 2  # three low-precision gradients summed in another order
        loss_atol, weight_atol = (LOW_LOSS_ATOL, LOW_WEIGHT_ATOL) if low else (LOSS_ATOL, WEIGHT_ATOL)
        for rank in range(world):
            ref, got, diff = results[rank]["cases"][s]
            what = f"{plan_name} {kw} frozen={frozen} rank {rank}"
            if exact:
                assert got == ref, what
            else:
                assert got == pytest.approx(ref, abs=loss_atol), what
            if rank == 0:
                assert diff == 0.0 if exact else diff < weight_atol, (what, diff)
    assert all(r["inf_skipped"] for r in results)


def _default_backend(rank, world):
    """A process group made without a backend (``init_process_group()``, as a torchrun script
    often does): torch gives it one per device type, and ``get_backend`` says "undefined". The
    engine finds the CPU's (gloo) and trains like DDP; ProTrain's barrier and object broadcast
    work over it too."""
    assert torch.distributed.get_backend() == "undefined"  # what the engine must see through
    out = []
    for plan_name in ("all-persistent", "streamed-buf1"):
        model = tiny_llama(seed=0)
        data = batches(3, seed=10 + rank)
        ref_losses, ref_weights = ddp_reference(model, data)
        losses, engine = protrain_run(tiny_llama(seed=0), data, standard_plans(model)[plan_name])
        weights = engine.state_dict()
        engine.close()
        diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) if rank == 0 else None
        out.append((ref_losses, losses, diff))
    pt.barrier()
    return out, pt.broadcast_object({"from": rank}, src=1)


def test_a_group_made_without_a_backend_trains_like_ddp(tmp_path):
    for rank, (cases, received) in enumerate(spawn(_default_backend, 2, tmp_path, backend=None)):
        for ref, got, diff in cases:
            assert got == ref
            assert diff == (0.0 if rank == 0 else None)  # bitwise (the weights are gathered on rank 0)
        assert received == {"from": 1}


@pytest.mark.parametrize("config,device", [("cuda:nccl", "cpu"), ("cpu:gloo", "cuda"), ("cpu:mpi,cuda:mpi", "cpu")])
def test_a_device_the_groups_backends_cannot_reach_is_refused_with_the_fix(monkeypatch, config, device):
    from protrain_core.runtime import sharding as S

    monkeypatch.setattr(S.dist, "get_backend_config", lambda group=None: config)
    with pytest.raises(ValueError, match="'gloo' backend" if device == "cpu" else "use 'nccl'") as e:
        S.Sharding(group=None, rank=0, world=2).check_device(torch.device(device))
    assert config in str(e.value)


# ----- checkpoints at other world sizes ---------------------------------------------------------
def _train_and_save(rank, world, out, plan_name, steps):
    """Train ``steps`` steps, then save both checkpoint formats: a consolidated file (rank 0)
    and a sharded directory (every rank)."""
    model = _model(frozen=True)
    losses, engine = protrain_run(model, batches(steps, seed=20 + rank), standard_plans(model)[plan_name], clip=0.5)
    state = {"model": engine.state_dict(), "optimizer": engine.states.optimizer()}
    if rank == 0:
        torch.save(state, os.path.join(out, "full.pt"))
    engine.save_sharded(os.path.join(out, "sharded"))
    # Sharded, an offloaded chunk's parameters are whole on no rank: model.state_dict() is refused
    # with the fix, and so is using such a parameter (it read NaN before).
    try:
        engine.module.state_dict()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    streamed = [p for c in engine.chunks if not c.persistent for p in c.params]
    try:
        read = float(streamed[0].sum())
    except RuntimeError as e:
        read = str(e)
    engine.close()
    return dict(state, refused=refused, read=read, world=world)


def _resume(rank, world, out, plan_name, source):
    """Load ``source`` ("full.pt" or "sharded") into ProTrain at this world size and into plain
    PyTorch + DDP (from the consolidated file), train both two more steps."""
    data = batches(2, seed=30 + rank)
    full = torch.load(os.path.join(out, "full.pt"), weights_only=True)
    reference = _model(frozen=True, seed=7)
    reference.load_state_dict(full["model"])
    model = _model(frozen=True, seed=7)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = pt.wrap(model, torch.optim.AdamW(trainable, lr=1e-2), standard_plans(model)[plan_name], device="cpu",
                     config=pt.ProTrainConfig(clipping=("norm", 0.5), runtime=pt.RuntimeConfig(check_invariants=True)))
    if source == "sharded":
        engine.load_sharded(os.path.join(out, "sharded"))
    else:
        engine.load_state_dict(full["model"])
        engine.states.load_optimizer(full["optimizer"])
    loaded = engine.state_dict(rank0_only=False)
    assert all(torch.equal(loaded[k], full["model"][k]) for k in full["model"]), "the weights did not load exactly"
    losses = train_engine(engine, data)
    weights = engine.state_dict()
    engine.close()
    ref_losses, ref_weights = _ddp_from(reference, full["optimizer"], data, ddp=world > 1)
    return losses, ref_losses, weights, ref_weights


def _ddp_from(model, optimizer_state, data, *, ddp: bool):
    """DDP (or plain PyTorch in one process) from the consolidated checkpoint: the optimizer
    state in torch's format loads as is."""
    model = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    opt.load_state_dict(optimizer_state)
    for group in opt.param_groups:  # the saved groups say fused=None (ProTrain's user optimizer): keep fused
        group.update(fused=True, foreach=None)
    losses = []
    for x in data:
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _check_resumed(results, *, exact=False):
    for rank, (losses, ref_losses, weights, ref_weights) in enumerate(results):
        if exact:
            assert losses == ref_losses, rank
            assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
            continue
        assert losses == pytest.approx(ref_losses, abs=LOSS_ATOL), rank
        if rank == 0:
            assert max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) < WEIGHT_ATOL


def test_checkpoints_resume_at_other_world_sizes(tmp_path):
    """2 -> 3 (sharded directory), 2 -> 1 (both formats, in this process), 1 -> 3 (consolidated
    file): the state loads exactly, and training goes on as DDP (or plain PyTorch) from it."""
    saved = spawn(_train_and_save, 2, tmp_path / "w2", str(tmp_path), "mixed-buf2", 2)[0]
    assert saved["optimizer"]["state"]  # Adam's moments came along
    assert "engine.state_dict()" in saved["refused"]
    assert "used outside the module it belongs to" in saved["read"] and "engine.state_dict()" in saved["read"]
    full = torch.load(tmp_path / "full.pt", weights_only=True)  # opens in plain PyTorch and in from_pretrained
    config = _model(frozen=False).config
    hf = type(_model(frozen=False)).from_pretrained(None, config=config, state_dict=full["model"])
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in full["model"].items())
    _check_resumed(spawn(_resume, 3, tmp_path / "w3", str(tmp_path), "streamed-buf1", "sharded"))
    for source in ("sharded", "full.pt"):  # 2 -> 1: one process is bitwise with plain PyTorch
        _check_resumed([_resume(0, 1, str(tmp_path), "all-persistent", source)], exact=True)
    one = tmp_path / "one"
    one.mkdir()
    _train_and_save(0, 1, str(one), "swap-checkpoint", 2)  # 1 -> 3
    _check_resumed(spawn(_resume, 3, tmp_path / "w3b", str(one), "mixed-buf2", "full.pt"))


# ----- Lightning: the Trainer and Fabric with devices=2 on the CPU ------------------------------
def _launch(*runs, env=None):
    """Each run ``(args, out)`` of tests/scripts/lightning_run.py, all at once, each on a port of
    its own (their processes wait for each other's imports and collectives: side by side they
    take 2 cores' time, not the sum), in ``env`` (by default this process's environment); each
    run's per-rank results, in order."""
    ports = set()
    while len(ports) < len(runs):
        ports.add(free_port())
    procs = []
    try:
        for (args, out), port in zip(runs, ports):
            os.makedirs(out, exist_ok=True)
            procs.append(subprocess.Popen([sys.executable, SCRIPT, *args, str(out)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True,
                                          env={**(env or os.environ), "PROTRAIN_CACHE_DIR": str(out),
                                               "MASTER_PORT": str(port)}))
        results = []
        for proc, (args, out) in zip(procs, runs):
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, (args, err[-4000:])
            results.append([torch.load(os.path.join(out, f), weights_only=False)
                            for f in sorted(os.listdir(out)) if f.startswith("rank")])
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _beside_ddp(kind: str) -> None:
    """The background run ``lightning-<kind>``: tests/scripts/lightning_run.py's ``kind`` (trainer
    or fabric) on 2 processes with DDP (in ``ddp/``) and with ProTrain, sharded (in ``pt/``)."""
    @background_run(f"lightning-{kind}")
    def run(folder, env, results):
        return folder, _launch(((kind, "ddp", "2"), folder / "ddp"),
                               ((kind, "protrain", "2", "--sharded"), folder / "pt"), env=env)


_beside_ddp("trainer")
_beside_ddp("fabric")


@pytest.mark.background("lightning-trainer")
def test_trainer_with_two_cpu_devices_trains_like_ddp_and_resumes_on_one(tmp_path, background):
    """``Trainer(accelerator="cpu", devices=2, strategy=ProTrainStrategy(...))`` (Lightning's
    launcher, gloo): per-rank losses equal ``strategy="ddp"``'s, with accumulation and clipping;
    ``trainer.predict`` after fit gives each rank its own unpadded share of the batches (3 and 2:
    [Note: uneven predict batches]; before, gloo aborted on a collective mismatch); its sharded
    checkpoint resumes on one device like the default strategy from the full file."""
    runs, (ddp, protrain) = background
    assert [r["world"] for r in protrain] == [2, 2]
    for a, b in zip(ddp, protrain):
        assert b["losses"] == pytest.approx(a["losses"], abs=LOSS_ATOL)
        assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < WEIGHT_ATOL
        assert [len(p) for p in b["predictions"]] == [len(p) for p in a["predictions"]]
        for p, q in zip(a["predictions"], b["predictions"]):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-3)  # (the weights' tolerance, summed over the vocabulary)
    assert [len(r["predictions"]) for r in protrain] == [3, 2]
    assert (runs / "pt" / "ckpt.ckpt" / ".metadata").is_file()  # a sharded directory
    assert (runs / "pt" / "final.ckpt").is_file()  # after fit: one file
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import lightning_run
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    one = {}
    for name, strategy, ckpt in (("pt1", "protrain", "ckpt.ckpt"), ("auto1", "auto", "final.ckpt")):
        args = lightning_run.argparse.Namespace(strategy=strategy, devices=1, out=str(tmp_path / name), sharded=False,
                                                resume=str(runs / "pt" / ckpt), epochs=2, state_format="fp32")
        os.makedirs(args.out)
        lightning_run.trainer_run(args)
        one[name] = torch.load(tmp_path / name / "rank0.pt", weights_only=False)
    assert one["pt1"]["losses"] == one["auto1"]["losses"]  # 2 -> 1: one process is bitwise
    assert all(torch.equal(one["pt1"]["weights"][k], v) for k, v in one["auto1"]["weights"].items())


@pytest.mark.slow  # (the engine-level 8-bit parity over two processes is in test_state_formats.py)
def test_trainer_with_two_cpu_devices_and_8bit_moments_trains_like_ddp_with_adamw8bit(tmp_path, monkeypatch):
    """``optimizer_state_format="8bit"`` through the Trainer on two processes, with accumulation
    and clipping (their tolerances: the module's docstring) and a full checkpoint: per-rank losses
    and the final weights are DDP's with bitsandbytes' AdamW8bit. The update runs bitsandbytes'
    own calls (PROTRAIN_ONEPASS=0, as in test_state_formats' two-process test; the one-pass
    kernel's distance from bitsandbytes is test_onepass's)."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("PROTRAIN_ONEPASS", "0")
    ddp, protrain = _launch((("trainer", "ddp", "2", "--state-format", "8bit"), tmp_path / "ddp"),
                            (("trainer", "protrain", "2", "--state-format", "8bit"), tmp_path / "pt"))
    assert [r["world"] for r in protrain] == [2, 2]
    for a, b in zip(ddp, protrain):
        assert b["losses"] == pytest.approx(a["losses"], abs=LOSS_ATOL)
        assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < WEIGHT_ATOL
    assert (tmp_path / "pt" / "final.ckpt").is_file()


@pytest.mark.background("lightning-fabric")
def test_fabric_with_two_cpu_devices_trains_like_ddp(background):
    """``Fabric(accelerator="cpu", devices=2, strategy=ProTrainFabricStrategy(...))``: per-rank
    losses equal DDP's (``fabric.clip_gradients`` included), and ``fabric.save`` writes a sharded
    directory."""
    runs, (ddp, protrain) = background
    assert [r["world"] for r in protrain] == [2, 2]  # not one process silently
    for a, b in zip(ddp, protrain):
        assert b["losses"] == pytest.approx(a["losses"], abs=LOSS_ATOL)
    assert (runs / "pt" / "ckpt" / ".metadata").is_file() and (runs / "pt" / "ckpt" / "meta.pt").is_file()


@pytest.mark.slow
def test_trainer_resumes_a_two_process_checkpoint_on_three(tmp_path):
    """2 -> 3 through the Trainer: the sharded directory resumes with 3 processes as DDP resumes
    from the full file."""
    _launch((("trainer", "protrain", "2", "--sharded"), tmp_path / "two"))
    ddp, protrain = _launch(
        (("trainer", "ddp", "3", "--resume", str(tmp_path / "two" / "final.ckpt"), "--epochs", "2"), tmp_path / "ddp3"),
        (("trainer", "protrain", "3", "--resume", str(tmp_path / "two" / "ckpt.ckpt"), "--epochs", "2"), tmp_path / "pt3"))
    assert [r["world"] for r in protrain] == [3, 3, 3]
    for a, b in zip(ddp, protrain):
        assert b["losses"] == pytest.approx(a["losses"], abs=LOSS_ATOL)
        assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < WEIGHT_ATOL


def _cuda_scenarios(rank, world):
    """The fp32 plans on the GPUs over NCCL (collectives on the communication stream)."""
    device = torch.device("cuda", rank)
    out = []
    for plan_name, kw, frozen in SCENARIOS[:4]:
        model = _model(frozen)
        data = [x.to(device) for x in batches(4, seed=10 + rank)]
        ref_losses, ref_weights = ddp_reference(model, data, device=device, **kw)
        losses, engine = protrain_run(_model(frozen), data, standard_plans(model)[plan_name], device=device, **kw)
        weights = engine.state_dict()
        engine.close()
        diff = max((weights[k] - ref_weights[k].cpu()).abs().max().item() for k in weights) if rank == 0 else None
        out.append((ref_losses, losses, diff))
    return out


@pytest.mark.cuda
def test_nccl_sharded_engines_train_like_ddp(tmp_path):
    """Several GPUs: the same comparison with NCCL (GPU kernels may differ between the two runs in
    their reduction order, so within the tolerances, not bitwise)."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"NCCL over several processes needs 2 or more GPUs; this machine has {n}")
    results = spawn(_cuda_scenarios, min(n, 4), tmp_path, backend="nccl")
    for rank, rows in enumerate(results):
        for (ref, got, diff), (plan_name, kw, _) in zip(rows, SCENARIOS):
            assert got == pytest.approx(ref, abs=LOSS_ATOL), (plan_name, kw, rank)
            assert rank or diff < WEIGHT_ATOL, (plan_name, kw, diff)


def _one_rank_skips_a_module(rank, world, plan_name):
    """The last rank's last MLP gives no gradient (its output replaced by zeros there only)."""
    model = _model(frozen=False)
    if rank == world - 1:
        model.model.layers[-1].mlp.forward = lambda x: x * 0
    try:
        protrain_run(model, batches(2, seed=10 + rank), standard_plans(_model(frozen=False))[plan_name])
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("plan_name", ["all-persistent", "streamed-buf1"])
def test_a_parameter_used_on_some_ranks_only_stops_every_rank_with_the_fix(plan_name, tmp_path):
    """Review of issue 17: with a parameter unused on one rank, the ranks' reduce-scatters came in
    different orders (a gloo size error, or chunks silently mixed up where sizes agree). At
    each backward the ranks compare which parameters their losses reach (one host all-reduce,
    issue 26, read before the backward's first chunk collective), so every rank stops there,
    before any reduce-scatter, naming the parameter and the fix."""
    for message in spawn(_one_rank_skips_a_module, 2, tmp_path, plan_name):
        assert message is not None and "model.layers.3.mlp.gate_proj.weight" in message, message
        assert "find_unused_parameters" in message and "requires_grad=False" in message, message


class _TwoExperts(torch.nn.Module):
    """Two blocks of one shape that the last rank runs in the other order: every rank uses every
    parameter, but their gradients complete, and their chunks reduce, in another order."""

    def __init__(self, swapped: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.order = [1, 0] if swapped else [0, 1]

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return x.square().mean()


def _rank_ordered_blocks(rank, world):
    model = _TwoExperts(swapped=rank == world - 1)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=2, n_buffer=0),
                     device="cpu",
                     config=pt.ProTrainConfig(planning=pt.PlanningConfig(blocks=model.blocks, chunk_size=16 * 17)))
    assert engine.layout.n_chunks == 2
    torch.manual_seed(rank)
    try:
        for step in range(3):
            engine.backward(engine.module(torch.randn(4, 16)))
            engine.step()
            engine.zero_grad()
    except RuntimeError as e:
        return step, str(e)
    return None


def test_ranks_that_reduce_their_chunks_in_another_order_stop_at_the_next_backward(tmp_path):
    """The same parameters, in a data-dependent order: the first backward's reduce-scatters pair
    one rank's chunk with the other's (they are the same size); the next backward's check (the
    order's hash rides the same all-reduce) stops every rank with the fix."""
    for stopped in spawn(_rank_ordered_blocks, 2, tmp_path):
        assert stopped is not None
        step, message = stopped
        assert step == 1 and "different order" in message and "requires_grad=False" in message, message


class _GatedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.gate = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.gated = True

    def forward(self, x):
        y = torch.relu(self.lin(x))
        return (y * torch.sigmoid(self.gate(x)) if self.gated else y) + x


class _Gated(torch.nn.Module):
    """Blocks with a gate that the first micro-batch of each step leaves out: its chunks get a
    partial set of gradients in that pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)
        self.blocks = torch.nn.ModuleList(_GatedBlock() for _ in range(3))

    def set_gated(self, gated: bool) -> None:
        for b in self.blocks:
            b.gated = gated

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x).pow(2).mean()


def _gated_accumulation(rank, world, plan_name, garbage):
    """Three steps of two micro-batches (the first without the gates), with the gradient
    buffers' unwritten places filled with NaN where ``garbage`` (what ``torch.empty`` may hold)."""
    from protrain_core.runtime.storage import ChunkStorage

    allocate = ChunkStorage.allocate_grad_buffer

    def with_garbage(self, zero):
        buffer = allocate(self, zero).fill_(float("nan"))
        for start, end in zero:
            buffer[start:end].zero_()
        return buffer

    if garbage:
        ChunkStorage.allocate_grad_buffer = with_garbage
    try:
        model = _Gated()
        n = 4
        plan = pt.Plan(n_persist=n, n_buffer=0) if plan_name == "all-persistent" else pt.Plan(n_persist=0, n_buffer=2)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), plan, device="cpu",
                         config=pt.ProTrainConfig(planning=pt.PlanningConfig(blocks=model.blocks, chunk_size=2200),
                                                  runtime=pt.RuntimeConfig(check_invariants=True)))
        assert engine.layout.n_chunks == n, engine.layout.n_chunks
        g, losses = torch.Generator().manual_seed(10 + rank), []
        for _ in range(3):
            for micro in range(2):
                model.set_gated(micro == 1)
                with (engine.no_sync() if micro == 0 else _null()):
                    loss = engine.module(torch.randn(4, 8, generator=g)) / 2
                    engine.backward(loss)
                losses.append(loss.item())
            engine.step()
            engine.zero_grad()
        weights = engine.state_dict()
        engine.close()
        return losses, weights
    finally:
        ChunkStorage.allocate_grad_buffer = allocate


def _gated_runs(rank, world):
    """``_gated_accumulation`` without and with garbage, on both plans, one after the other."""
    return {(plan_name, garbage): _gated_accumulation(rank, world, plan_name, garbage)
            for plan_name in ("all-persistent", "streamed-buf2") for garbage in (False, True)}


def test_what_a_gradient_buffer_leaves_unwritten_never_reaches_the_results(tmp_path):
    """Issue 26: a chunk's gradient buffer is allocated uninitialised but for its padding, and
    the places of members that got no gradient in a pass are zeroed before it is read. With
    NaN in every unwritten place, a run whose first micro-batch leaves some members without
    gradients (sharded over 2 processes; persistent chunks reduce-scattered, streamed ones
    offloaded) is the same bit for bit as one without. (The four runs in one launch.)"""
    for runs in spawn(_gated_runs, 2, tmp_path):
        for plan_name in ("all-persistent", "streamed-buf2"):
            (l0, w0), (l1, w1) = runs[plan_name, False], runs[plan_name, True]
            assert l0 == l1 and all(torch.isfinite(torch.tensor(l0))), (plan_name, l0, l1)
            assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), plan_name


def _tied_states(rank, world):
    from conftest import tiny_gpt2

    model = tiny_gpt2()  # the head's weight is the embedding's: one tensor under two names
    losses, engine = protrain_run(model, batches(2, seed=10 + rank), pt.Plan(n_persist=1, n_buffer=2))
    weights = engine.state_dict()  # rank 0 keeps it; every rank must gather the same chunks
    states = engine.states.optimizer(rank0_only=False)
    x = batches(1, seed=20)[0]  # ([Note: loss.backward()]: the ranks need the loss itself)
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad\) with several processes.*Call engine.backward\(loss\)"):
        engine.module(input_ids=x, labels=x).loss.backward()
    engine.close()
    return weights, states


def test_tied_weights_gather_alike_on_every_rank(tmp_path):
    """Found by the 3-process Trainer test: rank 0 skipped the tied name's second gather and the
    others did not, so the collectives after it were paired wrongly. Every rank now gathers the
    same chunks: the optimizer state gathered after the state dict is the same on both ranks,
    and rank 0's state dict holds the tied tensor once under both names."""
    (w0, s0), (w1, s1) = spawn(_tied_states, 2, tmp_path)
    assert w1 == {} and w0["lm_head.weight"] is w0["transformer.wte.weight"]
    assert set(s0["state"]) == set(s1["state"])
    assert all(torch.equal(s0["state"][k][n], s1["state"][k][n]) for k in s0["state"] for n in ("exp_avg", "exp_avg_sq"))


def _meta_models(rank, world, hf):
    """Models built on the meta device on every rank, with another random state per rank: filled
    from the saved model, they train like DDP on it; initialised by their modules, every rank
    holds rank 0's values ([Note: weights straight into chunks])."""
    from transformers import LlamaForCausalLM

    ref = tiny_llama(seed=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(ref.config)
    losses, engine = protrain_run(model, batches(3, seed=10 + rank), pt.Plan(n_persist=1, n_buffer=1), weights=hf)
    engine.close()
    torch.manual_seed(100 + rank)
    with torch.device("meta"):
        model = LlamaForCausalLM(ref.config)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    initialised = engine.state_dict(rank0_only=False)
    engine.close()
    return ddp_reference(ref, batches(3, seed=10 + rank))[0], losses, initialised


def test_meta_models_are_filled_alike_on_every_rank(tmp_path):
    """Each rank keeps its piece of every chunk: without rank 0's values broadcast chunk by chunk,
    the initialised model would be a patchwork of both ranks' draws (still alike on both ranks
    when gathered); with them it is rank 0's, the one process's of its seed."""
    from transformers import LlamaForCausalLM

    ref = tiny_llama(seed=0)
    ref.save_pretrained(tmp_path / "hf")
    (ref0, l0, init0), (ref1, l1, init1) = spawn(_meta_models, 2, tmp_path, str(tmp_path / "hf"))
    assert (l0, l1) == (ref0, ref1)
    torch.manual_seed(100)  # rank 0's
    with torch.device("meta"):
        alone = LlamaForCausalLM(ref.config)
    engine = pt.wrap(alone, torch.optim.AdamW(alone.parameters()), pt.Plan(n_persist=1, n_buffer=1), device="cpu")
    one = engine.state_dict()
    engine.close()
    for k, v in one.items():
        assert torch.equal(init0[k], v) and torch.equal(init1[k], v), k


def test_a_device_count_is_never_ignored():
    """What several processes cannot honour is refused when the Trainer is built, with the fix."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric
    from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy

    with pytest.raises(ValueError, match="remove device="):
        pl.Trainer(accelerator="cpu", devices=2, strategy=ProTrainStrategy(device="cpu"), logger=False)
    with pytest.raises(ValueError, match="start_method='popen'"):
        Fabric(accelerator="cpu", devices=2, strategy=ProTrainFabricStrategy(start_method="spawn"))
    trainer = pl.Trainer(accelerator="cpu", devices=3, num_nodes=2, strategy="protrain", logger=False)
    assert trainer.world_size == 6 and trainer.strategy.is_distributed  # launched by Lightning, not ignored
    fabric = Fabric(accelerator="cpu", devices=2, strategy="protrain")
    assert fabric.world_size == 2 and fabric.strategy.distributed_sampler_kwargs["num_replicas"] == 2


def test_a_sharded_save_replaces_the_old_directory_and_removes_what_killed_saves_left(tmp_path):
    """One process (no process group): the directory is written beside and renamed over the old
    one (the user's own files in it kept); the temporary directory of a save whose process is gone
    is removed, a running one's kept."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ckpt.protrain-tmp-{dead.pid}-0000"
    running = tmp_path / f".ckpt.protrain-tmp-{os.getpid()}-1111"
    for d in (stale, running):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
    model = _model(frozen=True)
    losses, engine = protrain_run(model, batches(2), standard_plans(model)["mixed-buf2"])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "__1_0.distcp").write_bytes(b"old")  # an older checkpoint's (of 2 processes)
    (tmp_path / "ckpt" / "notes.txt").write_bytes(b"the user's")  # kept
    engine.save_sharded(tmp_path / "ckpt")
    assert not stale.exists() and running.exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".metadata", "__0_0.distcp", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "ckpt"]
    engine.close()
    from protrain_core.checkpoint import check_sharded

    check_sharded(tmp_path / "ckpt", _model(frozen=False))  # names and sizes match (trainability aside)
    with pytest.raises(ValueError, match="does not match this model.*missing"):
        check_sharded(tmp_path / "ckpt", tiny_llama(n_layer=5))


def test_an_unknown_checkpoint_type_is_refused():
    from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy

    for cls in (ProTrainStrategy, ProTrainFabricStrategy):
        with pytest.raises(ValueError, match="'full'.*'sharded'"):
            cls({"checkpoint": {"state_dict_type": "dcp"}})


def _host_max(rank, world):
    from protrain_core.runtime.sharding import Sharding

    return Sharding.resolve().max_on_host([10.0 * rank, 5.0])


def test_host_numbers_agree_without_the_device(tmp_path):
    """``Sharding.max_on_host`` (the longest batch of the ranks, the slowest rank's collective
    timings) is a host collective: every rank gets the largest of each value."""
    assert spawn(_host_max, 2, tmp_path) == [[10.0, 5.0], [10.0, 5.0]]


# (the group's backend config, the device the chunks live on, the backend that must run them):
# a group with one backend per device type (torch's default) runs the chunks on the device's.
BACKENDS = [("cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:gloo", "cpu", "gloo"),
            ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("cpu:gloo,cuda:nccl", "cuda", "nccl")]


@pytest.mark.parametrize("config,device,backend", BACKENDS)
def test_each_backend_reduces_and_gathers_with_its_fastest_collective(monkeypatch, config, device, backend):
    """NCCL averages inside the reduce-scatter (a pre-multiplied sum, what DDP computes): no
    scaling pass over the gradient buffer first, and gathers with all-gather. gloo has no
    average, so the buffer is scaled first; it reduces by messages (each rank's piece sent to
    its owner, the received piece added to the rank's own: faster than its all-reduce or its
    reduce-scatter), and gathers with one broadcast per rank's piece (faster than its all-gather
    or an all-reduce). (The tensors are CPU tensors whatever the device: the collectives are
    stand-ins.)"""
    import torch.distributed as dist

    from protrain_core.runtime import sharding as S

    calls = []

    class Done:  # a collective's Work, already complete
        def is_completed(self):
            return True

        def wait(self):
            pass

    def record(*entry):
        calls.append(entry)
        return Done()

    def receive(t, src, group, tag):  # the other rank's piece, scaled by it
        t.copy_(torch.tensor([0.25, 0.5]))
        return record("irecv", src, tag)

    monkeypatch.setattr(S, "_reduce_scatter", lambda out, full, op, group, async_op=False: record("reduce_scatter", op, full.clone()))
    monkeypatch.setattr(S, "_all_gather", lambda full, piece, group, async_op=False: record("all_gather", None, full.clone()))
    monkeypatch.setattr(S.dist, "all_reduce", lambda t, op, group, async_op=False: record("all_reduce", op, t.clone()))
    monkeypatch.setattr(S.dist, "broadcast", lambda t, src, group, async_op=False: record("broadcast", src, t.clone()))
    monkeypatch.setattr(S.dist, "isend", lambda t, dst, group, tag: record("isend", dst, tag, t.clone()))
    monkeypatch.setattr(S.dist, "irecv", receive)
    monkeypatch.setattr(S.dist, "get_global_rank", lambda group, rank: rank + 10)
    monkeypatch.setattr(S.dist, "get_backend_config", lambda group=None: config)
    sharding = S.Sharding(group=None, rank=1, world=2)
    sharding.check_device(torch.device(device))
    assert sharding.pre_scale == (None if backend == "nccl" else 0.5)
    out = torch.empty(2)
    sharding.reduce_scatter_mean(out, torch.tensor([3.0, 3.0, 4.0, 6.0]))
    sharding.gather_(torch.arange(1.0, 5.0))
    if backend == "nccl":
        assert [c[:2] for c in calls] == [("reduce_scatter", dist.ReduceOp.AVG), ("all_gather", None)]
        assert torch.equal(calls[0][2], torch.tensor([3.0, 3.0, 4.0, 6.0]))
    else:
        tag = S._EXCHANGE_TAG
        assert [c[:2] for c in calls] == [("isend", 10), ("irecv", 10), ("broadcast", 10), ("broadcast", 11)]
        assert calls[0][2] == calls[1][2] == tag  # apart from the user's own messages
        assert torch.equal(calls[0][3], torch.tensor([1.5, 1.5]))  # piece 0, scaled by 1/2, to rank 0
        assert torch.equal(out, torch.tensor([2.25, 3.5]))  # the received piece plus this rank's, scaled
        assert torch.equal(calls[2][2], torch.tensor([1.0, 2.0]))  # each piece from its rank (global numbers)
        assert torch.equal(calls[3][2], torch.tensor([3.0, 4.0]))


def test_gloo_sums_the_pieces_it_receives_in_rank_order(monkeypatch):
    """With three ranks and more the order of a sum shows in its last bits: every rank sums its
    piece over the ranks in rank order (0 + 1, then + 2), whichever it receives first. Here
    rank 2 gets 2**24 from rank 0 and 1 from rank 1, and holds -2**24 itself: in fp32,
    (2**24 + 1) rounds back to 2**24 and the sum is 0; any other order gives 1."""
    from protrain_core.runtime import sharding as S

    class Done:
        def is_completed(self):
            return True

        def wait(self):
            pass

    pieces = {0: 2.0 ** 24, 1: 1.0}  # what ranks 0 and 1 send rank 2 (scaled already)
    sent = []

    def receive(t, src, group, tag):
        t.fill_(pieces[src])
        return Done()

    monkeypatch.setattr(S.dist, "isend", lambda t, dst, group, tag: sent.append(dst) or Done())
    monkeypatch.setattr(S.dist, "irecv", receive)
    monkeypatch.setattr(S.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(S.dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    out = torch.empty(2)
    S.Sharding(group=None, rank=2, world=3).reduce_scatter_mean(out, torch.full((6,), -2.0 ** 24), scaled=True)
    assert sent == [0, 1]
    assert out.tolist() == [0.0, 0.0]


def _collective_schedule(rank, world):
    """One all-persistent step on 2 gloo processes, recording in order: the gradient hooks, the
    chunk collectives the sharding issues (and whether they block), and the waits for them."""
    from protrain_core.runtime import device as D
    from protrain_core.runtime import sharding as S
    from protrain_core.runtime.scheduler import Scheduler

    events = []
    all_reduce, broadcast, wait, on_grad = S.dist.all_reduce, S.dist.broadcast, D.HostEvent.wait, Scheduler.on_grad
    isend = S.dist.isend
    wait_work = S.wait_work

    def recording_wait_work(work):  # a host collective waited for as soon as it is issued
        events.append(("block", None))
        return wait_work(work)

    def recording_all_reduce(t, *args, async_op=False, **kw):
        events.append(("issue", async_op))
        return all_reduce(t, *args, async_op=async_op, **kw)

    def recording_isend(t, *args, **kw):  # a chunk's reduction: its pieces sent to the other rank
        events.append(("issue", True))  # (a posted message: it never blocks)
        return isend(t, *args, **kw)

    def recording_broadcast(t, *args, async_op=False, **kw):
        events.append(("broadcast", async_op))
        return broadcast(t, *args, async_op=async_op, **kw)

    def recording_wait(self):
        events.append(("wait", self._done))
        return wait(self)

    def recording_on_grad(self, *args):
        events.append(("hook", None))
        return on_grad(self, *args)

    S.dist.all_reduce, S.dist.broadcast, S.wait_work = recording_all_reduce, recording_broadcast, recording_wait_work
    S.dist.isend = recording_isend
    D.HostEvent.wait, Scheduler.on_grad = recording_wait, recording_on_grad
    try:
        model = tiny_llama(seed=0)
        engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), standard_plans(model)["all-persistent"],
                         device="cpu")
        x = batches(1, seed=10 + rank)[0]
        loss = engine.module(input_ids=x, labels=x).loss
        events.append(("backward", None))
        engine.backward(loss)
        events.append(("step", None))
        engine.step()
        events.append(("done", None))
        chunks = len(engine.chunks)
        engine.close()
    finally:
        S.dist.all_reduce, S.dist.broadcast, D.HostEvent.wait, Scheduler.on_grad = all_reduce, broadcast, wait, on_grad
        S.wait_work, S.dist.isend = wait_work, isend
    return events, chunks


def test_cpu_collectives_run_beside_backward_and_are_waited_where_their_results_are_needed(tmp_path):
    """On a CPU device the chunks' reduce-scatters (gloo: messages to the other rank) are issued
    without blocking as each chunk's gradients complete, while backward goes on (gloo sends
    and receives them on its own threads), and waited once each, after the last gradient hook; the
    all-gathers after the updates (gloo: a broadcast per rank's piece) likewise, waited at the
    end of the step. The usage check's host all-reduce is issued before the first gradient
    hook and waited for just before the first chunk collective (issue 26): the backward of the
    last chunk runs while it travels."""
    for events, chunks in spawn(_collective_schedule, 2, tmp_path):
        backward = events[events.index(("backward", None)) + 1:events.index(("step", None))]
        step = events[events.index(("step", None)) + 1:events.index(("done", None))]
        hooks = [k for k, e in enumerate(backward) if e[0] == "hook"]
        issues = [k for k, e in enumerate(backward) if e[0] == "issue"]
        blocks = [k for k, e in enumerate(backward) if e[0] == "block"]
        # The usage check: one host collective, issued before the hooks without waiting, waited
        # for (by polling: ctrl-C still ends it) once, after hooks ran and before the first
        # chunk collective; no other blocking collective in backward.
        assert backward[issues[0]] == ("issue", True) and issues[0] < hooks[0], backward
        assert len(blocks) == 1 and hooks[0] < blocks[0] < issues[1] and blocks[0] == issues[1] - 1, backward
        issues = issues[1:]
        assert all(backward[k][1] for k in issues) and len(issues) == chunks, backward  # one per chunk, none blocking
        assert min(issues) < hooks[-1], backward  # the first ones while gradients still come
        waits = [k for k, e in enumerate(backward) if e[0] == "wait"]
        assert len(waits) == chunks and min(waits) > hooks[-1], backward  # waited after the last hook
        assert not any(e[0] == "broadcast" for e in backward), backward
        assert not any(e[0] == "issue" for e in step), step
        gathers = [e for e in step if e[0] == "broadcast"]
        assert len(gathers) == 2 * chunks and all(asynchronous for _, asynchronous in gathers), step
        assert sum(e[0] == "wait" for e in step) == chunks, step


def test_a_host_event_finishes_its_collectives_then_its_continuations_once_in_order():
    """HostEvent (a CPU device's collectives in flight): ``wait`` finishes the event it comes
    after, then waits for every collective, then runs the continuations in the order they were
    added, once, whichever thread waits first; ``query`` looks at the collectives only."""
    from protrain_core.runtime.device import HostEvent

    log = []

    class Work:  # a collective that runs in the background: done from the second look on
        def __init__(self, name):
            self.name, self.completed = name, False

        def is_completed(self):
            done, self.completed = self.completed, True
            return done

        def wait(self):
            log.append(f"wait {self.name}")
            self.completed = True

    first = HostEvent()
    first.add(Work("a"), lambda: log.append("then a"))
    event = HostEvent(first)
    event.add(Work("b"), lambda: log.append("then b"))
    event.add(Work("c"), lambda: log.append("then c"))
    assert not event.query() and not event.empty and HostEvent().empty
    event.wait()
    event.wait()
    first.wait()
    assert log == ["wait a", "then a", "wait b", "wait c", "then b", "then c"]
    assert event.query()


def test_later_runs_after_every_continuation_on_the_waiting_thread_even_when_added_during_the_wait():
    """``HostEvent.later(fn)``: ``fn`` runs once the event's continuations ran -- appended while
    another thread is inside the wait (that thread runs it, and ``later`` does not wait for
    it), or at once when the event is over already."""
    import threading

    from protrain_core.runtime.device import HostEvent

    log, inside, release = [], threading.Event(), threading.Event()

    def reading():  # a continuation that reads a block (blocks the waiting thread until released)
        inside.set()
        release.wait(30)
        log.append(("read", threading.current_thread().name))

    event = HostEvent()
    event.add(None, reading)
    waiter = threading.Thread(target=event.wait, name="waiter")
    waiter.start()
    assert inside.wait(30)
    event.later(lambda: log.append(("free", threading.current_thread().name)))
    assert log == []  # neither ran on this thread, nor waited for the other
    release.set()
    waiter.join(30)
    assert log == [("read", "waiter"), ("free", "waiter")]
    event.later(lambda: log.append(("late", threading.current_thread().name)))
    assert log[-1] == ("late", threading.current_thread().name)
    event.wait()
    assert len(log) == 3  # each ran once


def test_a_continuation_that_raised_is_not_run_again_by_the_next_wait():
    """A continuation that raised (ctrl-C or an error inside the sum of a reduction) ends the
    wait with its error; the next wait of the event runs the continuations after it, never
    those that ran:
    an accumulation added twice, or a block returned to the cache twice and handed to two
    chunks, would follow."""
    from protrain_core.runtime.device import HostEvent

    log = []

    def interrupted():
        log.append("interrupted")
        raise RuntimeError("interrupted")

    event = HostEvent()
    event.add(None, lambda: log.append("accumulate"))
    event.add(None, interrupted)
    event.add(None, lambda: log.append("free"))
    with pytest.raises(RuntimeError, match="interrupted"):
        event.wait()
    event.wait()
    event.wait()
    assert log == ["accumulate", "interrupted", "free"]


def test_a_cpu_devices_freed_block_is_handed_out_again_only_once_its_readers_are_done():
    """``BlockCache`` ([Note: a CPU device's block cache]): a block freed after an event goes
    back when the event is over (its collectives and the continuations that read the block),
    not before; one freed with no event at once; only for the same size and dtype; never, if
    its event is never waited (a failed backward); ``clear`` empties the cache."""
    from protrain_core.runtime.device import BlockCache, DeviceContext, HostEvent

    class Work:
        def is_completed(self):
            return True

        def wait(self):
            pass

    blocks = BlockCache()
    a = blocks.empty(8, torch.float32)
    event, read = HostEvent(), []
    event.add(Work(), lambda: read.append(a.clone()))
    blocks.free(a, after=event)
    b = blocks.empty(8, torch.float32)
    assert b.data_ptr() != a.data_ptr() and blocks.allocated == 2 and blocks.reused == 0  # a is still read
    event.wait()
    assert read and blocks.empty(8, torch.float32) is a and blocks.reused == 1
    blocks.free(b)
    assert blocks.empty(8, torch.float64) is not b and blocks.empty(4, torch.float32) is not b  # other sizes
    assert blocks.nbytes == 32 and blocks.empty(8, torch.float32) is b
    lost = HostEvent()
    lost.add(Work(), None)
    blocks.free(a, after=lost)  # never waited
    assert blocks.empty(8, torch.float32) is not a and blocks.nbytes == 0
    blocks.free(b)
    ctx = DeviceContext(torch.device("cpu"))
    ctx.blocks = blocks
    ctx.empty_cache()
    assert blocks.nbytes == 0


def _blocks_per_plan(rank, world):
    return {plan_name: _blocks_per_step(plan_name, rank) for plan_name in ("all-persistent", "streamed-buf1")}


def _blocks_per_step(plan_name, rank):
    """Blocks the CPU device's cache allocated and handed out again after each of 3 steps, and
    the bytes it holds before and after ``close``."""
    model = tiny_llama(seed=0)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), standard_plans(model)[plan_name], device="cpu",
                     config=pt.ProTrainConfig(runtime=pt.RuntimeConfig(check_invariants=True)))
    counts = []
    for x in batches(3, seed=10 + rank):
        engine.backward(engine.module(input_ids=x, labels=x).loss)
        engine.step()
        engine.zero_grad()
        counts.append((engine.ctx.blocks.allocated, engine.ctx.blocks.reused))
    chunks, kept = len(engine.chunks), engine.ctx.blocks.nbytes
    reported = (engine.memory.cached_bytes(), f"{kept / 2**20:.2f} MiB of freed gradient buffers" in engine.summary())
    engine.close()
    return counts, chunks, kept, engine.ctx.blocks.nbytes, reported


def test_a_cpu_device_allocates_its_gradient_buffers_in_the_first_backward_only(tmp_path):
    """On a CPU device the gradient buffers (and a streamed chunk's reduced piece) come from the
    block cache: every one the first backward allocated is handed out again in the next
    backwards, none allocated anew (torch's allocator would map each anew and fault its pages
    in: [Note: a CPU device's block cache]); ``engine.memory`` reports what it holds, and
    ``close`` empties it. Both plans in one launch, one engine after the other."""
    for plan_name, (counts, chunks, kept, after_close, reported) in (
            item for per_rank in spawn(_blocks_per_plan, 2, tmp_path) for item in per_rank.items()):
        assert kept > 0 and after_close == 0, (kept, after_close)
        assert reported == (kept, True)  # engine.memory and the summary say what the cache holds
        (first, reused_first), *later = counts
        assert first >= 1 and all(allocated == first for allocated, _ in later), counts
        assert [reused for _, reused in later] == [reused_first + k * (reused_first + first) for k in (1, 2)], counts
        if plan_name == "all-persistent":  # one buffer per chunk, all reduced in flight together
            assert first == chunks and reused_first == 0, counts


def _saved_and_trained(tmp_path):
    """An engine whose checkpoint ``ckpt`` holds its weights after 2 steps; then a third step:
    (engine, weights at the save, weights now)."""
    model = _model(frozen=False)
    data = batches(3)
    _, engine = protrain_run(model, data[:2], standard_plans(model)["mixed-buf2"])
    engine.save_sharded(tmp_path / "ckpt")
    saved = engine.state_dict()
    train_engine(engine, data[2:])
    return engine, saved, engine.state_dict()


def _loaded(path):
    model = _model(frozen=False)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), standard_plans(model)["mixed-buf2"], device="cpu")
    engine.load_sharded(path)
    weights = engine.state_dict()
    engine.close()
    return weights


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kill_at", range(4))
def test_a_save_stopped_at_any_rename_leaves_the_old_or_the_new_checkpoint(kill_at, tmp_path):
    """A save over an existing checkpoint stopped before each of its four renames and removals
    ([Note: replacing a checkpoint directory]): the name then holds the old checkpoint or the new
    one, or the next load restores the new one (before: stopped between the two renames, no
    checkpoint had the name, and the next save deleted the complete new copy as a temporary);
    nothing is left beside it after the next save. The user's own files in the directory (a
    tokenizer, notes) stay in it, as Lightning's sharded strategies keep them (they were deleted)."""
    from conftest import SaveKilled, stop_saves_at

    engine, old, new = _saved_and_trained(tmp_path)
    (tmp_path / "ckpt" / "tokenizer").mkdir()
    (tmp_path / "ckpt" / "tokenizer" / "vocab.json").write_text("{}")
    (tmp_path / "ckpt" / "notes.txt").write_text("the user's")
    restore = stop_saves_at(kill_at)
    try:
        with pytest.raises(SaveKilled):
            engine.save_sharded(tmp_path / "ckpt")
    finally:
        restore()
    assert (tmp_path / "ckpt").exists() == (kill_at != 2)
    assert _same(_loaded(tmp_path / "ckpt"), old if kill_at == 0 else new)  # a complete new copy wins
    engine.save_sharded(tmp_path / "ckpt")
    engine.close()
    assert _same(_loaded(tmp_path / "ckpt"), new)
    beside = sorted(p.name for p in tmp_path.iterdir() if p.name != "ckpt" and "protrain-tmp" not in p.name)
    assert beside == [], beside
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "the user's"
    assert (tmp_path / "ckpt" / "tokenizer" / "vocab.json").read_text() == "{}"


KILLED_SAVE = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import protrain_core as pt
from conftest import batches, standard_plans, train_engine
from test_distributed import _model
model = _model(frozen=False)
engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), standard_plans(model)["mixed-buf2"], device="cpu")
train_engine(engine, batches(3))
rename = os.replace
def dying(src, dst):
    rename(src, dst)
    if str(src) == {path!r}:
        os._exit(9)  # killed once the old copy is aside, before the new one is in place
os.replace = dying
engine.save_sharded({path!r})
"""


def test_a_save_killed_between_its_renames_is_finished_by_the_next_load(tmp_path):
    """The process really dies (``os._exit``) with the old copy aside and the complete new one
    not yet in place: the next load (in another process) puts the new one in place."""
    engine, old, _ = _saved_and_trained(tmp_path)
    engine.close()
    script = KILLED_SAVE.format(tests=os.path.dirname(__file__), path=str(tmp_path / "ckpt"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr
    assert not (tmp_path / "ckpt").exists()
    weights = _loaded(tmp_path / "ckpt")
    assert not _same(weights, old)  # the new one, trained 3 steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _full_disk_on(rank_failing: int):
    def run(rank, world, out):
        import errno

        from torch.distributed.checkpoint.filesystem import FileSystem

        model = _model(frozen=False)
        _, engine = protrain_run(model, batches(1), standard_plans(model)["mixed-buf2"])
        create = FileSystem.create_stream

        def full(self, path, mode):
            if rank == rank_failing and "distcp" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return create(self, path, mode)

        FileSystem.create_stream = full
        try:
            engine.save_sharded(os.path.join(out, "ckpt"))
        except OSError as e:
            return type(e).__name__, e.errno, str(e).splitlines()[0], sorted(os.listdir(out))
        finally:
            FileSystem.create_stream = create
        return None
    return run


def _save_on_a_full_disk(rank, world, out):
    return _full_disk_on(1)(rank, world, out)


def test_a_full_disk_fails_the_save_on_every_rank_and_names_enospc(tmp_path):
    """One rank's shard does not fit on its disk: every rank's save raises an OSError whose first
    line names ENOSPC and the checkpoint, and no temporary directory is left."""
    out = tmp_path / "out"
    out.mkdir()
    for name, code, line, left in spawn(_save_on_a_full_disk, 2, tmp_path / "spawn", str(out)):
        assert name == "OSError" and code == 28, line
        assert "ENOSPC" in line and "Could not write the sharded checkpoint" in line and "ckpt" in line, line
        assert left == [], left


def test_a_full_disk_under_the_checkpoints_meta_file_names_enospc(tmp_path, monkeypatch):
    """The disk fills up while the meta file (Lightning's part of a sharded checkpoint) is
    written: torch.save to its path said only "unexpected pos 704 vs 598"; now the error names
    ENOSPC and the checkpoint, and no temporary directory is left."""
    import builtins
    import errno

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    model = tiny_llama()
    _, engine = protrain_run(model, batches(1), standard_plans(model)["mixed-buf2"])
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: Full(real_open(file, *a, **k))
                        if str(file).endswith("meta.pt") else real_open(file, *a, **k))
    with pytest.raises(OSError, match=r"Could not write the sharded checkpoint .*ckpt.*ENOSPC"):
        engine.save_sharded(tmp_path / "ckpt", meta={"epoch": 1})
    assert os.listdir(tmp_path) == []


def test_ctrl_c_inside_a_sharded_save_is_a_keyboard_interrupt_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """Ctrl-C while DCP writes a shard (DCP wraps every rank's failure in its CheckpointException,
    which Lightning's Trainer does not take for an interrupt): the save raises the
    KeyboardInterrupt itself, the checkpoint saved before is whole, and nothing is left beside it."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    model = _model(frozen=False)
    _, engine = protrain_run(model, batches(1), standard_plans(model)["mixed-buf2"])
    engine.save_sharded(tmp_path / "ckpt")
    before = {f.name: f.read_bytes() for f in (tmp_path / "ckpt").iterdir()}
    create = FileSystem.create_stream

    def interrupted(self, path, mode):
        if "distcp" in str(path):
            raise KeyboardInterrupt
        return create(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.save_sharded(tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"]
    assert {f.name: f.read_bytes() for f in (tmp_path / "ckpt").iterdir()} == before


def test_a_missing_shard_file_is_named_in_the_first_line(tmp_path):
    model = _model(frozen=False)
    _, engine = protrain_run(model, batches(1), standard_plans(model)["mixed-buf2"])
    engine.save_sharded(tmp_path / "ckpt")
    engine.close()
    (shard,) = (tmp_path / "ckpt").glob("*.distcp")
    shard.unlink()
    with pytest.raises(FileNotFoundError) as raised:
        _loaded(tmp_path / "ckpt")
    first = str(raised.value).splitlines()[0]
    assert shard.name in first and "cannot be read" in first, first


class _Holder(torch.nn.Module):
    """A LightningModule's shape: the Hugging Face model is ``self.model`` of the wrapped root."""

    def __init__(self):
        super().__init__()
        self.model = _model(frozen=False)

    def forward(self, **batch):
        return self.model(**batch)


def _inner_state_dicts(rank, world, out):
    results = {}
    for plan_name in ("streamed-buf1", "all-persistent"):
        holder = _Holder()
        _, engine = protrain_run(holder, batches(2), standard_plans(holder.model)[plan_name])
        whole = engine.state_dict(rank0_only=False)
        # The export the refusals name: the Hugging Face model inside, every rank calls it, rank 0 writes
        engine.save_pretrained(os.path.join(out, f"export-{plan_name}"))
        if rank == 0:
            from transformers import AutoModelForCausalLM

            exported = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"export-{plan_name}")).state_dict()
            results[f"{plan_name} export"] = all(torch.equal(v, whole[f"model.{k}"]) for k, v in exported.items())
        outcome = {}
        for what, call in (("model.state_dict", lambda: holder.model.state_dict()),
                           ("lm_head.state_dict", lambda: holder.model.lm_head.state_dict()),
                           ("save_pretrained", lambda: holder.model.save_pretrained(os.path.join(out, f"hf{rank}"))),
                           ("deepcopy", lambda: copy.deepcopy(holder.model).state_dict())):
            try:
                got = call()
            except RuntimeError as e:
                outcome[what] = str(e).splitlines()[0]
                continue
            if isinstance(got, dict):
                prefix = "model.lm_head." if what == "lm_head.state_dict" else "model."
                outcome[what] = all(torch.equal(v.detach().cpu(), whole[prefix + k]) for k, v in got.items())
            else:
                outcome[what] = "saved"
        engine.close()
        results[plan_name] = outcome
    return results


def test_a_module_inside_the_wrapped_model_gives_its_true_values_or_refuses_with_the_fix(tmp_path):
    """With 2 processes, ``self.model.state_dict()`` inside a LightningModule (EMA and export
    callbacks) does not run the wrapped root's hooks; it returned the offloaded chunks'
    parameters as garbage (NaN), and save_pretrained failed with a misleading error. Now a
    module holding an offloaded chunk's parameter refuses with the fix, and one whose chunks are
    whole on every rank (persistent) returns exactly the engine's gathered values. The same for
    ``copy.deepcopy`` of the model."""
    for rank, result in enumerate(spawn(_inner_state_dicts, 2, tmp_path / "spawn", str(tmp_path))):
        # engine.save_pretrained exports self.model on every plan (it was refused: "no save_pretrained")
        assert [result.pop(f"{p} export", None) for p in ("streamed-buf1", "all-persistent")] == \
            ([True, True] if rank == 0 else [None, None])
        copied = result["streamed-buf1"].pop("deepcopy")
        for what, outcome in result["streamed-buf1"].items():
            assert isinstance(outcome, str) and "offloaded chunks are not whole" in outcome \
                and "engine.state_dict()" in outcome, (what, outcome)
        # A deep copy (an EMA) too; before, it failed on the process group ("cannot pickle").
        assert isinstance(copied, str) and copied.startswith("copy.deepcopy reached the wrapped model's 'model.") \
            and "not whole on any rank" in copied and "engine.state_dict(rank0_only=False)" in copied, copied
        assert result["all-persistent"]["model.state_dict"] is True
        assert result["all-persistent"]["lm_head.state_dict"] is True
        assert result["all-persistent"]["save_pretrained"] == "saved"
        assert result["all-persistent"]["deepcopy"] is True  # the copy has the gathered values


DIFFERENCES = {"precision": "precision: rank 0: 32-true; rank 1: bf16-mixed", "chunk size": "chunk size: rank 0: ",
               "model": "parameters: rank 0: "}


def _configured_differently(rank, world):
    """Each difference of DIFFERENCES in turn, in the same processes (a refusal leaves the group
    usable): rank 1 wraps with another precision, chunk size or model; each rank's messages."""
    messages = {}
    for what in DIFFERENCES:
        kw = {"precision": "32-true", "chunk_size": None, "n_layer": 4}
        if rank == 1:
            kw.update({"precision": {"precision": "bf16-mixed"}, "chunk size": {"chunk_size": 32768},
                       "model": {"n_layer": 5}}[what])
        model = tiny_llama(n_layer=kw["n_layer"])
        try:
            pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=1, n_buffer=1),
                    precision=kw["precision"], device="cpu",
                    config=pt.ProTrainConfig(planning=pt.PlanningConfig(chunk_size=kw["chunk_size"])))
            messages[what] = None
        except ValueError as e:
            messages[what] = str(e)
    return messages


def test_ranks_configured_differently_are_refused_at_wrap_naming_the_difference(tmp_path):
    """Precision, chunk size or model structure differing between ranks (torchrun ranks reading
    different configs) used to end in a gloo collective mismatch or a hang; now every rank's wrap
    raises, before anything is allocated, with the field and each rank's value. (One launch for
    the three cases: a process start is most of each case's time.)"""
    for messages in spawn(_configured_differently, 2, tmp_path):
        for what, named in DIFFERENCES.items():
            message = messages[what]
            assert message is not None and "wrap their models differently" in message and named in message, message
        assert "model.layers.4" in messages["model"], messages["model"]  # where the parameter lists part



@pytest.mark.parametrize("case,printed", [
    ("raise-rank0", ["[rank0]: ValueError: the user's own error on rank 0"]),
    # (CI time: three cases run with the slow ones; rank 1's error and an unwritable directory take
    # the path of rank 0's error, and test_a_full_disk_fails_the_save_on_every_rank_and_names_enospc
    # checks the full disk on 2 processes.)
    pytest.param("raise-rank1", ["[rank1]: ValueError: the user's own error on rank 1"], marks=pytest.mark.slow),
    pytest.param("unwritable", ["[rank0]: NotADirectoryError"], marks=pytest.mark.slow),
    pytest.param("full-disk", ["[rank0]: OSError: [Errno 28] Could not write the sharded checkpoint",
                               "[rank1]: OSError: [Errno 28] Could not write the sharded checkpoint", "ENOSPC"],
                 marks=pytest.mark.slow),
    ("interrupt", ["Detected KeyboardInterrupt"]),
])
def test_a_failure_on_one_rank_ends_every_process_with_the_users_error(case, printed, tmp_path):
    """``Trainer(devices=2, strategy=ProTrainStrategy(...))`` (Lightning's launcher, gloo) and a
    failure: training_step raising on rank 0 or on rank 1, a checkpoint directory that cannot be
    created, one rank's disk full under a sharded save, ctrl-C (SIGINT to every process). Every
    process ends within the harness's time limit and the user's error is printed. Before: the
    teardown's collectives (the optimizer-state gather, the engine's gathers) met the other
    rank's forward or barrier: a gloo "collective mismatch" abort without the user's error, or a
    hang until gloo's 30-minute timeout."""
    from benchmarks.bench_failures import run

    result = run(case, limit=120, env={**os.environ, "PROTRAIN_CACHE_DIR": str(tmp_path / "cache")})
    output = result["output"]
    assert not result["timed_out"], f"{case}: the processes did not end within the time limit:\n{output[-12000:]}"
    assert result["returncode"] != 0
    for text in printed:
        assert text in output, (text, output[-4000:])
    assert "collective mismatch" not in output, output[-4000:]


@pytest.mark.parametrize("kind", ["event", "worker", "messages", "issue", "check", "barrier", "broadcast"])
def test_ctrl_c_ends_a_rank_waiting_on_a_collective_that_cannot_end(kind, tmp_path):
    """Rank 0 waits on a collective rank 1 never issues (what ctrl-C can leave behind: the signal
    lands while the ranks wait on collectives that will not complete). SIGINT must reach Python
    and end rank 0 with KeyboardInterrupt. Before, ``work.wait()`` and the blocking host
    collectives held the thread in C: the interrupt never ran and the run hung until gloo's
    30-minute timeout (seen in tests/scripts/failing_run.py's ``interrupt`` case). ``worker``: the
    wait inside the CPU worker's job, which a CPU device runs inline; the job's future kept the
    interrupt, the rank went on until rank 1 had ended and broke its next collective, and ended
    with gloo's "connection closed" instead of the interrupt (1 in 7 runs of that case on 2 loaded
    cores)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = Path(__file__).parent / "scripts" / "pending_collective.py"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path), kind]) for r in (0, 1)]
    try:
        deadline = time.time() + 60
        while not (tmp_path / "waiting").exists() and time.time() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        assert (tmp_path / "waiting").exists(), "rank 0 never reached the collective"
        time.sleep(0.5)  # rank 0 is now inside the wait
        procs[0].send_signal(signal.SIGINT)
        try:
            code = procs[0].wait(timeout=20)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 3 and (tmp_path / "interrupted").exists(), f"rank 0 did not end on SIGINT (exit {code})"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _collectives_after_a_failing_backward(rank, world):
    import protrain_core.runtime.sharding as S

    model = tiny_llama(n_layer=2)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pt.Plan(n_persist=2, n_buffer=0),
                     device="cpu")
    failed, issued = [False], []
    for name in ("_issue", "_issue_all", "_blocking"):
        def counted(*args, _name=name, _real=getattr(S, name), **kwargs):
            if failed[0]:
                issued.append(_name)
            return _real(*args, **kwargs)
        setattr(S, name, counted)

    def fail(*_):
        failed[0] = True
        raise ValueError(f"the user's error in backward on rank {rank}")

    model.model.layers[0].register_full_backward_hook(fail)  # a chunk has some of its gradients then
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    try:
        engine.backward(model(input_ids=x, labels=x).loss)
    except ValueError as e:
        return str(e), issued
    return None, issued


def test_a_backward_that_raises_runs_no_collective_on_its_way_out(tmp_path):
    """An error in backward (a hook's, or ctrl-C) leaves without the reductions that end a
    backward: with several processes they are collectives, and on a failure path they meet a
    rank that has left (gloo's "remote worker crashed" then replaced ctrl-C's KeyboardInterrupt
    in the 2-process Lightning run of test_a_failure_on_one_rank_ends_every_process...). Before:
    the reduce-scatters of the chunks still receiving ran in backward's ``finally``."""
    for rank, (message, issued) in enumerate(spawn(_collectives_after_a_failing_backward, 2, tmp_path)):
        assert message == f"the user's error in backward on rank {rank}"
        assert issued == [], issued
