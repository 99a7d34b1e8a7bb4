"""Per-chunk Adam/AdamW with exactly the semantics of the user's torch optimizer (DESIGN §3);
other elementwise optimizers run per chunk by their own class ([Note: elementwise optimizers]
in elementwise.py).

The user's optimizer object stays the one the user holds: its ``param_groups`` are read at every
step (so schedulers that change ``lr`` keep working), its ``state_dict()`` format is what
``engine.states.optimizer()`` produces, and its own ``state`` stays empty: moments live in the
chunks, next to the master weights.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from protrain_core.runtime import state_formats as formats
from protrain_core.runtime.elementwise import Elementwise, ElementwiseSteps, describe, is_adam, state_slots
from protrain_core.runtime.storage import ShardLayout, rank_quant_places
from protrain_core.runtime.values import gather_shard, gaps
from protrain_ops import AdamHyperParams, adam_step, clip_gradients, copy_to_low_precision, onepass

if TYPE_CHECKING:
    from protrain_core.runtime.chunk import Chunk

# parameter id -> (its chunk, its member index): how the optimizer finds a parameter's states.
SlotMap = dict[int, tuple["Chunk", int]]
# The storage's state slots, in order: Adam's moments, or another optimizer's states.
SLOT_ATTRS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def check_optimizer(optimizer: torch.optim.Optimizer) -> Elementwise | None:
    """Validate the optimizer: None for Adam/AdamW (the fused kernel's path), else what
    ``elementwise.describe`` found (it refuses optimizers that need whole parameters)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"ProTrain needs a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            raise ValueError("differentiable=True optimizers are not supported by ProTrain.")
        if isinstance(group.get("lr"), Tensor) and group["lr"].numel() != 1:
            raise ValueError("lr must be a float or a one-element tensor.")
    if not is_adam(optimizer):
        return describe(optimizer)
    # torch wraps each optimizer class's step for its profiler hooks: compare what is wrapped.
    own_step = inspect.unwrap(type(optimizer).step)
    if own_step not in (inspect.unwrap(torch.optim.Adam.step), inspect.unwrap(torch.optim.AdamW.step)):
        raise ValueError(
            f"{type(optimizer).__name__} overrides step() ({own_step.__module__}.{own_step.__qualname__}). ProTrain "
            "runs Adam/AdamW's update itself, chunk by chunk on the device and the CPU, so an overridden step "
            "(a closure it needs, gradients it edits before super().step()) would never run. Use "
            "torch.optim.AdamW or torch.optim.Adam itself (a subclass that keeps their step() is fine); "
            "for gradient clipping use ProTrainConfig(clipping=...) or Lightning's gradient_clip_val."
        )
    return None


def joint_optimizer(optimizers, names: dict[int, str]) -> torch.optim.Optimizer:
    """One optimizer (nobody steps it) of ``optimizers``' common class, whose param groups are
    theirs in order ([Note: several optimizers] in runtime/engine.py); a single optimizer as it
    is. ``names``: parameter id -> name, for the refusals."""
    optimizers = list(optimizers)
    if len(optimizers) == 1:
        return optimizers[0]
    classes = sorted({type(o).__name__ for o in optimizers})
    if len(classes) > 1:
        raise ValueError(
            f"ProTrain trains with several optimizers of one class, got {' and '.join(classes)}: their updates run "
            "chunk by chunk in one kernel per class. Use one class for all (e.g. AdamW, each with its own "
            "learning rate and weight decay), or one optimizer with a param group per model part.")
    parameter_owners(optimizers, names)  # (refuses a parameter in two; wrap checks the joint one as any optimizer)
    cls = type(optimizers[0])
    joint = cls.__new__(cls)
    torch.optim.Optimizer.__init__(joint, [g for o in optimizers for g in o.param_groups], dict(optimizers[0].defaults))
    return joint


def parameter_owners(optimizers, names: dict[int, str] | None = None) -> dict[int, int]:
    """Parameter id -> the index of the one optimizer (of ``optimizers``) that updates it; a
    parameter in two is refused (``names``: parameter id -> name, for the message)."""
    owner: dict[int, int] = {}
    for k, optimizer in enumerate(optimizers):
        for _, p in indexed_params(optimizer):
            if owner.setdefault(id(p), k) != k:
                raise ValueError(
                    f"The parameter {(names or {}).get(id(p), tuple(p.shape))!r} is in optimizers {owner[id(p)]} and "
                    f"{k}. ProTrain keeps each optimizer's states in its own chunks and steps only those, so a "
                    "parameter belongs to one optimizer; give each optimizer its own parameters.")
    return owner


def param_groups_state(optimizer: torch.optim.Optimizer) -> list[dict]:
    """``optimizer.state_dict()["param_groups"]`` (hyper-parameters, parameters by index) without
    calling it: an open engine routes that call to its chunks (engine.py)."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    return groups


def indexed_params(optimizer: torch.optim.Optimizer):
    """(index, parameter) in torch's state-dict numbering: param groups in order."""
    return enumerate(p for group in optimizer.param_groups for p in group["params"])


@dataclass(frozen=True)
class UpdateClip:
    """The clipping one update applies (runtime/gradients.py decides it per step)."""

    coef: Tensor | None = None  # clip_grad_norm_'s coefficient: every gradient *= coef first
    value: float | None = None  # clip_grad_value_: clamp every element to [-value, value]

    def on(self, device: torch.device) -> UpdateClip:
        """The same clipping with the coefficient where the gradients are (one copy per update)."""
        return self if self.coef is None or self.coef.device == device else UpdateClip(self.coef.to(device), self.value)


def _land_rest(kernel, chunk: Chunk, covered: list[Tensor], accumulate: bool | None) -> None:
    """The pieces of a chunk's span that no view in ``covered`` (views of the master) holds,
    as the separate passes leave them: a landing there folded into the accumulator (added when
    ``accumulate``; None: nothing landed) and the compute copy restored from the master."""
    storage, master = chunk.storage, chunk.storage.master
    base, size = master.data_ptr(), master.element_size()
    rest = gaps([((v.data_ptr() - base) // size, v.numel()) for v in covered if v.numel()], master.numel())
    masters, lows, accs = ([flat[start:end] for start, end in rest]
                           for flat in (master, storage.compute_span(), storage.grad_acc))
    if accumulate is not None:
        onepass.land(kernel, masters, lows, accs, accumulate=accumulate)
    elif lows:
        torch._foreach_copy_(lows, masters)


class ChunkOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, *, one_pass_kernel: bool = True, optimizers: tuple = ()) -> None:
        """``one_pass_kernel``: ``RuntimeConfig.one_pass_kernel``; ``optimizers``: the user's
        several, when ``optimizer`` is their ``joint_optimizer``."""
        self.optimizer = optimizer
        self.optimizers = tuple(optimizers) or (optimizer,)
        self.one_pass_kernel = one_pass_kernel
        kind = check_optimizer(optimizer)  # (None: Adam/AdamW)
        self.elementwise = None if kind is None else ElementwiseSteps(optimizer, kind)
        self._places: dict[int, formats.QuantPlaces] = {}  # chunk -> its 8-bit addressing
        self.group_of: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in self.group_of:
                    raise ValueError("A parameter appears in more than one optimizer param group.")
                self.group_of[id(p)] = g

    def snapshot(self) -> tuple:
        """Each param group's hyper-parameters now (Adam's, or the other optimizer's settings)."""
        if self.elementwise is not None:
            return self.elementwise.snapshot()
        adamw = isinstance(self.optimizer, torch.optim.AdamW)  # (a group without the key: torch's older state dicts)
        return tuple(  # decoupled per group, as torch reads it (several optimizers' groups may differ)
            AdamHyperParams.from_group(group, decoupled_weight_decay=bool(group.get("decoupled_weight_decay", adamw)))
            for group in self.optimizer.param_groups
        )

    def members_by_group(self, params: list[torch.nn.Parameter]) -> dict[int, list[int]]:
        """Members of a chunk (its ``params``) the optimizer updates, by param group (trainable ones only)."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            g = self.group_of.get(id(p))
            if g is not None and p.requires_grad:
                out.setdefault(g, []).append(i)
        return out

    def selected(self, chunk: Chunk) -> dict[int, list[int]]:
        """The members an update of ``chunk`` steps, by param group: those with a gradient since
        zero_grad (as torch skips a ``.grad`` of None); the chunk records their Adam state."""
        out = {}
        for g, members in chunk.opt_members.items():
            selected = [i for i in members if chunk.has_grad(i)]
            if selected:
                out[g] = selected
                for i in selected:
                    chunk.adam_state[i] = True
        return out

    def one_pass(self, chunk: Chunk):
        """The kernel that lands and updates ``chunk`` in one pass (protrain_ops/onepass.py), or
        None: Adam on a bf16-mixed or 16-mixed chunk whose states are in host memory."""
        storage = chunk.storage
        if (self.elementwise is not None or not storage.fmt.separate_master or storage.master.device.type != "cpu"
                or storage.fmt.compute_dtype not in (torch.bfloat16, torch.float16) or not self.one_pass_kernel):
            return None
        return onepass.kernel()

    @staticmethod
    def land(kernel, chunk: Chunk, *, accumulate: bool, members: list[int], inv_scale: Tensor | None) -> Tensor | None:
        """A gradient landed in the compute copy's span (``one_pass(chunk)`` gave ``kernel``)
        into the accumulator (added when ``accumulate``), and the copy restored from the master,
        in one pass; with ``inv_scale`` (fp16, the step's last landing) the gradients of
        ``members`` are also unscaled and checked, and the inf/nan flag is returned (1.0: found)."""
        storage, found, covered = chunk.storage, None, []
        if inv_scale is not None and members:
            views = chunk.values.update_views(tuple(members))
            found = torch.zeros(1, dtype=torch.float32, device=storage.master.device)
            onepass.land(kernel, views.master, views.lows, views.grads, accumulate=accumulate, inv_scale=inv_scale,
                         found=found)
            covered = views.master
        _land_rest(kernel, chunk, covered, accumulate)
        return found

    def update(self, chunk: Chunk, hps: tuple[AdamHyperParams, ...], selected: dict[int, list[int]],
               clip: UpdateClip, *, landed: str | None = None, timed=contextlib.nullcontext) -> None:
        """One Adam step of the ``selected`` members (with ``hps``), clipped by ``clip`` first as
        clip_grad_norm_ (``_foreach_mul_`` by the coefficient) and clip_grad_value_ (clamp) do.
        ``landed`` ("copy" or "add", only with a one-pass kernel): the gradient is still in the
        compute copy's span, and goes into the accumulator in the same pass. ``timed()``: the
        context around the update after clipping's separate passes."""
        kernel = self.one_pass(chunk)
        if kernel is not None:
            with timed():
                self._update_one_pass(kernel, chunk, hps, selected, clip, landed)
            return
        assert landed is None, "a landed gradient needs the one-pass kernel"
        storage = chunk.storage
        groups = [(g, members, chunk.values.update_views(tuple(members))) for g, members in selected.items()]
        for _, _, views in groups:
            clip_gradients(views.grads, clip.coef, clip.value)
        with timed():
            for g, members, views in groups:
                if self.elementwise is not None:
                    self.elementwise.step(chunk, g, tuple(members), views, hps[g])
                elif storage.fmt.state_format == "8bit":  # bitsandbytes' AdamW8bit ([Note: optimizer-state formats])
                    stepped = [(views.master[j], views.grads[j], moments, step)
                               for j, moments, step in self._stepped_eight_bit(chunk, members, views)]
                    formats.eight_bit_steps(stepped, hps[g], onepass.kernel() if self.one_pass_kernel else None)
                else:  # (bf16 moments: widened and rounded back, by protrain_ops)
                    adam_step(views.master, views.grads, views.exp_avgs, views.exp_avg_sqs,
                              views.max_exp_avg_sqs if hps[g].amsgrad else [], views.member_steps, hps[g])
            if storage.fmt.separate_master:
                copy_to_low_precision(storage.compute_span(), storage.master)

    def _stepped_eight_bit(self, chunk: Chunk, members: list[int], views) -> list[tuple[int, formats.MemberMoments, int]]:
        """(position in ``views``, moments, step count after this step) of each of ``members`` this
        rank holds a piece of; every member's step counter advanced, as torch counts them."""
        places, out = self.quant_places(chunk), []
        for j, i in enumerate(members):
            steps = chunk.storage.steps[i]
            steps.add_(1)
            moments = self.member_moments(chunk, i, places, views.exp_avgs[j], views.exp_avg_sqs[j])
            if moments is not None:
                out.append((j, moments, int(steps.item())))
        return out

    def quant_places(self, chunk: Chunk) -> formats.QuantPlaces:
        """Where ``chunk``'s 8-bit members keep their block scales (small ones: moments) here."""
        places = self._places.get(chunk.index)
        if places is None:
            places = self._places[chunk.index] = rank_quant_places(chunk.spec, chunk.storage.shards)
        return places

    @staticmethod
    def member_moments(chunk: Chunk, i: int, places, exp_avg: Tensor | None = None,
                       exp_avg_sq: Tensor | None = None) -> formats.MemberMoments | None:
        """Member ``i``'s 8-bit moments on this rank (its views of the uint8 states, when taken
        already); None where the rank holds none of it."""
        storage = chunk.storage
        if exp_avg is None:
            exp_avg = chunk.values.state_view(storage.exp_avg, i)
            exp_avg_sq = chunk.values.state_view(storage.exp_avg_sq, i)
        return formats.member_moments(storage, places, i, exp_avg, exp_avg_sq)

    def _gathered_eight_bit(self, chunk: Chunk) -> list[formats.MemberMoments | None]:
        """Every member's whole 8-bit moments, assembled from the ranks' pieces (a collective,
        as ``ChunkValues.gathered_values``): the uint8 states and the block scales gathered by
        position, the small members' fp32 moments from each rank's packed pieces."""
        storage, values = chunk.storage, chunk.values
        if storage.fmt.whole:
            places = self.quant_places(chunk)
            return [self.member_moments(chunk, i, places) if m.trainable else None
                    for i, m in enumerate(chunk.spec.members)]
        gathered = [values.gathered_values(a) for a in ("exp_avg", "exp_avg_sq")]
        half, wide = storage.absmax.numel() // 2, storage.wide.numel() // 2
        absmax = [gather_shard(storage, storage.absmax[k * half:(k + 1) * half]) for k in range(2)]
        wides = [gather_shard(storage, storage.wide[k * wide:(k + 1) * wide]) if wide else None for k in range(2)]
        ranks = [rank_quant_places(chunk.spec, ShardLayout(storage.fmt, r)) for r in range(storage.sharding.world)]
        out = []
        for i, m in enumerate(chunk.spec.members):
            if not m.trainable:
                out.append(None)
                continue
            m1, m2 = gathered[0][i], gathered[1][i]
            if m.numel >= formats.MIN_8BIT:
                first, n = values.span_offset(i) // formats.BLOCK, -(-m.numel // formats.BLOCK)
                out.append(formats.MemberMoments(m1, m2, absmax[0][first:first + n], absmax[1][first:first + n]))
                continue
            small = [torch.empty(m.numel, dtype=torch.float32, device=storage.device) for _ in range(2)]
            for r, places in enumerate(ranks):
                if places.wide[i] is not None:
                    off, _, n = values.state_part(i, r)
                    for k in range(2):
                        at = r * wide + places.wide[i]
                        small[k][off:off + n].copy_(wides[k][at:at + n])
            out.append(formats.MemberMoments(small[0].view(m.shape), small[1].view(m.shape), None, None))
        return out

    def _update_one_pass(self, kernel, chunk: Chunk, hps, selected: dict[int, list[int]], clip: UpdateClip,
                         landed: str | None) -> None:
        """``update`` in one pass per param group (the same results bit for bit), then the rest
        of the span as the separate passes leave it (``_land_rest``); then 8-bit chunks' small
        members, whose fp32 moments bitsandbytes steps."""
        covered, small = [], []
        for g, members in selected.items():
            views = chunk.values.update_views(tuple(members))
            if not chunk.storage.fmt.eight_bit:
                onepass.update(kernel, views.master, views.lows, views.grads, views.exp_avgs, views.exp_avg_sqs,
                               views.max_exp_avg_sqs, views.member_steps, hps[g], coef=clip.coef, clamp=clip.value,
                               landed=landed is not None, accumulate=landed == "add")
                covered += views.master
                continue
            # 8-bit moments: landed, clipped, stepped and copied in the pass ([Note: 8-bit moments in one pass])
            stepped = self._stepped_eight_bit(chunk, members, views)
            fused = [(j, moments, step) for j, moments, step in stepped if moments.absmax1 is not None]
            if fused:
                formats.kernel_steps(kernel, [(views.master[j], views.grads[j], m, step) for j, m, step in fused],
                                     hps[g], [views.lows[j] for j, _, _ in fused], coef=clip.coef, clamp=clip.value,
                                     landed=landed is not None, accumulate=landed == "add")
            covered += [views.master[j] for j, _, _ in fused]
            small += [(hps[g], views.master[j], views.grads[j], views.lows[j], moments, step)
                      for j, moments, step in stepped if moments.absmax1 is None]
        _land_rest(kernel, chunk, covered, None if landed is None else landed == "add")
        for hp, master, grad, low, moments, step in small:
            clip_gradients([grad], clip.coef, clip.value)
            formats.eight_bit_step(master, grad, moments, step, hp)
            low.copy_(master)

    # ----- torch.optim state-dict format --------------------------------------------------
    def slot_names(self) -> tuple[str, ...]:
        """torch's names of the states the chunks hold in their slots (``SLOT_ATTRS``), in order."""
        return self.elementwise.kind.slots if self.elementwise is not None else SLOT_ATTRS[:state_slots(self.optimizer)]

    def scalar_state(self, chunk: Chunk, i: int) -> dict | None:
        """Member ``i``'s state that is not in the slots ("step", ...); None when it has none yet."""
        if self.elementwise is not None:
            return self.elementwise.extra.get((chunk.index, i))
        return {"step": chunk.storage.steps[i]} if chunk.adam_state[i] else None

    def state_dict(self, slot_of: SlotMap, *, keep: bool = True, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """The state in torch's format, of ``optimizer`` (one of several the engine trains with,
        numbered as its own ``state_dict``; None: the engine's). Sharded, every rank must call it
        (the states are gathered chunk by chunk); ``keep`` False: this rank takes part only."""
        optimizer = optimizer or self.optimizer
        names = self.slot_names()
        order = self.elementwise.kind.order if self.elementwise is not None else ("step",) + names
        state = {}
        gathered: tuple[Chunk | None, list] = (None, [])  # the last chunk's whole states
        for index, p in indexed_params(optimizer):
            chunk, i = slot_of[id(p)]
            scalars = self.scalar_state(chunk, i)
            if scalars is None:
                continue
            if chunk.storage.fmt.eight_bit:  # bitsandbytes' entry ([Note: optimizer-state formats])
                if gathered[0] is not chunk:
                    gathered = chunk, self._gathered_eight_bit(chunk)
                if keep:
                    state[index] = formats.eight_bit_entry(gathered[1][i], int(chunk.storage.steps[i].item()), p.shape)
                continue
            if names and gathered[0] is not chunk:
                gathered = chunk, [chunk.values.gathered_values(a) for a in SLOT_ATTRS[:len(names)]]
            if not keep:
                continue
            entry = {}
            for name in order + tuple(n for n in scalars if n not in order):
                if name in names:
                    entry[name] = gathered[1][names.index(name)][i].detach().reshape(p.shape).to("cpu", copy=True)
                elif name in scalars:
                    value = scalars[name]
                    entry[name] = value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value
            if entry:  # torch keeps no entry for a parameter without state (SGD without momentum)
                state[index] = entry
        return {"state": state, "param_groups": param_groups_state(optimizer)} if keep else {}

    def validate_state_dict(self, osd: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        optimizer = optimizer or self.optimizer
        groups = optimizer.param_groups
        saved = osd.get("param_groups")
        if not isinstance(saved, list) or "state" not in osd:
            raise ValueError("Not an optimizer state dict: expected keys 'state' and 'param_groups'.")
        if len(saved) != len(groups) or any(len(a["params"]) != len(b["params"]) for a, b in zip(groups, saved)):
            raise ValueError(
                "The optimizer state dict has param groups of sizes "
                f"{[len(g['params']) for g in saved]} but the optimizer has "
                f"{[len(g['params']) for g in groups]}; it was saved for a different model or grouping."
            )
        params = dict(indexed_params(optimizer))
        for index, entry in osd["state"].items():
            p = params.get(int(index))
            if p is None:
                raise ValueError(f"Optimizer state for parameter index {index}, which does not exist.")
            entry = formats.unwrapped(entry)
            foreign = [] if self.elementwise is None else [k for k in entry if k not in self.elementwise.kind.order]
            if foreign:
                raise ValueError(
                    f"The optimizer state dict holds {', '.join(map(repr, foreign))} for parameter {index}, which "
                    f"{type(optimizer).__name__} does not keep ({', '.join(self.elementwise.kind.order)}): it is "
                    "another optimizer's state. Load it into that optimizer, or leave the optimizer state out.")
            names = self.slot_names() if self.elementwise is not None or "state1" not in entry else ("state1", "state2")
            required = () if self.elementwise is not None else names[:2]
            for key in required + tuple(k for k in names if k in entry and k not in required):
                if key not in entry or tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"Optimizer state {index}.{key} is missing or has shape "
                        f"{tuple(entry[key].shape) if key in entry else None}, expected {tuple(p.shape)}."
                    )

    def load_state_dict(self, osd: dict, slot_of: SlotMap, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load ``osd``, a state dict of ``optimizer`` (see ``state_dict``)."""
        optimizer = optimizer or self.optimizer
        self.validate_state_dict(osd, optimizer)
        for group, saved in zip(optimizer.param_groups, osd["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        states = {int(k): v for k, v in osd["state"].items()}
        for index, p in indexed_params(optimizer):
            chunk, i = slot_of[id(p)]
            if not chunk.opt_members or not chunk.spec.members[i].trainable:
                continue  # frozen parameter: torch keeps no state for it either
            entry = states.get(index)
            if not chunk.storage.fmt.eight_bit and entry is not None and "state1" in formats.unwrapped(entry):
                entry = formats.to_fp32_adam_entry(entry)  # an 8-bit state loaded with another format
            self.load_slots(chunk, i, entry)
            self.load_scalars(chunk, i, entry)
            chunk.adam_state[i] = entry is not None
        self.loaded()

    def load_slots(self, chunk: Chunk, i: int, entry: dict | None) -> None:
        """Member ``i``'s slot states (this rank's piece) from ``entry``, a whole state-dict entry
        (``slot_names``', or for an 8-bit chunk bitsandbytes' too: ``load_eight_bit``); zeros where it has none."""
        with torch.no_grad():
            if chunk.storage.fmt.eight_bit:
                moments = self.member_moments(chunk, i, self.quant_places(chunk))
                if moments is not None:  # this rank's piece of the entry (a block boundary)
                    off, _, n = chunk.values.state_part(i)
                    formats.load_eight_bit(moments, formats.entry_piece(entry, off, n))
                return
            for name, attr in zip(self.slot_names(), SLOT_ATTRS):
                dst = chunk.values.state_view(getattr(chunk.storage, attr), i)
                if entry is not None and name in entry:
                    dst.copy_(chunk.values.own_piece(i, entry[name]))
                else:
                    dst.zero_()

    def loaded(self) -> None:
        """After the states were loaded: the instances stepping them are built again."""
        if self.elementwise is not None:
            self.elementwise.forget()

    def load_scalars(self, chunk: Chunk, i: int, entry: dict | None) -> None:
        """Member ``i``'s non-slot state from ``entry`` (a state-dict entry; None: no state)."""
        if self.elementwise is None:
            step = entry["step"] if entry is not None else 0.0
            chunk.storage.steps[i].fill_(float(step.item() if isinstance(step, Tensor) else step))
        elif entry is None:
            self.elementwise.extra.pop((chunk.index, i), None)
        else:
            self.elementwise.extra[(chunk.index, i)] = {
                n: (v.detach().clone() if isinstance(v, Tensor) else v) for n, v in entry.items() if n not in self.slot_names()}
