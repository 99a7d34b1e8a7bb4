"""Helpers of the multi-process tests (tests/test_distributed.py): run a function in ``world``
processes joined by a gloo process group, on the CPU, and compare with DDP."""

from __future__ import annotations

import copy
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import protrain_core as pt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, out_dir: str, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PROTRAIN_CACHE_DIR=os.path.join(out_dir, "cache"))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown (the result is all a test reads): once, in a full
    # run of the suite, a rank aborted with "terminate called without an active exception"
    # (SIGABRT) and no Python error, which points at C++ threads destroyed at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, out_dir, *args, backend: str = "gloo", timeout: float = 300) -> list:
    """``fn(rank, world, *args)`` in ``world`` processes joined by ``backend`` (NCCL: one GPU each,
    ``cuda:rank``); their results, by rank. Without CUDA the processes are forked: a fresh
    interpreter importing torch, transformers and the test modules took 1.5-2 s of a test's 3.
    (With CUDA they are spawned: autograd's device threads, started by any earlier backward in
    this process, make a forked rank's backward refuse to run.) A rank starts with one intra-op
    thread (``_entry``): OpenMP's pool of the parent does not exist in a forked child. Ranks still
    running after ``timeout`` seconds are killed and the test fails."""
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    start = "spawn" if backend == "nccl" or torch.cuda.is_available() else "fork"
    context = mp.start_processes(_entry, args=(world, free_port(), fn, args, out_dir, backend), nprocs=world,
                                 start_method=start, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(max(0.0, deadline - time.monotonic())):  # (False while a rank runs)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout} s")
    except BaseException as e:
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join()
        if not isinstance(e, Exception):  # (an interrupt of the test run itself)
            raise
        files = sorted(os.listdir(out_dir))
        errors = [open(os.path.join(out_dir, f)).read() for f in files if f.endswith(".err")]
        raise AssertionError(f"a rank failed ({e}; files written: {files}):\n" + "\n".join(errors)) from e
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def ddp_reference(model, data, *, lr=1e-2, accumulate=1, clip=None, weight_decay=0.0, device="cpu",
                  find_unused_parameters=False, optimizer=None, optimizer_state: dict | None = None):
    """Lightning's ``ddp`` in plain torch: DDP, AdamW(fused) (or ``optimizer(params)``),
    ``no_sync`` for the non-final micro-batches; per-step losses and the final state dict (and
    the optimizer's into ``optimizer_state``, when given)."""
    model = copy.deepcopy(model).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused_parameters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (optimizer(trainable) if optimizer is not None
           else torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=True))
    losses = []
    for i in range(0, len(data), accumulate):
        micro = data[i:i + accumulate]
        for j, x in enumerate(micro):
            sync = j == len(micro) - 1
            with (ddp.no_sync() if not sync else _null()):
                loss = ddp(input_ids=x, labels=x).loss / len(micro)
                loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
        opt.zero_grad()
    if optimizer_state is not None:
        optimizer_state.update(opt.state_dict())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def protrain_run(model, data, plan, *, lr=1e-2, accumulate=1, clip=None, weight_decay=0.0, precision="32-true",
                 device="cpu", optimizer=None, **config):
    """``ddp_reference``'s loop with ProTrain (``config``: more ``ProTrainConfig`` fields)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(trainable) if optimizer is not None else torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    engine = pt.wrap(model, opt, plan, precision=precision, device=device,
                     config=pt.ProTrainConfig(clipping=None if clip is None else ("norm", clip),
                                              runtime=pt.RuntimeConfig(check_invariants=True), **config))
    losses = []
    for i in range(0, len(data), accumulate):
        micro = data[i:i + accumulate]
        for j, x in enumerate(micro):
            with (engine.no_sync() if j < len(micro) - 1 else _null()):
                loss = engine.module(input_ids=x, labels=x).loss / len(micro)
                engine.backward(loss)
            losses.append(loss.item())
        engine.step()
        engine.zero_grad()
    return losses, engine


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False



def ddp_reduce(grad) -> None:
    """DDP's reduction of one gradient, in its dtype: times 1/W, summed over the ranks."""
    dist.all_reduce(grad.mul_(1.0 / dist.get_world_size()))
