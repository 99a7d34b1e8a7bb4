"""Sharded checkpoints: a ``torch.distributed.checkpoint`` directory that every rank writes its
own pieces into, and that loads at any number of processes (one included).

[Note: sharded checkpoints]
A consolidated checkpoint (``Engine.state_dict``) gathers every chunk to rank 0, so rank 0's host
must hold the whole model. A sharded one never assembles anything: each rank writes the pieces
of the parameters it owns ([Note: sharded chunks] in runtime/sharding.py) under keys that say
what they are and where they start:

  model/<name>/<offset>              a piece of parameter <name>'s master weights (a frozen
                                     one's values), its flattened elements from <offset>
  optim/<index>/<state>/<offset>     the same piece of Adam's <state> of parameter <index>
                                     (torch's numbering: param groups in order)
  optim/<index>/step                 Adam's step of parameter <index> (rank 0)
  optim/<index>/state1/<offset>      8-bit moments (``optimizer_state_format="8bit"``):
  optim/<index>/absmax1/<block>      bitsandbytes' states of the piece (uint8, or fp32 below its
                                     minimum size) and the piece's block scales from block
                                     <block> (its offset over 256: pieces start at a block
                                     boundary); the same with 2
  optim/scalars                      another optimizer than Adam: its other states (rank 0)
  buffer/<name>                      a buffer, whole (rank 0)
  optim/param_groups                 the optimizer's hyper-parameters (rank 0)

The pieces tile every parameter whatever the number of processes that wrote them, so loading
needs only the directory's metadata: a rank reads, one chunk at a time, every piece of that
chunk's parameters, and keeps what its own shards hold (``ChunkValues.set_member``,
``ChunkValues.own_piece``) -- at most one chunk beyond its own states at a time. Moments saved
in one format load into another as a full state dict's do (8-bit quantised or dequantised:
``state_formats.load_eight_bit``, ``to_fp32_adam_entry``).

Writing and replacing the directory: [Note: replacing a checkpoint directory], above ``_write``.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import os
import shutil
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from protrain_core.runtime import state_formats as formats
from protrain_core.runtime.optim import SLOT_ATTRS, indexed_params, param_groups_state
from protrain_core.utils import alive, remove_stale_temporaries, temporary_prefix


META = "meta.pt"


def save_sharded(engine, path, meta: dict | None = None) -> None:
    """Write ``engine``'s weights and optimizer state as a sharded checkpoint directory at
    ``path`` (every rank calls it; see [Note: sharded checkpoints]); ``meta``: anything else
    to keep with them (rank 0's is written, ``torch.save``d as ``meta.pt``)."""
    engine.wait_for_updates()
    path = Path(path)
    rank, names = engine.rank, _param_names(engine)
    state: dict[str, object] = {}
    for chunk in engine.chunks:
        for i, p in enumerate(chunk.params):
            got = chunk.values.piece(i)
            if got is not None and got[1].numel():
                state[f"model/{names[id(p)]}/{got[0]}"] = got[1].detach().to("cpu", engine.precision.master_dtype)
    optim = engine.states.chunk_optimizer
    scalars = {}  # other optimizers than Adam: each parameter's non-slot state, as one object
    for index, p in indexed_params(engine.optimizer):
        chunk, i = engine.states.slot_of(p)
        held = optim.scalar_state(chunk, i)
        if held is None:
            continue
        if chunk.storage.fmt.eight_bit:
            _save_eight_bit(state, optim, chunk, i, index)
        for key, attr in zip(optim.slot_names() if not chunk.storage.fmt.eight_bit else (), SLOT_ATTRS):
            got = chunk.values.piece(i, getattr(chunk.storage, attr))
            if got is not None and got[1].numel():
                state[f"optim/{index}/{key}/{got[0]}"] = got[1].detach().to("cpu", copy=True)
        if rank == 0 and optim.elementwise is None:
            state[f"optim/{index}/step"] = chunk.storage.steps[i].detach().to("cpu", copy=True)
        elif rank == 0:
            scalars[index] = {k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in held.items()}
    if rank == 0 and optim.elementwise is not None:
        state["optim/scalars"] = _boxed(scalars)
    if rank == 0:
        for name, b in engine.module.named_buffers():
            state[f"buffer/{name}"] = b.detach().to("cpu", copy=True)
        state["optim/param_groups"] = _boxed(param_groups_state(engine.optimizer))
    tmp = _agreed_tmp(engine, path)
    _SAVING.add(path.resolve())
    try:
        _write(engine, state, tmp, path, meta)
        if rank == 0:
            replace_directory(tmp, path)
    finally:
        _SAVING.discard(path.resolve())
    engine.sharding.barrier()


_SAVING: set[Path] = set()  # the checkpoint paths this process is saving now
EIGHT_BIT_KEYS = ("state1", "state2", "absmax1", "absmax2")


def _save_eight_bit(state: dict, optim, chunk, i: int, index: int) -> None:
    """Member ``i``'s piece of its 8-bit moments (bitsandbytes' states and block scales) into
    ``state``, under the keys of [Note: sharded checkpoints]."""
    moments = optim.member_moments(chunk, i, optim.quant_places(chunk))
    if moments is None:
        return
    off = chunk.values.state_part(i)[0]
    for key in EIGHT_BIT_KEYS:  # (no block scales below the format's minimum size)
        value = getattr(moments, key)
        if value is not None:
            at = off // formats.BLOCK if key.startswith("absmax") else off
            state[f"optim/{index}/{key}/{at}"] = value.detach().reshape(-1).to("cpu", copy=True)


# [Note: replacing a checkpoint directory]
# A directory cannot be swapped for another in one rename, so a save that replaces ``NAME``
# goes through names that say what each directory is (``PID`` is the saving process's):
#
#   1. every rank writes into ``.NAME.protrain-tmp-PID-*`` (incomplete: removed once PID is gone)
#   2. rank 0 renames it ``.NAME.new-PID-*``: complete, not yet in place
#   3. the old ``NAME``, if any, is renamed ``.NAME.old-PID-*``
#   4. ``.NAME.new-PID-*`` is renamed ``NAME``
#   5. ``.NAME.old-PID-*`` is removed, once the user's own files in it (not a checkpoint's:
#      ``.metadata``, ``*.distcp``, ``meta.pt``) are moved into ``NAME``
#
# A process killed anywhere leaves ``NAME`` holding the old checkpoint (before 3, or the new
# one after 4) or, between 3 and 4, nothing under ``NAME`` but the complete new copy beside it.
# The next save or load of ``NAME`` finishes what a dead save left (``recover``): a complete new
# copy is put in place (the old one removed), a lone old copy is put back, leftovers go. A
# failed write removes its temporary directory and names the cause (``ENOSPC``: the disk is
# full) in the first line of the error, on every rank.

def _dcp():
    """``torch.distributed.checkpoint``, imported where a checkpoint is written or read: at import
    time it would cost every process half a second."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _write(engine, state: dict, tmp: Path, path: Path, meta: dict | None) -> None:
    """Steps 1-2 of [Note: replacing a checkpoint directory] up to the barrier after them; a
    failure on any rank raises on every rank (DCP gathers the ranks' results) with its cause
    first, and the temporary directory is removed."""
    dcp = _dcp()
    try:
        with _quiet():
            dcp.save(state, checkpoint_id=str(tmp), process_group=engine.sharding.group,
                     no_dist=engine.sharding.whole)
        if engine.rank == 0 and meta is not None:
            # Serialised in memory, then written by Python: a full disk raises OSError(ENOSPC),
            # where torch.save to a path says "unexpected pos 704 vs 598".
            with open(tmp / META, "wb") as f:
                f.write(_boxed(meta).getbuffer())
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        shutil.rmtree(tmp, ignore_errors=True)  # every rank: none waits for another on a failure
        hint = {errno.ENOSPC: " (ENOSPC: the disk is full; free space or save elsewhere)"}
        raise _naming(e, f"Could not write the sharded checkpoint {path}", hint) from e
    engine.sharding.barrier()


def _naming(e: BaseException, what: str, hints: dict[int, str]) -> BaseException:
    """The error a failed save or load raises: ``e``, or, where its first ``OSError`` (among the
    ranks' failures too: a full disk, an unwritable directory, a missing file) is found, one of
    that type and errno whose first line says ``what`` failed, why, and ``hints[errno]``. A
    Ctrl-C that DCP wrapped in its own error is the ``KeyboardInterrupt`` it was."""
    cause = _first_cause(e)
    if cause is None or isinstance(cause, KeyboardInterrupt):
        return cause or e
    hint = hints.get(cause.errno, "")
    return type(cause)(cause.errno, f"{what}: {cause.strerror or cause}{hint}", cause.filename)


def _first_cause(e: BaseException | None, depth: int = 0) -> OSError | KeyboardInterrupt | None:
    """The first ``OSError`` or ``KeyboardInterrupt`` in ``e``, its causes, or the per-rank
    failures DCP collects."""
    if e is None or depth > 8:
        return None
    if isinstance(e, KeyboardInterrupt) or (isinstance(e, OSError) and e.errno is not None):
        return e
    failures = getattr(e, "failures", None)
    for failure in (failures.values() if isinstance(failures, dict) else []):
        found = _first_cause(failure[0] if isinstance(failure, tuple) else failure, depth + 1)
        if found is not None:
            return found
    return _first_cause(e.__cause__ or e.__context__, depth + 1)


def _checkpoint_file(entry: Path) -> bool:
    """A sharded checkpoint's own file (``entry`` relative to its directory)."""
    return entry.name in (".metadata", META) or entry.suffix == ".distcp"


def replace_directory(tmp: Path, path: Path, mine=_checkpoint_file) -> None:
    """Steps 2-5 of [Note: replacing a checkpoint directory] (rank 0); ``mine(entry)``: an entry of
    the replaced directory (relative to it) that goes with it; the others, the user's, are kept."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    new, old = path.with_name(f".{path.name}.new-{tag}"), path.with_name(f".{path.name}.old-{tag}")
    _rename(tmp, new)
    if path.exists():
        _rename(path, old)
    _rename(new, path)
    _retire(old, path, mine)


def _rename(src: Path, dst: Path) -> None:  # (where the tests stop a save)
    os.replace(src, dst)


def _retire(old: Path, path: Path, mine) -> None:
    """Step 5: ``old`` removed, the files of the user's that were in it (a tokenizer, notes: not
    ``mine``, not replaced) moved into ``path`` first, as Lightning's sharded strategies keep them."""
    def keep(old: Path, path: Path, at: Path) -> None:
        for entry in old.iterdir():
            there = path / entry.name
            if entry.is_dir() and there.is_dir():
                keep(entry, there, at / entry.name)
            elif not mine(at / entry.name) and not there.exists():
                os.replace(entry, there)

    if old.is_dir() and path.is_dir():
        keep(old, path, Path())
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def recover(path, mine=_checkpoint_file) -> None:
    """Finish what a save of ``path`` killed between its renames left ([Note: replacing a
    checkpoint directory]; ``mine``: as ``replace_directory``'s); saves still running (another live
    process's, or this one's) are left alone."""
    path = Path(path)
    if not path.parent.is_dir():
        return

    def dead(p: Path) -> bool:
        pid = p.name.rsplit("-", 2)[-2] if p.name.count("-") >= 2 else ""
        if not pid.isdigit():
            return False
        if int(pid) == os.getpid():
            return path.resolve() not in _SAVING  # this process's own save, ended by an exception
        return not alive(int(pid))

    leftovers = {kind: sorted((p for p in path.parent.glob(f"{glob.escape('.' + path.name)}.{kind}-*") if dead(p)),
                              key=lambda p: p.stat().st_mtime) for kind in ("new", "old")}
    with contextlib.suppress(OSError):  # another rank on a shared file system may be recovering too
        if leftovers["new"]:
            newest = leftovers["new"].pop()
            if path.exists():
                aside = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                _rename(path, aside)
                leftovers["old"].append(aside)
            _rename(newest, path)
        elif leftovers["old"] and not path.exists():
            _rename(leftovers["old"].pop(), path)
        for p in leftovers["new"] + leftovers["old"]:
            _retire(p, path, mine)


def is_sharded_checkpoint(path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (``recover`` it first)."""
    return (Path(path) / ".metadata").is_file()


def read_meta(path) -> dict:
    """What ``save_sharded`` kept beside the weights (``meta``; empty when none)."""
    file = Path(path) / META
    return torch.load(file, map_location="cpu", weights_only=False) if file.is_file() else {}


def check_sharded(path, module) -> None:
    """Before an engine exists: the directory's weights have ``module``'s parameter names and
    sizes (from its metadata alone), or a ``ValueError`` says what differs."""
    pieces = _pieces(_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    sizes = {head[6:]: sum(n for _, _, n, _ in p) for head, p in pieces.items() if head.startswith("model/")}
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(sizes))
    unexpected = sorted(set(sizes) - set(params))
    bad = [f"{k}: {sizes[k]} elements saved, {params[k].numel()} expected" for k in params
           if k in sizes and sizes[k] != params[k].numel()]
    if missing or unexpected or bad:
        parts = [f"{what} {items[:4]}{' ...' if len(items) > 4 else ''}"
                 for what, items in (("missing", missing), ("unexpected", unexpected), ("sizes differ:", bad)) if items]
        raise ValueError(f"The sharded checkpoint {path} does not match this model ({'; '.join(parts)}): it was "
                         "saved for another model or configuration.")


def load_sharded(engine, path, *, model: bool = True, optimizer: bool = True, strict: bool = True) -> None:
    """``Engine.load_sharded``: into ``engine``'s chunks, one chunk at a time."""
    dcp = _dcp()
    path = Path(path)
    if engine.rank == 0:
        recover(path)
    engine.sharding.barrier()
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a sharded ProTrain checkpoint (a torch.distributed.checkpoint directory).")
    engine.scheduler.release_all()
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    pieces = _pieces(saved)
    names = _param_names(engine)
    missing = sorted(n for n in names.values() if f"model/{n}" not in pieces)
    if model and strict and missing:
        raise KeyError(f"The sharded checkpoint {path} has no weights for {missing[:5]}{'...' if len(missing) > 5 else ''}.")
    index_of = {id(p): index for index, p in indexed_params(engine.optimizer)}
    scalars = _saved_scalars(engine, path, saved) if optimizer else None
    keys = engine.states.chunk_optimizer.slot_names() + EIGHT_BIT_KEYS if optimizer else ()
    for chunk in engine.chunks:
        wanted = [f"model/{names[id(p)]}" for p in chunk.params] if model else []
        if optimizer:
            wanted += [f"optim/{index_of[id(p)]}/{key}" for p in chunk.params if id(p) in index_of for key in keys]
        whole = _read_whole(engine, path, pieces, [prefix for prefix in wanted if prefix in pieces])
        with torch.no_grad():
            for i, p in enumerate(chunk.params):
                value = whole.get(f"model/{names[id(p)]}")
                if value is not None:
                    chunk.values.set_member(i, value.view(p.shape))
        if optimizer and chunk.opt_members:
            _load_states(engine, chunk, whole, index_of, path, saved, scalars)
    if optimizer:
        engine.states.chunk_optimizer.loaded()
        groups = _read_object(path, "optim/param_groups")
        for group, s in zip(engine.optimizer.param_groups, groups):
            group.update({k: v for k, v in s.items() if k != "params"})
    if model:
        _load_buffers(engine, path, saved)


def _pieces(saved) -> dict[str, list[tuple[int, str, int, torch.dtype]]]:
    """prefix -> (offset, key, elements, dtype) of every piece in a directory's metadata."""
    pieces: dict[str, list[tuple[int, str, int, torch.dtype]]] = {}
    for key, md in saved.items():
        head, sep, off = key.rpartition("/")
        if sep and off.isdigit() and hasattr(md, "size"):
            pieces.setdefault(head, []).append((int(off), key, md.size.numel(), md.properties.dtype))
    return pieces


def _saved_scalars(engine, path: Path, saved) -> dict | None:
    """Another optimizer than Adam: each parameter's non-slot state (None for Adam)."""
    if engine.states.chunk_optimizer.elementwise is None:
        if "optim/scalars" in saved:
            raise ValueError(f"The sharded checkpoint {path} holds another optimizer's state than Adam's: load it "
                             "with the optimizer it was saved with, or with optimizer=False.")
        return None
    if "optim/scalars" not in saved:
        raise ValueError(f"The sharded checkpoint {path} holds Adam's optimizer state, not "
                         f"{type(engine.optimizer).__name__}'s: load it with the optimizer it was saved with, or with "
                         "optimizer=False.")
    return _read_object(path, "optim/scalars")


def _load_states(engine, chunk, whole: dict, index_of: dict, path: Path, saved, scalars: dict | None) -> None:
    """The optimizer states of ``chunk``'s members: slots from ``whole``, Adam's steps from the
    checkpoint, another optimizer's other states from ``scalars``."""
    optim, steps = engine.states.chunk_optimizer, {}
    for i, p in enumerate(chunk.params):
        index = index_of.get(id(p))
        if index is None or not chunk.spec.members[i].trainable:
            continue
        entry = _saved_moments(whole, index, p.shape, optim.slot_names())
        if scalars is not None:
            present = index in scalars
            optim.load_scalars(chunk, i, scalars.get(index))
        else:
            key = f"optim/{index}/step"
            present = key in saved and entry is not None and ("exp_avg" in entry or "state1" in entry)
            if present:
                steps[i] = key
        if entry is not None and "state1" in entry and not chunk.storage.fmt.eight_bit:  # 8-bit into another format
            entry = formats.to_fp32_adam_entry({**entry, "step": 0, **dict(zip(("qmap1", "qmap2"), formats.qmaps(
                torch.device("cpu"))))})
        optim.load_slots(chunk, i, entry if present else None)
        chunk.adam_state[i] = present
    if steps:
        read = {key: torch.zeros(()) for key in steps.values()}
        _load(read, path)
        for i, key in steps.items():
            chunk.storage.steps[i].fill_(float(read[key]))


def _saved_moments(whole: dict, index: int, shape, names: tuple[str, ...]) -> dict | None:
    """Parameter ``index``'s saved states as a state-dict entry, whole: the optimizer's slots
    (``names``: torch's ``exp_avg``...) or bitsandbytes' ``state1``...; None where the checkpoint
    has none."""
    entry = {}
    for key in dict.fromkeys(names + EIGHT_BIT_KEYS):
        value = whole.get(f"optim/{index}/{key}")
        if value is not None:
            entry[key] = value if key.startswith("absmax") else value.view(shape)
    return entry or None


def _read_whole(engine, path: Path, pieces: dict, wanted: list[str]) -> dict[str, Tensor]:
    """Every piece under the ``wanted`` prefixes, assembled into whole flat tensors (weights in
    the master dtype, optimizer states in the dtype they were saved in)."""
    read, whole = {}, {}
    for prefix in wanted:
        numel = max(off + n for off, _, n, _ in pieces[prefix])  # (a parameter's, or its block scales')
        dtype = engine.precision.master_dtype if prefix.startswith("model/") else pieces[prefix][0][3]
        whole[prefix] = out = torch.empty(numel, dtype=dtype)
        for off, key, n, _ in pieces[prefix]:
            read[key] = out[off:off + n]
    if read:  # every rank reads what it needs on its own: no collective
        _load(read, path)
    return whole


def _boxed(obj) -> io.BytesIO:
    """``obj`` ``torch.save``d in memory: DCP keeps a ``BytesIO`` as one object, not flattened."""
    box = io.BytesIO()
    torch.save(obj, box)
    return box


def _read_object(path: Path, key: str):
    box = {key: io.BytesIO()}
    _load(box, path)
    box[key].seek(0)
    return torch.load(box[key], weights_only=True)


def _load_buffers(engine, path: Path, saved) -> None:
    read = {f"buffer/{n}": torch.empty_like(b, device="cpu") for n, b in engine.module.named_buffers()
            if f"buffer/{n}" in saved}
    if read:
        _load(read, path)
        with torch.no_grad():
            for n, b in engine.module.named_buffers():
                if f"buffer/{n}" in read:
                    b.copy_(read[f"buffer/{n}"])


def _load(read: dict, path: Path) -> None:
    """``dcp.load`` of ``read`` from ``path`` by this rank alone; a file it cannot read (a shard
    file missing: ENOENT) is named in the first line of the error."""
    dcp = _dcp()
    try:
        with _quiet():
            dcp.load(read, checkpoint_id=str(path), no_dist=True)
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        cause = _first_cause(e)
        if cause is None:
            raise
        if isinstance(cause, KeyboardInterrupt):
            raise cause from e
        hint = {errno.ENOENT: f" ({Path(cause.filename).name} is missing: the directory is incomplete; save it "
                              "again or copy every file of it)"} if cause.filename else {}
        raise _naming(cause, f"The sharded checkpoint {path} cannot be read", hint) from e


@contextmanager
def _quiet():
    """DCP warns that it "assumes" one process when told so (``no_dist``): it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _param_names(engine) -> dict[int, str]:
    return {id(p): name for name, p in engine.module.named_parameters()}  # (a tied one: its first name)


def _agreed_tmp(engine, path: Path) -> Path:
    """A fresh temporary sibling of ``path`` with rank 0's name on every rank (rank 0 first
    removes what killed saves left there)."""
    name = None
    if engine.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        recover(path)
        name = f"{temporary_prefix(path)}{uuid.uuid4().hex[:8]}"
    name = engine.sharding.broadcast_object(name)
    return path.with_name(name)

