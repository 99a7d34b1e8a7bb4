"""The formats a chunk's Adam moments are kept in (``ProTrainConfig.optimizer_state_format``).

[Note: optimizer-state formats]
Host bytes per streamed trainable parameter decide the largest model one box can fine-tune. Its
master and gradient accumulator stay (4 + 4 bytes); the moments take one of three formats:

  format  moments (bytes per parameter)            update                    parity reference
  fp32    the master dtype, as torch keeps them    torch._fused_adamw_       torch AdamW(fused=True)
          (8; bf16-true: 4)
  bf16    bfloat16, round to nearest (4)           the fused kernel on fp32  protrain_core.AdamWBf16Moments
                                                   copies, rounded back (or
                                                   the one-pass kernel)
  8bit    bitsandbytes' block-wise 8 bits: the     one pass of protrain_ops  bitsandbytes.optim.AdamW8bit
          dynamic maps, fp32 absmax per block of   on the CPU (else, and
          256 (2.03); fp32 below 4096 elements     below 4096 elements,
                                                   bitsandbytes' calls)

Each is bitwise its reference where it makes the reference's calls (a chunk's member is a
contiguous view shaped like its parameter). The 8-bit kernel's codes are exactly the nearest,
where bitsandbytes' CPU search picks a farther one for a few ([Note: 8-bit moments in one pass]
in ops/csrc/adam_onepass.cpp). A member under 4096 elements keeps fp32 moments in "8bit",
packed in one fp32 tensor of the chunk's (``wide``); the 8-bit members' block scales are in
another (``absmax``), both addressed by ``QuantPlaces``.

With ``W`` processes a rank updates its pieces of the members ([Note: sharded chunks] in
sharding.py). Blocks are independent, so a piece that starts at a block boundary of its member
updates exactly as those blocks of the whole would; the layout makes every boundary one (an
8-bit member, and a chunk's first trainable member, start at a multiple of the block:
``block_aligned``; ``s_t`` is a multiple of it). Block ``b`` of ``absmax`` scales elements
``[256 b, 256 b + 256)`` of the rank's shard, so the ranks' ``absmax`` gathered side by side
are the whole span's scales.

Every chunk keeps the one format, persistent or streamed, so a re-plan never changes the
arithmetic. "bf16" and "8bit" need Adam or AdamW (another optimizer's states have
no such format) without amsgrad, and "8bit" follows bitsandbytes' AdamW8bit: decoupled weight
decay, no maximize.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from protrain_core.chunk_format import BLOCK
from protrain_ops import AdamHyperParams, onepass

FORMATS = ("fp32", "bf16", "8bit")
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller parameters keep fp32 moments
_INSTALL = "pip install 'lightning-protrain[8bit]' (bitsandbytes)"


def check_format(name: object) -> str:
    """``name`` if it is a known format, else a ValueError with the choices."""
    if name not in FORMATS:
        raise ValueError(
            f"optimizer_state_format={name!r}: use 'fp32' (the default: Adam's moments as torch keeps them), "
            "'bf16' (bfloat16 moments) or '8bit' (bitsandbytes' block-wise 8-bit moments). (The boolean "
            "optimizer_states=False is another setting: an engine that never steps.)"
        )
    return name


@cache
def bitsandbytes():
    """bitsandbytes' functional module, imported once (quietly), or an ImportError with the fix."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as functional
    except ImportError as e:
        raise ImportError(f"optimizer_state_format='8bit' needs bitsandbytes: {_INSTALL}.") from e
    finally:
        log.setLevel(level)
    return functional


def check_optimizer_for(name: str, optimizer: torch.optim.Optimizer, *, adam: bool) -> None:
    """Refuse, with the fix, an optimizer format ``name`` cannot run with."""
    if name == "fp32":
        return
    if not adam:
        raise ValueError(
            f"optimizer_state_format={name!r} keeps Adam's moments in {name}: {type(optimizer).__name__} is not "
            "Adam/AdamW. Use torch.optim.AdamW, or optimizer_state_format='fp32'."
        )
    if name == "bf16":
        amsgrad = next((g for g, group in enumerate(optimizer.param_groups) if group.get("amsgrad")), None)
        if amsgrad is not None:
            raise ValueError(
                f"optimizer_state_format='bf16' keeps two bf16 moments, and param group {amsgrad} asks for amsgrad's "
                "third. Use amsgrad=False, or optimizer_state_format='fp32'.")
        return
    bitsandbytes()  # installed, before anything is allocated
    decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay", False)
    for g, group in enumerate(optimizer.param_groups):
        why = ("amsgrad=True" if group.get("amsgrad") else "maximize=True" if group.get("maximize")
               else "Adam's L2 weight decay" if group.get("weight_decay") and not decoupled else None)
        if why:
            raise ValueError(
                f"optimizer_state_format='8bit' runs bitsandbytes' AdamW8bit, which has no {why} (param group {g}). "
                "Use torch.optim.AdamW without amsgrad/maximize, or another optimizer_state_format."
            )


