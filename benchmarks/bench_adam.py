"""CPU Adam throughput (parameters/s): protrain_ops.adam_step on one chunk vs torch.optim.AdamW,
and the CPU worker's whole update pipeline of a streamed chunk (landing, clipping, Adam, the
copy back to the compute dtype) against torch.optim.AdamW(fused=True) alone on the same
parameters: time and bytes per parameter; and that update with moments in each format
(fp32, bf16, 8-bit) per thread count, alone and while a copy load of the chunk's PCIe bytes
runs both ways: parameters/s, bytes and page-locked bytes per parameter.

    python -m benchmarks.bench_adam [--numel 16777216 --tensors 16 --iters 20] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.run import cpu_model
from protrain_ops import AdamHyperParams, adam_step, copy_to_low_precision


def bench(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(numel: int = 16 * 2**20, tensors: int = 16, iters: int = 20) -> list[dict]:
    """Rows of {kernel, seconds, params_per_s}: one chunk of ``numel`` fp32 parameters in
    ``tensors`` tensors, on the host's threads (``torch.get_num_threads()``)."""
    per = numel // tensors
    n = per * tensors
    flat = {k: torch.randn(n) if k in ("p", "g") else torch.zeros(n) for k in ("p", "g", "m", "v")}
    views = {k: list(t.split(per)) for k, t in flat.items()}
    steps = [torch.zeros(()) for _ in range(tensors)]
    hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    lowp = torch.empty(n, dtype=torch.bfloat16)

    rows = [("protrain_ops.adam_step (fused kernel, chunk views)",
             bench(lambda: adam_step(views["p"], views["g"], views["m"], views["v"], [], steps, hp), iters)),
            ("protrain_ops.adam_step + bf16 copy-back",
             bench(lambda: (adam_step(views["p"], views["g"], views["m"], views["v"], [], steps, hp),
                            copy_to_low_precision(lowp, flat["p"])), iters))]
    for label, kw in (("torch.optim.AdamW(fused=True)", dict(fused=True)),
                      ("torch.optim.AdamW(foreach=True)", dict(foreach=True)),
                      ("torch.optim.AdamW(default)", dict())):
        params = [torch.nn.Parameter(t.clone()) for t in views["p"]]
        for p, g in zip(params, views["g"]):
            p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw)
        rows.append((label, bench(opt.step, iters)))
    return [{"kernel": label, "numel": n, "seconds": t, "params_per_s": n / t} for label, t in rows]


# The update pipelines of a streamed chunk the CPU worker runs, and the bytes per parameter each
# operation reads and writes. Separate passes: Adam (fused AdamW: fp32 master, gradient, m, v
# read; master, m, v written) 28; in mixed precision the gradient landed in the compute-dtype copy
# is folded into the fp32 accumulator (2 + 4) and the master rounded back into that copy (4 + 2);
# norm clipping multiplies the gradients by the coefficient first (4 + 4). The one-pass kernel
# (protrain_ops/onepass.py, mixed precision): the landed gradient in, fp32 gradient out (it stays
# until zero_grad), master, m, v read and written, the copy out -- 32, clipped or not.
# fp16 cannot update as the gradient lands (every chunk's overflow check comes first): the landing
# is folded, unscaled (4 + 4) and the copy restored (4 + 2) at once, and the update follows; the
# norms read the gradients once more (4). One pass: the landing, unscale and restore in one (12),
# then the update from the accumulator (30, 34 when clipping writes the gradient back).
PIPELINES = {"fp32": ("32-true", False), "fp32, norm clipping": ("32-true", True),
             "bf16-mixed": ("bf16-mixed", False), "bf16-mixed, norm clipping": ("bf16-mixed", True),
             "16-mixed": ("16-mixed", False), "16-mixed, norm clipping": ("16-mixed", True)}
ADAM_BYTES, FOLD_BYTES, COPY_BACK_BYTES, CLIP_BYTES, ONE_PASS_BYTES = 28, 6, 6, 8, 32
UNSCALE_BYTES, NORM_BYTES, LAND_BYTES, FROM_ACC_BYTES, CLIPPED_BACK_BYTES = 8, 4, 12, 30, 4


