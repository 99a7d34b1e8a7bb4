"""The CPU update of a mixed-precision chunk in one pass over its states (csrc/adam_onepass.cpp).

In bf16-mixed and 16-mixed a streamed chunk's gradient lands in the low-precision span of its
host compute copy. The separate passes fold it into the fp32 accumulator, clip it, run
``torch._fused_adamw_`` and round the master back into the span: 40 bytes per parameter (48
with clipping) where one pass needs 32 (the gradient in, the fp32 gradient out -- it stays until
``zero_grad``, as ``p.grad`` does --, fp32 master, m and v read and written, the copy out).
``update`` does it in one pass with results equal bit for bit to the separate passes ([Note:
one-pass arithmetic] in the C++ file).

Where the update cannot follow the landing at once (fp16: every chunk's overflow check comes
first; a norm to clip by; accumulation), ``land`` folds the landing into the accumulator,
unscales and checks it (fp16, the step's last landing) and restores the compute copy from the
master in one pass (12 bytes per parameter against the 20 of fold, unscale and copy), and the
update reads the gradient from the accumulator.

The kernel is compiled on first use (``torch.utils.cpp_extension``: a C++ compiler, about 10 s,
cached per machine) and checked against torch's own kernel before it is used (``verify``). When
either fails the engine keeps the separate passes and ``status()`` says why.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from protrain_ops.adam import AdamHyperParams, adam_step, clip_gradients, fold_landing

SOURCE = Path(__file__).with_name("csrc") / "adam_onepass.cpp"
# -ffp-contract=off: no fused multiply-add but those the source spells ([Note: one-pass arithmetic]);
# -fopenmp: at::parallel_for runs on torch's OpenMP threads (without it, on one thread).
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# ATen's vector types for the instruction set torch's own kernels were dispatched to here (the
# flags torch builds those kernels with); without one of these, ATen's portable vectors.
CAPABILITY_FLAGS = {
    "AVX512": ("-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"),
    "AVX2": ("-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mbmi2", "-mf16c"),
}

# The 8-bit moments' table lookups as byte permutes ([Note: the nearest code without a gather]),
# where the CPU has them.
VBMI = ("-mavx512vbmi",)


def build_target() -> tuple[str, bool]:
    """What the kernel is built for here: ATen's CPU capability, and whether the 8-bit moments'
    byte permutes (AVX-512 VBMI) are in."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        vbmi = any(line.startswith("flags") and " avx512vbmi " in f"{line} " for line in open("/proc/cpuinfo"))
    except OSError:
        vbmi = False
    return capability, capability == "AVX512" and vbmi


@dataclass
class _Kernel:
    module: object | None = None
    reason: str = "not loaded yet"
    loaded: bool = False
    disabled: int = 0


_kernel = _Kernel()
_lock = threading.Lock()


def kernel():
    """The compiled and verified kernel module, or None (``status()`` says why)."""
    if not _kernel.loaded:
        with _lock:
            if not _kernel.loaded:
                _kernel.module, _kernel.reason = _load()
                _kernel.loaded = True
    return None if _kernel.disabled else _kernel.module


def status() -> str:
    """How mixed-precision chunks are landed and updated on the CPU, for ``engine.summary()``."""
    if _kernel.disabled:
        return "separate passes (one-pass kernel turned off)"
    if not _kernel.loaded:
        return "one-pass kernel when first needed"
    return "one pass (protrain_ops kernel)" if _kernel.module is not None else f"separate passes ({_kernel.reason})"


@contextmanager
def turned_off():
    """Use the separate passes inside (tests and benchmarks compare the two)."""
    _kernel.disabled += 1
    try:
        yield
    finally:
        _kernel.disabled -= 1