def block_aligned(name: str) -> tuple[int, int] | None:
    """The layout's member alignment for format ``name`` (``build_layout``'s ``block_aligned``)."""
    return (BLOCK, MIN_8BIT) if name == "8bit" else None


def check_layout_for(name: str, layout) -> None:
    """Refuse a chunk layout whose 8-bit members do not start at a block boundary of their
    chunk's trainable span (a layout built without ``block_aligned``)."""
    if name != "8bit":
        return
    for spec in layout.chunks:
        for m in spec.members:
            if m.trainable and m.numel >= MIN_8BIT and (m.offset - spec.trainable_start) % BLOCK:
                raise ValueError(
                    f"optimizer_state_format='8bit' needs each 8-bit parameter at a block boundary of its chunk, and "
                    f"{m.name!r} is not: build the layout with build_layout(..., block_aligned="
                    "protrain_core.runtime.state_formats.block_aligned('8bit')) (wrap() does).")


# ----- 8-bit addressing ----------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantPlaces:
    """Where each member's piece on this rank keeps its 8-bit block scales or fp32 moments, in
    chunk order: ``blocks[j]`` (first block, count) in each half of ``absmax``; ``wide[j]`` the
    offset in each half of ``wide`` (None: not that kind, or none of it here): ``rank_quant_places``
    in storage.py."""

    blocks: tuple[tuple[int, int] | None, ...]
    wide: tuple[int | None, ...]


@cache
def qmaps(device: torch.device) -> tuple[Tensor, Tensor]:
    """bitsandbytes' signed and unsigned dynamic maps (the first and second moments'), on ``device``."""
    F = bitsandbytes()
    return F.create_dynamic_map(signed=True).to(device), F.create_dynamic_map(signed=False).to(device)


@dataclass(frozen=True)
class MemberMoments:
    """One member's moments in format "8bit": uint8 states with their block scales, or fp32."""

    state1: Tensor
    state2: Tensor
    absmax1: Tensor | None  # None: fp32 moments (a member under MIN_8BIT)
    absmax2: Tensor | None


def member_moments(storage, places: QuantPlaces, j: int, views_m: Tensor, views_v: Tensor) -> MemberMoments | None:
    """Member ``j``'s moments on this rank (``places``): its views of the uint8 states
    (``views_m``, ``views_v``) with their block scales, or its fp32 moments in ``storage.wide``;
    None where the rank holds none of it."""
    blk = places.blocks[j]
    if blk is not None:
        at, n = blk
        half = storage.absmax.numel() // 2
        return MemberMoments(views_m, views_v, storage.absmax[at:at + n], storage.absmax[half + at:half + at + n])
    at = places.wide[j]
    if at is None:
        return None
    n, half, shape = views_m.numel(), storage.wide.numel() // 2, views_m.shape
    return MemberMoments(storage.wide[at:at + n].view(shape), storage.wide[half + at:half + at + n].view(shape),
                         None, None)


# ----- the updates ------------------------------------------------------------------------------
def eight_bit_step(p: Tensor, g: Tensor, moments: MemberMoments, step: int, hp: AdamHyperParams) -> None:
    """One bitsandbytes AdamW8bit step of one parameter (``step``: its count after this one)."""
    F = bitsandbytes()
    if moments.absmax1 is None:
        F.optimizer_update_32bit("adam", g, p, moments.state1, hp.beta1, hp.eps, step, hp.lr, moments.state2, hp.beta2,
                                 0.0, 0.0, hp.weight_decay, 1.0, None, max_unorm=0.0, skip_zeros=False)
        return
    q1, q2 = qmaps(p.device)
    F.optimizer_update_8bit_blockwise("adam", g, p, moments.state1, moments.state2, hp.beta1, hp.beta2, 0.0, 0.0,
                                      hp.eps, step, hp.lr, q1, q2, moments.absmax1, moments.absmax2, hp.weight_decay,
                                      gnorm_scale=1.0, skip_zeros=False)