def pipeline_bytes(precision: str, clip: bool, *, one_pass: bool = False) -> int:
    mixed = precision != "32-true"
    if precision == "16-mixed":
        norms = NORM_BYTES if clip else 0
        if one_pass:
            return LAND_BYTES + norms + FROM_ACC_BYTES + (CLIPPED_BACK_BYTES if clip else 0)
        return FOLD_BYTES + UNSCALE_BYTES + COPY_BACK_BYTES + norms + ADAM_BYTES + COPY_BACK_BYTES + (CLIP_BYTES if clip else 0)
    if one_pass and mixed:
        return ONE_PASS_BYTES
    return ADAM_BYTES + (FOLD_BYTES + COPY_BACK_BYTES if mixed else 0) + (CLIP_BYTES if clip else 0)


def streamed_chunk(precision: str, hidden: int, state_format: str = "fp32"):
    """A LLaMA-shaped two-block model wrapped all-streamed on the CPU (moments in
    ``state_format``); its largest streamed chunk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import protrain_core as pt

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=256, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    engine = pt.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01), pt.Plan(n_persist=0, n_buffer=2),
                     precision=precision, device="cpu", report=None,
                     config=pt.ProTrainConfig(optimizer_state_format=state_format))
    chunk = max(engine.chunks, key=lambda c: c.storage.fmt.state_numel)
    return engine, chunk


def pipeline(hidden: int = 1024, iters: int = 20) -> list[dict]:
    """Rows of {pipeline, numel, seconds, ns_per_param, bytes_per_param, ratio}: the worker's
    ``land_and_update`` of one streamed chunk (landed, then updated) -- in mixed precision with
    the separate passes and with the one-pass kernel --, and AdamW(fused=True) alone on fp32
    copies of the same parameters in the same run (``ratio``: the pipeline's time over it)."""
    from protrain_ops import onepass

    rows = []
    for name, (precision, clip) in PIPELINES.items():
        engine, chunk = streamed_chunk(precision, hidden)
        members = [i for group in chunk.opt_members.values() for i in group]
        numel = sum(chunk.params[i].numel() for i in members)
        baseline = _fused_adamw(chunk, members, iters)
        ways = [("separate passes", True)] + ([("one pass", False)] if chunk.storage.fmt.separate_master else [])
        for way, off in ways:
            with onepass.turned_off() if off else contextlib.nullcontext():
                seconds, after = _land_and_update(engine, chunk, clip, iters)
            rows.append({"pipeline": name, "way": way, "numel": numel, "members": len(members), "seconds": seconds,
                         "ns_per_param": seconds / numel * 1e9, "fused_adamw_ns_per_param": baseline / numel * 1e9,
                         "bytes_per_param": pipeline_bytes(precision, clip, one_pass=not off),
                         "ratio": seconds / baseline, "after_backward_ratio": after and after / baseline})
        engine.close()
    return rows


def _fused_adamw(chunk, members: list[int], iters: int) -> float:
    """Median seconds of AdamW(fused=True) on fp32 copies of the members, a fresh gradient
    written before each step (outside the timed region) as for the pipelines."""
    params = [torch.nn.Parameter(torch.randn(chunk.params[i].shape)) for i in members]
    for p in params:
        p.grad = torch.empty_like(p)
    step = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True).step
    times = []
    for _ in range(iters + 1):  # the first one warms up
        for p in params:
            p.grad.normal_(std=1e-3)
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _land_and_update(engine, chunk, clip: bool, iters: int, *, warm: bool = True) -> float:
    """Median seconds of the worker landing a full chunk's gradient and updating it (after one
    untimed warm-up when ``warm``); a fresh gradient is written where it lands before each
    (outside the timed region). fp16: the landing with the step's finishing (unscale and check,
    the norms when clipping), then the update, as the step after backward runs it."""
    from protrain_core.runtime.gradients import Finishing
    from protrain_core.runtime.optim import ChunkOptimizer, UpdateClip

    storage, worker = chunk.storage, engine.scheduler.worker
    update = (ChunkOptimizer(engine.optimizer).snapshot(), {g: list(m) for g, m in chunk.opt_members.items()},
              UpdateClip(coef=torch.tensor(0.5)) if clip else UpdateClip())
    members = [i for group in chunk.opt_members.values() for i in group]
    times, after = [], []
    for _ in range(iters + int(warm)):
        landing = storage.compute_span() if storage.fmt.separate_master else storage.grad_acc
        landing.normal_(std=1e-3)
        t = time.perf_counter()
        if engine.scaler is None:
            worker.land_and_update(chunk, None, landing, True, None, update)
        else:
            finish = Finishing(chunk, members, engine.scaler.inv_scale(), 2.0 if clip else None, {})
            worker.land_and_update(chunk, None, landing, True, finish, None)
            landed = time.perf_counter()
            worker.update(chunk, *update)
            after.append(time.perf_counter() - landed)
        times.append(time.perf_counter() - t)
    skip = int(warm)
    return statistics.median(times[skip:]), statistics.median(after[skip:]) if after else None