def _load():
    if sys.platform != "linux":
        return None, f"the kernel is built on Linux only, not {sys.platform}"
    try:
        from torch.utils.cpp_extension import load
        capability, vbmi = build_target()
        flags = FLAGS + CAPABILITY_FLAGS.get(capability, ()) + (VBMI if vbmi else ())
        digest = hashlib.sha1(SOURCE.read_bytes() + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()[:12]
        name = f"protrain_onepass_{digest}"
        load(name=name, sources=[str(SOURCE)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)  # torch's operators torch.ops.<name>.*
        module = getattr(torch.ops, name)
        library = next(Path(p) for p in torch.ops.loaded_libraries if Path(p).stem == name)
    except Exception as e:  # no compiler, no ninja, a build error: the separate passes stay
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"the kernel did not build: {first[:200]}"
    # Checked once per build of the kernel (and torch) and version of the Python around it (the
    # tails, the separate passes): the stamp beside the library names the sources it checked.
    stamp = library.with_suffix(".verified")
    checked = hashlib.sha1(Path(__file__).read_bytes() + Path(__file__).with_name("adam.py").read_bytes()).hexdigest()
    if not stamp.is_file() or stamp.read_text().strip() != checked:
        mismatch = verify(module)
        if mismatch:
            return None, f"the kernel differs from torch's Adam or landing passes here ({mismatch})"
        part = stamp.with_name(f"{stamp.name}.{os.getpid()}")
        part.write_text(checked + "\n")
        part.replace(stamp)
    return module, ""


# ----- the update --------------------------------------------------------------------------
def update(module, masters: list[Tensor], lows: list[Tensor], accs: list[Tensor], exp_avgs: list[Tensor],
           exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor], hp: AdamHyperParams, *,
           coef: Tensor | None, clamp: float | None, landed: bool, accumulate: bool) -> None:
    """One Adam step of members given by per-member views (fp32 ``masters``, ``accs``; fp32
    moments, or bf16 ones without amsgrad; bf16 or fp16 ``lows`` of the compute copy; 0-D
    ``steps``), as the separate passes would run it:

    - ``landed``: the gradient is in ``lows``; it is copied into ``accs`` (added to it when
      ``accumulate``) first; otherwise it is in ``accs`` already.
    - clipping: ``accs *= coef``, then clamped to ``[-clamp, clamp]``.
    - Adam on ``masters`` with ``accs`` as gradients, then ``lows`` = the masters rounded."""
    write_acc = landed or coef is not None or clamp is not None
    lanes = module.lanes()  # torch's kernel runs whole vectors (8 or 16 floats) and the rest in a scalar
    # loop whose roundings are its compiler's: a multiple of its width leaves torch exactly that rest
    lengths = [t.numel() - t.numel() % lanes for t in masters]
    tails = [k for k, (t, n) in enumerate(zip(masters, lengths)) if n < t.numel()]
    if tails:  # (their steps are incremented there)
        def tail(ts):
            return [ts[k].view(-1)[lengths[k]:] for k in tails]

        separate_passes(tail(masters), tail(lows), tail(accs), tail(exp_avgs), tail(exp_avg_sqs),
                        tail(max_exp_avg_sqs) if hp.amsgrad else [], [steps[k] for k in tails], hp, coef=coef,
                        clamp=clamp, landed=landed, accumulate=accumulate)
    rest = [s for k, s in enumerate(steps) if k not in tails]
    if rest:
        torch._foreach_add_(rest, 1)
    module.adam_onepass(masters, lows, accs, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if hp.amsgrad else [], lengths,
                        [float(s) for s in steps], hp.lr, hp.beta1, hp.beta2, hp.weight_decay, hp.eps,
                        hp.decoupled_weight_decay, hp.amsgrad, hp.maximize,
                        None if coef is None else float(coef), clamp, landed, accumulate, write_acc)


def adam8bit(module, params: list[Tensor], lows: list[Tensor], accs: list[Tensor], states1: list[Tensor],
             states2: list[Tensor], absmax1: list[Tensor], absmax2: list[Tensor], qmap1: Tensor, qmap2: Tensor,
             steps: list[int], hp: AdamHyperParams, *, coef: Tensor | None = None, clamp: float | None = None,
             landed: bool = False, accumulate: bool = False) -> None:
    """bitsandbytes' block-wise 8-bit AdamW step (``optimizer_update_8bit_blockwise("adam", ...)``)
    of each member's piece in one pass ([Note: 8-bit moments in one pass] in the C++ file): fp32
    ``params``, uint8 ``states`` with one fp32 scale per block of 256 in ``absmax``, the signed
    and unsigned maps, each member's step count after this step. The gradient is in ``accs``
    (fp32), or, with ``landed``, in ``lows`` as ``update`` takes it (added to ``accs`` when
    ``accumulate``); clipped by ``coef`` and ``clamp`` first; ``lows`` (the compute copy's span;
    empty: none) end as the stepped params rounded."""
    module.adam8bit(params, lows, accs, states1, states2, absmax1, absmax2, qmap1, qmap2, [float(s) for s in steps],
                    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, None if coef is None else float(coef), clamp,
                    landed, accumulate)


def separate_passes(masters, lows, accs, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hp, *, coef, clamp, landed,
                    accumulate) -> None:
    """What ``update`` must equal: the passes the worker runs without the kernel."""
    if landed:
        fold_landing(accs, lows, accumulate=accumulate)
    clip_gradients(accs, coef, clamp)
    adam_step(masters, accs, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, hp)
    torch._foreach_copy_(lows, masters)


def land(module, masters: list[Tensor], lows: list[Tensor], accs: list[Tensor], *, accumulate: bool,
         inv_scale: Tensor | None = None, found: Tensor | None = None) -> None:
    """Pieces of a chunk's span (fp32 ``masters`` and ``accs``, the compute copy's ``lows``
    where the gradient landed), as ``separate_landing`` leaves them: the landing into ``accs``
    (added when ``accumulate``); with ``inv_scale`` (a one-element fp32 tensor) unscaled, and
    ``found`` (one element) set to 1 where a folded value is inf/nan; ``lows`` from ``masters``."""
    scale = None if inv_scale is None else float(inv_scale)
    if module.land(masters, lows, accs, accumulate, scale):
        found.fill_(1.0)


def separate_landing(masters, lows, accs, *, accumulate, inv_scale=None, found=None) -> None:
    """What ``land`` must equal: the landing folded, ``GradScaler.unscale_``'s call, the copy."""
    fold_landing(accs, lows, accumulate=accumulate)
    if inv_scale is not None and accs:
        torch._amp_foreach_non_finite_check_and_unscale_(accs, found, inv_scale)
    torch._foreach_copy_(lows, masters)


# ----- the check against torch ----------------------------------------------------------------
def verify(module) -> str:
    """Run ``update`` and ``separate_passes`` on the same random members for every kind of step
    below (with fp32 and bf16 moments; ``_compare`` varies the rest), and ``land`` and
    ``separate_landing`` for every kind of landing; '' when every result is equal bit for bit,
    else the first difference."""
    gen = torch.Generator().manual_seed(0)
    lanes = module.lanes()  # members as the engine gives them: views shaped as their parameters
    shapes = ((lanes * 40 + 5,), (3, lanes), (7,), (5, 2 * lanes - 1), (9, lanes * 11 + 1))
    kinds = [(decoupled, weight_decay, landed, accumulate, coef, clamp)
             for decoupled, weight_decay in ((True, 0.1), (False, 0.1), (True, 0.0))
             for landed, accumulate in ((True, False), (True, True), (False, False))
             for coef, clamp in ((None, None), (0.37, None), (None, 3e-3))]
    updates = (_compare(module, i, kind, moments, shapes, gen)
               for moments in (torch.float32, torch.bfloat16) for i, kind in enumerate(kinds))
    landings = (_compare_landing(module, low, accumulate, unscale, bad, shapes, gen)
                for low in (torch.bfloat16, torch.float16) for accumulate in (False, True)
                for unscale, bad in ((False, None), (True, None), (True, float("inf")), (True, float("nan"))))
    return next((difference for difference in itertools.chain(updates, landings) if difference), "")


def _random(shape, gen, scale, dtype=torch.float32, positive=False) -> Tensor:
    t = torch.rand(shape, generator=gen) if positive else torch.randn(shape, generator=gen)
    return (t * scale).to(dtype)


def _differs(ours: list[dict], theirs: list[dict], shapes) -> str:
    """The first state that differs in a bit (NaNs and signed zeros included), or ''."""
    for a, b, shape in zip(ours, theirs, shapes):
        for key in a:
            x, y = a[key], b[key]
            bits = {4: torch.int32, 2: torch.int16}.get(x.element_size())
            if x.dtype != y.dtype or not torch.equal(x.view(bits) if bits else x, y.view(bits) if bits else y):
                return f"{key} of shape {shape}"
    return ""


def _compare(module, i: int, kind, moments, shapes, gen) -> str:
    """Kind ``i`` of ``verify``'s: amsgrad, maximize, beta1 below 0.5 and an fp16 copy on and off in turn."""
    decoupled, weight_decay, landed, accumulate, coef, clamp = kind
    hp = AdamHyperParams(lr=1e-2, beta1=0.3 if i % 2 else 0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay,
                         amsgrad=bool(i // 2 % 2) and moments == torch.float32, maximize=bool(i // 4 % 2),
                         decoupled_weight_decay=decoupled)
    low = torch.float16 if i // 8 % 2 else torch.bfloat16
    ours = [{"master": _random(s, gen, 1.0), "low": _random(s, gen, 1e-2, low), "acc": _random(s, gen, 1e-2),
             "m": _random(s, gen, 1e-3, moments), "v": _random(s, gen, 1e-5, moments, positive=True),
             "vmax": _random(s, gen, 2e-5, positive=True), "step": torch.tensor(4.0)} for s in shapes]
    theirs = [{k: v.clone() for k, v in m.items()} for m in ours]
    for states, run in ((ours, functools.partial(update, module)), (theirs, separate_passes)):
        lists = [[m[k] for m in states] for k in ("master", "low", "acc", "m", "v", "vmax", "step")]
        run(*lists, hp, coef=None if coef is None else torch.tensor(coef), clamp=clamp, landed=landed,
            accumulate=accumulate)
    difference = _differs(ours, theirs, shapes)
    return difference and (f"{difference}, {low}, {moments} moments, {hp}, landed={landed} accumulate={accumulate} "
                           f"coef={coef} clamp={clamp}")


def _compare_landing(module, low, accumulate: bool, unscale: bool, bad: float | None, shapes, gen) -> str:
    ours = [{"master": _random(s, gen, 1.0), "low": _random(s, gen, 1e3, low), "acc": _random(s, gen, 1e3)}
            for s in shapes]
    if bad is not None:  # an inf in the elements after the last whole vector, a nan in a whole vector
        ours[-1 if bad > 0 else 0]["low"].view(-1)[-2 if bad > 0 else 3] = bad
    theirs = [{k: v.clone() for k, v in m.items()} for m in ours]
    for states, run in ((ours, functools.partial(land, module)), (theirs, separate_landing)):
        inv_scale = torch.tensor([2.0 ** -13]) if unscale else None
        found = torch.zeros(1) if unscale else None
        run(*[[m[k] for m in states] for k in ("master", "low", "acc")], accumulate=accumulate, inv_scale=inv_scale,
            found=found)
        states.append({"found": torch.zeros(1) if found is None else found})
    difference = _differs(ours, theirs, list(shapes) + ["found"])
    return difference and f"landing: {difference}, {low}, accumulate={accumulate} unscale={unscale} bad={bad}"