def eight_bit_steps(members: list[tuple[Tensor, Tensor, MemberMoments, int]], hp: AdamHyperParams, kernel) -> None:
    """AdamW8bit steps of ``members`` (param, gradient, moments, its step count after this one):
    the 8-bit ones on the CPU in one pass of ``kernel`` (None: bitsandbytes' own calls), the
    others as bitsandbytes runs them."""
    fused = []
    for member in members:
        p, _, moments, _ = member
        if kernel is not None and moments.absmax1 is not None and p.device.type == "cpu":
            fused.append(member)
        else:
            eight_bit_step(*member, hp)
    if fused:
        kernel_steps(kernel, fused, hp)


def kernel_steps(kernel, members: list[tuple[Tensor, Tensor, MemberMoments, int]], hp: AdamHyperParams,
                 lows: list[Tensor] = (), **pass_options) -> None:
    """One pass of ``kernel``'s ``adam8bit`` over ``members`` (param, gradient, 8-bit moments, step
    count after this one) on the CPU; ``lows`` and ``pass_options`` as ``onepass.adam8bit`` takes them."""
    ps, gs, moments, steps = zip(*members)
    states = [[getattr(m, a) for m in moments] for a in ("state1", "state2", "absmax1", "absmax2")]
    onepass.adam8bit(kernel, list(ps), list(lows), list(gs), *states, *qmaps(ps[0].device), list(steps), hp,
                     **pass_options)


def moment_step(name: str, n: int, device: torch.device, kernel=None):
    """For the hardware probe: ``step(p, g, hp, low=None)`` updating one ``n``-element parameter
    on ``device`` with moments in format ``name`` as the runtime does (``kernel``: the one-pass
    module; ``low``: the compute copy the gradient landed in); None for fp32 and bf16."""
    if name != "8bit":
        return None
    state = torch.zeros(2, n, dtype=torch.uint8, device=device)
    absmax = torch.zeros(2, math.ceil(n / BLOCK), device=device)
    moments = MemberMoments(state[0], state[1], absmax[0], absmax[1]) if n >= MIN_8BIT else \
        MemberMoments(*torch.zeros(2, n, device=device), None, None)

    def step(p: Tensor, g: Tensor, hp: AdamHyperParams, low: Tensor | None = None) -> None:
        if low is not None and kernel is not None and moments.absmax1 is not None:
            kernel_steps(kernel, [(p, g, moments, 1)], hp, [low], landed=True)
        else:
            eight_bit_steps([(p, g, moments, 1)], hp, kernel)

    return step


# ----- state dicts -------------------------------------------------------------------------------
def eight_bit_entry(moments: MemberMoments, step: int, shape) -> dict:
    """Member's state in ``bitsandbytes.optim.AdamW8bit``'s format, on the CPU."""
    cpu = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
    entry = {"step": step, "state1": cpu(moments.state1).reshape(shape), "state2": cpu(moments.state2).reshape(shape)}
    if moments.absmax1 is not None:
        q1, q2 = qmaps(torch.device("cpu"))
        entry.update(qmap1=q1.clone(), qmap2=q2.clone(), absmax1=cpu(moments.absmax1), absmax2=cpu(moments.absmax2))
    return entry


def load_eight_bit(moments: MemberMoments, entry: dict | None) -> None:
    """Write a saved ``entry`` into a member's ``moments``: bitsandbytes' format bit for bit, or
    torch Adam's ``exp_avg``/``exp_avg_sq`` quantised; zeros without an entry."""
    entry = unwrapped(entry)
    if entry is None:
        for t in (moments.state1, moments.state2, moments.absmax1, moments.absmax2):
            if t is not None:
                t.zero_()
        return
    own = "state1" in entry  # bitsandbytes' format: copied as it is
    if own:
        m, v = entry["state1"], entry["state2"]
        if (m.dtype == torch.uint8) != (moments.absmax1 is not None):
            raise ValueError("An 8-bit optimizer state does not match this parameter: bitsandbytes keeps fp32 moments "
                             f"below {MIN_8BIT} elements and 8-bit ones from there; was it saved for another model?")
        if m.dtype == torch.uint8:
            moments.absmax1.copy_(entry["absmax1"])
            moments.absmax2.copy_(entry["absmax2"])
    else:
        m, v = entry["exp_avg"].float(), entry["exp_avg_sq"].float()
    if own or moments.absmax1 is None:
        moments.state1.copy_(m.reshape(moments.state1.shape))
        moments.state2.copy_(v.reshape(moments.state2.shape))
        return
    F = bitsandbytes()
    for value, state, absmax, code in ((m, moments.state1, moments.absmax1, qmaps(m.device)[0]),
                                       (v, moments.state2, moments.absmax2, qmaps(m.device)[1])):
        q, qs = F.quantize_blockwise(value.reshape(-1), code=code, blocksize=BLOCK)
        state.copy_(q.reshape(state.shape))
        absmax.copy_(qs.absmax)


