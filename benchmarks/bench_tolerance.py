"""How far one-ulp differences carry through training: the measurement behind the weight
tolerance of the CUDA tests that compare against a reference computed by other kernels
(``COMPARED_ACROSS_KERNELS_EPS`` in tests/conftest.py).

    python -m benchmarks.bench_tolerance [--steps 10] [--eps 1e-8 1e-6 1e-5 1e-4]

Two runs of plain ``AdamW(fused=True)`` on the CPU per model and Adam eps, on the tests' tiny
GPT-2 and LLaMA and data: one from the initial weights, one from every initial weight moved by
one ulp (what a different kernel's rounding does). It prints the largest relative loss difference
and the worst weight difference as a multiple of the tests' tolerance (rtol 1e-5, atol 1e-6), and
the tensor it is in. Seconds on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

RTOL, ATOL = 1e-5, 1e-6


def measure(make_model, data, train_reference, *, eps: float) -> tuple[float, float, str]:
    torch.manual_seed(0)
    model = make_model()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, 1.0)))
    la = train_reference(a, torch.optim.AdamW(a.parameters(), lr=3e-3, eps=eps, fused=True), data)
    lb = train_reference(b, torch.optim.AdamW(b.parameters(), lr=3e-3, eps=eps, fused=True), data)
    loss = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
    sb = b.state_dict()
    worst, where = 0.0, ""
    for k, v in a.state_dict().items():
        ratio = ((v - sb[k]).abs() / (ATOL + RTOL * v.abs())).max().item()
        if ratio > worst:
            worst, where = ratio, k
    return loss, worst, where


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eps", type=float, nargs="+", default=[1e-8, 1e-6, 1e-5, 1e-4])
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import batches, tiny_gpt2, tiny_llama, train_reference

    print(f"| model | Adam eps | loss: largest relative difference | worst weight difference / (atol {ATOL:g} + "
          f"rtol {RTOL:g} x abs) | in |")
    print("|---|---|---|---|---|")
    for name, make in (("gpt2", tiny_gpt2), ("llama", tiny_llama)):
        for eps in args.eps:
            loss, worst, where = measure(make, batches(args.steps), train_reference, eps=eps)
            print(f"| {name} | {eps:g} | {loss:.2g} | {worst:.3g}x | `{where}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
