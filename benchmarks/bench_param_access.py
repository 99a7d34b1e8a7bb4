"""What ``ManagedParameter`` costs: its ``__torch_function__`` runs for every torch function given a
parameter of a chunk while the engine is open ([Note: parameters used outside their units] in
protrain_core/runtime/hooks.py). Prints, side by side in one run:

- per call, a plain ``nn.Parameter`` against a managed one of a persistent chunk (the path of
  every weight use inside a unit), for ``F.linear`` and a ``.grad`` read (best of ``--rounds``);
- per training step of a LLaMA of ``--layers`` blocks (tiny widths), how many calls the engine
  sees on an all-persistent plan and on a streamed plan with every block checkpointed
  (recomputation calls the blocks' weights again): counts, not times.

    python -m benchmarks.bench_param_access [--layers 22 --rounds 7 --calls 20000]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F

import protrain_core as pt
from protrain_core.runtime import hooks


def per_call(fn, calls: int, rounds: int) -> float:
    """Best of ``rounds`` of ``calls`` calls: seconds a call."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def call_costs(calls: int, rounds: int) -> list[tuple[str, float, float]]:
    """(what, plain s, managed s) per call; the managed weight is a persistent chunk's."""
    lin = torch.nn.Linear(64, 64)
    plain, x = torch.nn.Parameter(lin.weight.detach().clone()), torch.randn(8, 64)
    engine = pt.wrap(lin, torch.optim.AdamW(lin.parameters()), pt.Plan(n_persist=1, n_buffer=0), device="cpu",
                     example_inputs=x)
    managed = lin.weight
    assert type(managed) is pt.ManagedParameter
    rows = [("F.linear(x, w), x 8 x 64", per_call(lambda: F.linear(x, plain), calls, rounds),
             per_call(lambda: F.linear(x, managed), calls, rounds)),
            ("w.grad", per_call(lambda: plain.grad, calls, rounds), per_call(lambda: managed.grad, calls, rounds))]
    engine.close()
    return rows


def calls_per_step(layers: int) -> dict[str, collections.Counter]:
    """Plan -> the torch functions ManagedParameter saw in the third training step, by name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    seen: collections.Counter = collections.Counter()
    original = hooks.ManagedParameter.__dict__["__torch_function__"]

    def counting(cls, func, types, args=(), kwargs=None):
        seen[getattr(func, "__name__", str(func))] += 1
        return original.__func__(cls, func, types, args, kwargs)

    out = {}
    hooks.ManagedParameter.__torch_function__ = classmethod(counting)
    try:
        for name in ("all-persistent", "streamed, every block checkpointed"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                                 max_position_embeddings=64))
            path, blocks = pt.find_blocks(model)
            n = pt.build_layout(model, path, len(blocks)).n_chunks
            plan = (pt.Plan(n_persist=n, n_buffer=0) if name == "all-persistent"
                    else pt.Plan(n_persist=0, n_buffer=2, n_checkpoint=layers))
            engine = pt.wrap(model, torch.optim.AdamW(model.parameters()), plan, device="cpu")
            x = torch.randint(0, 96, (2, 16))
            for _ in range(3):
                seen.clear()
                engine.backward(engine.module(input_ids=x, labels=x).loss)
                engine.step()
                engine.zero_grad()
            out[name] = collections.Counter(seen)
            engine.close()
    finally:
        hooks.ManagedParameter.__torch_function__ = original
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    costs = call_costs(args.calls, args.rounds)
    print(f"machine: torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.rounds} x "
          f"{args.calls} calls\n")
    print("| call | plain nn.Parameter | ManagedParameter (persistent chunk) | added |")
    print("|---|---|---|---|")
    for what, plain, managed in costs:
        print(f"| {what} | {plain * 1e6:.2f} us | {managed * 1e6:.2f} us | {(managed - plain) * 1e6:+.2f} us |")
    counts = calls_per_step(args.layers)
    print(f"\nCalls ManagedParameter sees per training step (tiny LLaMA, {args.layers} blocks; counted):\n")
    print("| plan | calls | by function |")
    print("|---|---|---|")
    for name, seen in counts.items():
        print(f"| {name} | {sum(seen.values())} | {', '.join(f'{k} {v}' for k, v in seen.most_common())} |")
    return costs, counts


if __name__ == "__main__":
    main()
