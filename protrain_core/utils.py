"""Small helpers shared across protrain_core: tensors in nested outputs, sizes, host memory facts."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

_UNTRACED = contextlib.nullcontext()


def traced(name: str):
    """A named range in profiler traces -- only while a profiler records: entering a
    ``record_function`` costs tens of microseconds per hook even with no profiler running."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _UNTRACED


def plain_parameters(fn):
    """``fn`` runs with parameters' own ``__torch_function__`` off: the runtime's reads and
    re-pointing of the parameters it manages are not uses by user code ([Note: parameters used
    outside their units] in runtime/hooks.py), and skip its dispatch (about 1 us a call)."""

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return fn(*args, **kwargs)

    return plain


def when_freed(obj, method, *args) -> None:
    """Call the bound ``method(*args)`` once ``obj`` is freed, if ``method``'s object still lives
    (held weakly: held by the finalizer registry, it would keep alive whatever it holds, ``obj`` too)."""
    weakref.finalize(obj, _call_if_alive, weakref.WeakMethod(method), *args)


def _call_if_alive(method: weakref.WeakMethod, *args) -> None:
    alive = method()
    if alive is not None:
        alive(*args)


def iter_tensors(obj) -> Iterator[Tensor]:
    """The tensors in ``obj``, looking into dicts, lists and tuples (model outputs, arguments)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, Tensor):  # (most items: an operator's arguments, a batch)
                yield v
            elif isinstance(v, (list, tuple, Mapping)):
                yield from iter_tensors(v)
    elif isinstance(obj, Mapping):  # dicts, model outputs, a tokenizer's BatchEncoding
        for v in obj.values():
            yield from iter_tensors(v)


_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}


def batch_tokens(batch) -> int:
    """A batch's size in tokens as far as its tensors show it: the most elements of an integer
    or boolean tensor of one or two dimensions (token ids, labels, a padding mask: batch x
    sequence), else the most elements of a floating tensor per its last dimension (batch x
    sequence x features); 0 without tensors. Only ratios between batches of one run are used."""
    tensors = list(iter_tensors(batch))
    ids = [t.numel() for t in tensors if not t.is_floating_point() and 1 <= t.dim() <= 2]
    if ids:
        return max(ids)
    return max((t.numel() // max(1, t.shape[-1]) for t in tensors if t.is_floating_point() and t.dim() >= 2), default=0)


def block_tokens(shapes: list[tuple[tuple[int, ...], str]]) -> int:
    """The tokens of a transformer block's input, from the (shape, dtype) of its inputs: the
    first one's elements per its last dimension (hidden states: batch x sequence x hidden)."""
    if not shapes:
        return 0
    shape = shapes[0][0]
    return math.prod(shape[:-1] if len(shape) >= 2 else shape)


def parse_bytes(value: int | float | str, what: str = "memory_budget") -> int:
    """Bytes from an int, or a string such as "20GiB", "512 MiB", "1.5GB" or "4e9"."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes or a string like '20GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        number_text, unit = re.fullmatch(r"(.*?)\s*([A-Za-z]*)", value.strip().replace("_", "")).groups()
        try:
            number = float(number_text)
        except ValueError:
            number = None
        if number is None or unit.upper() not in _UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; use bytes (an int) or a number with a unit "
                "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '20GiB'."
            )
    else:
        raise ValueError(f"{what} must be a number of bytes or a string like '20GiB', got {type(value).__name__}")
    nbytes = number * _UNITS[unit.upper()]
    if not nbytes > 0 or not math.isfinite(nbytes):
        raise ValueError(f"{what}={value!r} must be a positive, finite size.")
    return int(nbytes)


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# What to do when host memory is short, where a device has memory of its own (a GPU) and where
# the device is the host (a CPU device: every state is in host memory whatever the plan).
HOST_MEMORY_FIXES = {
    True: "Keep more chunks on the device (a larger Plan.n_persist), keep fewer bytes per offloaded parameter "
          "(precision 'bf16-mixed' or 'bf16-true', ProTrainConfig(optimizer_state_format='8bit')), or free host memory.",
    False: "On a CPU device every model state is in this machine's memory whatever the plan: keep fewer bytes per "
           "parameter (precision 'bf16-true', ProTrainConfig(optimizer_state_format='8bit')), free host memory, or "
           "size the run for a GPU with `protrain plan --simulate`.",
}


def check_host_memory(needed: int, what: str, *, device_memory: bool = True) -> None:
    """A clear error, before allocating, when host RAM cannot hold ``needed`` more bytes;
    ``device_memory``: the device has memory of its own (the fix differs)."""
    available = available_host_bytes()
    if available is not None and needed > available:
        gib = 2**30
        raise MemoryError(
            f"ProTrain needs {needed / gib:.2f} GiB of host memory for {what}, but only "
            f"{available / gib:.2f} GiB is available. {HOST_MEMORY_FIXES[device_memory]}"
        )


def total_host_bytes() -> int:
    """Physical RAM of this machine (0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


# ----- temporary files of atomic saves ----------------------------------------------------------
_TMP_TAG = ".protrain-tmp-"


def new_file_mode() -> int:
    """The permissions a new file gets (``0o666`` less the umask): for a file written to a
    ``mkstemp`` temporary (created 0600) and renamed into place."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_file(path):
    """A binary file to write ``path``'s new content into: a temporary sibling (``temporary_prefix``),
    flushed to disk and renamed over ``path`` once written (a crash mid-write leaves the previous
    file intact, never a torn one), removed on a failure; with the permissions of any new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), new_file_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def temporary_prefix(path) -> str:
    """The name prefix of an atomic save's temporary sibling of ``path``: hidden, and carrying the
    writing process's id (``remove_stale_temporaries``)."""
    return f".{Path(path).name}{_TMP_TAG}{os.getpid()}-"


def remove_stale_temporaries(directory) -> list[Path]:
    """Delete the temporary files and directories of atomic saves in ``directory`` whose writing
    process is gone (a crash mid-save: ``kill -9``); a save still running is left alone.
    Returns what it removed."""
    removed = []
    for tmp in Path(directory).glob(f".*{_TMP_TAG}*"):
        pid = tmp.name.split(_TMP_TAG, 1)[1].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
                removed.append(tmp)
    return removed


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


def restore_forward(module: torch.nn.Module, own) -> None:
    """Undo a replaced ``forward``: ``own`` is ``module.__dict__.get("forward")`` from before (None: none)."""
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own


def has_meta(module: torch.nn.Module) -> bool:
    """Whether ``module`` has parameters or buffers on the meta device (built under
    ``torch.device("meta")``: the engine fills them, [Note: weights straight into chunks])."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def is_compile_wrapper(module) -> bool:
    """``torch.compile(module)``'s wrapper (dynamo's OptimizedModule), without importing dynamo."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")