# Host bytes per parameter of a bf16-mixed streamed chunk's whole update by the moments' format,
# one pass each: the landed bf16 gradient in (2), the fp32 gradient out (4), the fp32 master read
# and written (8), both moments read and written (fp32 16, bf16 8, 8-bit 4 and their block
# scales, 1/32), the bf16 copy out (2). What a step moves over PCIe per parameter: the copy up
# and the gradient down (2 + 2).
FORMAT_BYTES = {"fp32": 32, "bf16": 24, "8bit": 20}
PCIE_BYTES = 4


class CopyLoad:
    """A thread copying the chunk's PCIe bytes both ways, over and over, while it runs: on a GPU
    real host->device and device->host copies from page-locked memory on two streams at once;
    on the CPU a memcpy of the same bytes (the DRAM traffic the copy engines would add), on one
    intra-op thread. ``bytes_per_s`` once stopped."""

    def __init__(self, numel: int, device: str = "cpu") -> None:
        import threading

        cuda = device != "cpu"
        host = lambda: torch.empty(numel, dtype=torch.bfloat16, pin_memory=cuda)  # noqa: E731
        dev = lambda: torch.empty(numel, dtype=torch.bfloat16, device=device)  # noqa: E731
        self._pairs = ((host(), dev()), (dev(), host()))  # (source, destination): up, then down
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        self._stop, self.copied, self.seconds = threading.Event(), 0, 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(1)
        t = time.perf_counter()
        while True:  # (at least one round: a copy rate however short the work beside it)
            for (src, dst), stream in zip(self._pairs, self._streams):
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    dst.copy_(src, non_blocking=stream is not None)
            for stream in self._streams:
                if stream is not None:
                    stream.synchronize()
            self.copied += 2 * self._pairs[0][0].nbytes
            if self._stop.is_set():
                break
        self.seconds = time.perf_counter() - t

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def bytes_per_s(self) -> float:
        return self.copied / max(self.seconds, 1e-9)


def format_rows(hidden: int = 1024, iters: int = 10, threads: tuple[int, ...] | None = None,
                copies: str = "cpu") -> list[dict]:
    """Rows of {format, threads, load, numel, seconds, params_per_s, bytes_per_param,
    pinned_bytes_per_param, copy_bytes_per_s}: the worker's landing and update of one bf16-mixed
    streamed chunk with moments in each format, on each thread count, alone and beside a
    ``CopyLoad`` of the chunk's PCIe bytes (``copies``: "cpu", or a CUDA device for real
    copies) -- all in one run, the formats taking turns update by update (a neighbour's load on
    a shared machine falls on all of them alike)."""
    # On a GPU the engine's worker leaves one core to the thread that drives the device ([Note: CPU
    # worker placement]); here that thread is the copy load's, which waits in its synchronize. With
    # the worker on all 16 cores beside it the update ran 13x slower than alone on the lent H200
    # (216 against 2,923 M parameters/s; one thread: 566 against 678), most likely its intra-op
    # threads waiting for the one that shares a core with the copies.
    most = torch.get_num_threads() - (copies != "cpu" and torch.get_num_threads() > 1)
    threads = threads or tuple(sorted({1, most}))
    own, rows = torch.get_num_threads(), []
    built = {fmt: streamed_chunk("bf16-mixed", hidden, fmt) for fmt in FORMAT_BYTES}
    numel = built["fp32"][1].storage.fmt.state_numel
    try:
        for n in threads:
            torch.set_num_threads(n)
            for load in (False, True):
                times = {fmt: [] for fmt in built}
                with CopyLoad(numel, copies) if load else contextlib.nullcontext() as running:
                    for _ in range(iters + 1):  # the first round warms up
                        for fmt, (engine, chunk) in built.items():
                            times[fmt].append(_land_and_update(engine, chunk, False, 1, warm=False)[0])
                for fmt, (_, chunk) in built.items():
                    seconds, own_numel = statistics.median(times[fmt][1:]), chunk.storage.fmt.state_numel
                    rows.append({"format": fmt, "threads": n, "load": load, "numel": own_numel, "seconds": seconds,
                                 "params_per_s": own_numel / seconds, "bytes_per_param": FORMAT_BYTES[fmt],
                                 "pinned_bytes_per_param": chunk.storage.fmt.streamed_pinned_bytes / own_numel,
                                 "copies": copies, "copy_bytes_per_s": running.bytes_per_s if load else 0.0})
    finally:
        torch.set_num_threads(own)
        for engine, _ in built.values():
            engine.close()
    return sorted(rows, key=lambda r: list(FORMAT_BYTES).index(r["format"]))