def entry_piece(entry: dict | None, offset: int, n: int) -> dict | None:
    """The ``n`` elements from ``offset`` (a block boundary) of a parameter's saved state, in
    the entry's own format: what a rank holding that piece loads."""
    entry = unwrapped(entry)
    if entry is None:
        return None
    moments = ("state1", "state2") if "state1" in entry else ("exp_avg", "exp_avg_sq")
    if offset == 0 and n == entry[moments[0]].numel():
        return entry
    out = dict(entry)
    for key in moments:
        out[key] = entry[key].reshape(-1)[offset:offset + n]
    if moments[0] == "state1" and entry["state1"].dtype == torch.uint8:
        assert offset % BLOCK == 0
        first, count = offset // BLOCK, math.ceil(n / BLOCK)
        for key in ("absmax1", "absmax2"):
            out[key] = entry[key].reshape(-1)[first:first + count]
    return out


def unwrapped(entry: dict | None) -> dict | None:
    """An entry of bitsandbytes' own ``state_dict()``, whose 8-bit states it nests under one key."""
    if entry is None:
        return None
    nested = entry.get("__bnb_optimizer_quant_state__")
    return entry if nested is None else {**{k: v for k, v in entry.items() if k != "__bnb_optimizer_quant_state__"},
                                         **nested}


def to_fp32_adam_state(osd: dict) -> dict:
    """``osd``, an optimizer state dict of any format (``engine.states.optimizer()`` / a
    checkpoint's), in ``torch.optim.AdamW``'s own: fp32 ``exp_avg``/``exp_avg_sq`` (8-bit moments
    dequantised, bf16 ones widened) and a tensor ``step``."""
    return {"state": {index: to_fp32_adam_entry(entry) for index, entry in osd["state"].items()},
            "param_groups": osd["param_groups"]}


def to_fp32_adam_entry(entry: dict) -> dict:
    """One parameter's state of ``to_fp32_adam_state``."""
    entry = unwrapped(entry)
    if "state1" not in entry:
        return {k: (v.float() if isinstance(v, Tensor) and k != "step" and v.is_floating_point() else v)
                for k, v in entry.items()}
    m, v = entry["state1"], entry["state2"]
    if m.dtype == torch.uint8:
        F = bitsandbytes()
        m = F.dequantize_blockwise(m, absmax=entry["absmax1"], code=entry["qmap1"], blocksize=BLOCK)
        v = F.dequantize_blockwise(v, absmax=entry["absmax2"], code=entry["qmap2"], blocksize=BLOCK)
    return {"step": torch.tensor(float(entry["step"])), "exp_avg": m.float(), "exp_avg_sq": v.float()}


class AdamWBf16Moments(torch.optim.AdamW):
    """``torch.optim.AdamW`` keeping its moments in bfloat16 (round to nearest after every step):
    what ``optimizer_state_format='bf16'`` runs, as a plain optimizer (the parity reference).
    Each step runs torch's fused AdamW on fp32 copies of the moments (independently of the
    engine's path through protrain_ops, so that a test comparing the two can fail).

    ``params``, ``lr``, ``betas``, ``eps``, ``weight_decay``: as ``torch.optim.AdamW``'s."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()  # (load_state_dict widens them)
                adamw([p], [p.grad], [m], [v], [], [state["step"]], fused=True, amsgrad=False,
                                        beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                state["exp_avg"], state["exp_avg_sq"] = m.to(torch.bfloat16), v.to(torch.bfloat16)
        return loss
