"""Host<->device copy bandwidth with ProTrain's pinned host pool, against PyTorch's pinned
allocator and pageable memory.

    python -m benchmarks.bench_transfer [--mib 256 --iters 10 --device cuda]

Per host-memory kind and direction: the median of ``iters`` copies of one ``--mib`` buffer (a
chunk-sized copy; non_blocking on a side stream, timed with a device synchronisation), and
both directions at once (ProTrain uploads the next chunk while it offloads gradients). The
pool is ``protrain_core.runtime.host_pool.HostPool``: one exact-size host buffer page-locked in
place (cudaHostRegister). On a CPU device every copy is a host memcpy (nothing is pinned): the
figures then only check the script. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from protrain_core.runtime.host_pool import HostPool


def host_buffers(nbytes: int, cuda: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The host memory kinds, each two uint8 buffers of ``nbytes`` of that kind (the second for
    the opposite direction of "both at once")."""
    pool = HostPool([(nbytes, torch.uint8, True), (nbytes, torch.uint8, True)], pin=cuda)
    buffers = {"ProTrain host pool (registered)" if cuda else "host (pageable)":
               (pool.take(nbytes, torch.uint8), pool.take(nbytes, torch.uint8))}
    if cuda:
        buffers["torch pin_memory allocator"] = tuple(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                                                      for _ in range(2))
        buffers["pageable"] = tuple(torch.empty(nbytes, dtype=torch.uint8) for _ in range(2))
    return buffers


def timed(fn, iters: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(device: torch.device, mib: int = 256, iters: int = 10) -> list[dict]:
    """Rows of {memory, direction, seconds, GB/s} for copies of ``mib`` MiB."""
    cuda = device.type == "cuda"
    nbytes = mib * 2**20
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    up_stream = torch.cuda.Stream(device) if cuda else None
    down_stream = torch.cuda.Stream(device) if cuda else None
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for name, (host, other) in host_buffers(nbytes, cuda).items():

        def on(stream, dst, src):
            if stream is None:
                dst.copy_(src)
            else:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)

        cases = {"host->device": lambda: on(up_stream, dev_a, host),
                 "device->host": lambda: on(down_stream, host, dev_a),
                 "both at once": lambda: (on(up_stream, dev_a, host), on(down_stream, other, dev_b))}
        for direction, fn in cases.items():
            t = timed(fn, iters, sync)
            moved = nbytes * (2 if direction == "both at once" else 1)
            rows.append({"memory": name, "direction": direction, "bytes": moved, "seconds": t,
                         "gb_per_s": moved / t / 1e9})
    return rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def markdown(rows: list[dict], device: str, mib: int) -> str:
    lines = [f"{mib} MiB per copy, device {device}",
             "", "| host memory | direction | median | GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['memory']} | {r['direction']} | {r['seconds'] * 1e3:.2f} ms | {r['gb_per_s']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = measure(device, args.mib, args.iters)
    print(markdown(rows, device_name(device), args.mib))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name(device), "mib": args.mib, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