def format_markdown(rows: list[dict], iters: int) -> str:
    fp32 = {(r["threads"], r["load"]): r["params_per_s"] for r in rows if r["format"] == "fp32"}
    how = "a memcpy on the CPU" if rows[0]["copies"] == "cpu" else f"host<->{rows[0]['copies']} copies, both at once"
    lines = [f"one bf16-mixed streamed chunk of {rows[0]['numel']:,} trainable parameters, landed and updated by the "
             f"CPU worker; median of {iters}; copy load: another thread copying the chunk's {PCIE_BYTES} PCIe bytes per "
             f"parameter both ways meanwhile ({how})", "",
             "| moments | threads | copy load | M params/s | vs fp32 | host bytes/param moved | page-locked bytes/param "
             "| copies GB/s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['threads']} | {'both ways' if r['load'] else 'none'} | {r['params_per_s'] / 1e6:.1f} "
              f"| {r['params_per_s'] / fp32[r['threads'], r['load']]:.2f}x | {r['bytes_per_param']} "
              f"| {r['pinned_bytes_per_param']:.2f} | {r['copy_bytes_per_s'] / 1e9:.2f} |" for r in rows]
    return "\n".join(lines)


def pipeline_markdown(rows: list[dict], iters: int) -> str:
    lines = [f"one streamed chunk of {rows[0]['numel']:,} parameters in {rows[0]['members']} tensors; median of {iters} "
             "updates; AdamW(fused=True) alone: on fp32 copies of the same parameters, 28 bytes per parameter; "
             "16-mixed: the update after backward alone in the last column (the landing runs during backward)", "",
             "| pipeline | way | bytes/param | ns/param | AdamW(fused) ns/param | ratio | after backward |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pipeline']} | {r['way']} | {r['bytes_per_param']} | {r['ns_per_param']:.2f} "
              f"| {r['fused_adamw_ns_per_param']:.2f} | {r['ratio']:.2f}x "
              f"| {'' if r['after_backward_ratio'] is None else format(r['after_backward_ratio'], '.2f') + 'x'} |"
              for r in rows]
    return "\n".join(lines)


def kernel_build() -> str:
    """The instruction sets the one-pass kernel is built for here: ATen's CPU capability, and
    whether the 8-bit moments' byte permutes (AVX-512 VBMI) are in."""
    from protrain_ops.onepass import build_target

    capability, vbmi = build_target()
    return f"{capability}{' + VBMI' if vbmi else ''}"


def markdown(rows: list[dict], iters: int) -> str:
    lines = [f"machine: {platform.node()} {cpu_model()}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
             f"kernel built for {kernel_build()}",
             f"chunk: {rows[0]['numel']:,} fp32 parameters; median of {iters} steps", "",
             "| kernel | median s/step | G params/s |", "|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['seconds']:.4f} | {r['params_per_s'] / 1e9:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="parameters in the chunk")
    ap.add_argument("--tensors", type=int, default=16, help="parameters per chunk")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the pipeline's LLaMA blocks")
    ap.add_argument("--copies", default="cpu", help="where the copy load copies to: cpu (a memcpy) or cuda")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    rows = measure(args.numel, args.tensors, args.iters)
    print("\n" + markdown(rows, args.iters))
    pipelines = pipeline(args.hidden, args.iters)
    print("\n" + pipeline_markdown(pipelines, args.iters))
    formats = format_rows(args.hidden, args.iters, copies=args.copies)
    print("\n" + format_markdown(formats, args.iters))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "kernel_build": kernel_build(),
                                               "cpu": cpu_model(), "rows": rows, "pipelines": pipelines,
                                               "formats": formats}, indent=1))


if __name__ == "__main__":
    main()
