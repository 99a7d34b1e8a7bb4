"""What the profiler measured: a frozen ``Profile``, and its cache on disk.

A profile holds three kinds of facts (paper §3.3):
  static    known before anything runs: chunk count and size, which chunks hold trainable
            parameters, the device/host bytes a chunk needs when persistent or streamed and
            the bytes of a chunk buffer (all from the chunks' storage formula, [Note: chunk
            storage] in runtime/storage.py), and which chunks must be on the device at once;
  measured  from real iterations of the model on its real batch shape, per *segment* (the
            modules before the first block, each transformer block, the modules after the
            last block): forward, backward and recomputation time, and activation bytes;
            plus every operator of one iteration (time and memory before/during/after);
  hardware  host<->device bandwidth with chunk-size buffers, CPU-Adam and device-Adam rates.
The cost models (``cost.py``) are pure functions of a profile and a plan.

Memory quantities of a segment are deltas of the *dynamic* device bytes (activations and
temporaries; the engine's chunk memory is static and counted separately), measured with every
block checkpointed, so that a model whose activations do not fit can still be profiled:
  out_bytes             what its forward leaves alive (a block: its output, which the next block
                        keeps as checkpoint input; the last segment: logits, loss and what the
                        loss saves)
  saved_bytes           a block's tensors saved for backward (beyond its input): what KEEP holds
                        after the forward and SWAP moves to host memory
  fwd_peak_bytes        the most bytes above the segment's starting point during its forward
  bwd_peak_bytes        the most bytes during its backward (not counting recomputation), above
                        what the segments before it hold
  recompute_peak_bytes  the same during its recomputation (checkpointed blocks only)
Without asynchronous copies (a CPU device) a block's swap cost is measured as well
(``swap_out_s``, ``swap_in_s``: forward and backward with every block swapped, minus the same
with every block checkpointed); on CUDA the cost model charges the copy bandwidth instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from protrain_core.plan import PlanLimits

PROFILE_VERSION = 4


@dataclass(frozen=True)
class Hardware:
    device: str  # e.g. "cpu (AMD EPYC, 2 threads)" or "cuda:0 NVIDIA H100 80GB HBM3"
    async_copies: bool  # copies and CPU Adam overlap device compute (CUDA) or not (CPU)
    h2d_bytes_per_s: float  # chunk-size copies host -> device (pinned on CUDA)
    d2h_bytes_per_s: float
    cpu_adam_params_per_s: float  # the CPU worker's Adam on one chunk (with the bf16/fp16 copy back)
    device_adam_params_per_s: float  # Adam on a persistent chunk on the device
    device_memory_bytes: int  # total device memory (CPU: total RAM)


@dataclass(frozen=True)
class Segment:
    name: str  # "pre", "block.0", ..., "post"
    kind: str  # "pre" | "block" | "post"
    chunks: tuple[int, ...]  # chunks whose parameters its modules use
    fwd_s: float
    bwd_s: float  # backward without recomputation
    recompute_s: float  # blocks: cost of recomputing the forward when checkpointed
    out_bytes: int
    saved_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    recompute_peak_bytes: int
    # Blocks, where copies do not overlap compute (a CPU device): what swapping its saved
    # tensors adds to its forward (copies out) and backward (copies back), measured with every
    # block swapped. None: charge the copy bandwidth (CUDA, where a separate stream copies).
    swap_out_s: float | None = None
    swap_in_s: float | None = None


@dataclass(frozen=True)
class OpRecord:
    segment: str
    phase: str  # "forward" | "recompute" | "backward"
    op: str
    seconds: float
    before: int  # dynamic bytes before the operator
    peak: int  # the most during it (its outputs, and on CUDA its workspace, included)
    after: int


@dataclass(frozen=True)
class Profile:
    key: str
    description: str
    precision: str
    n_chunks: int
    chunk_elems: int
    compute_bytes: int  # bytes per element of the compute dtype
    chunk_trainable: tuple[int, ...]  # elements Adam updates, per chunk
    chunk_frozen: tuple[int, ...]  # elements of frozen parameters (a compute copy only), per chunk
    chunk_has_grad: tuple[bool, ...]
    persist_bytes: tuple[int, ...]  # device bytes of each chunk when persistent
    host_bytes: tuple[int, ...]  # host bytes of each chunk when streamed
    offload_bytes: tuple[int, ...]  # bytes of one gradient offload of each chunk (0: frozen)
    buffer_bytes: int  # device bytes of one chunk buffer (a streamed chunk's compute copy and gradients)
    chunk_bytes: int  # bytes moved by one chunk upload
    resident_sets: tuple[tuple[int, ...], ...]  # chunks needed on the device at once (PlanLimits)
    segments: tuple[Segment, ...]
    base_bytes: int  # dynamic device bytes alive during the whole iteration (the batch, ...)
    fragmentation: float  # factor on activation bytes (allocator fragmentation)
    hardware: Hardware
    ops: tuple[OpRecord, ...] = ()
    iterations: int = 0  # timed iterations (median per segment)
    profile_seconds: float = 0.0

    @property
    def blocks(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind == "block")

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(n_chunks=self.n_chunks, n_blocks=self.n_blocks, resident_sets=self.resident_sets)

    # ----- serialisation ------------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["version"] = PROFILE_VERSION
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        if d.pop("version", None) != PROFILE_VERSION:
            raise ValueError("profile written by another version of protrain_core")
        d["hardware"] = Hardware(**d["hardware"])
        d["segments"] = tuple(Segment(**{**s, "chunks": tuple(s["chunks"])}) for s in d["segments"])
        d["ops"] = tuple(OpRecord(**o) for o in d["ops"])
        for name in ("chunk_trainable", "chunk_frozen", "chunk_has_grad", "persist_bytes", "host_bytes", "offload_bytes"):
            d[name] = tuple(d[name])
        d["resident_sets"] = tuple(tuple(s) for s in d["resident_sets"])
        return cls(**d)


# ----- cache ----------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$PROTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/protrain``, else ``~/.cache/protrain``."""
    explicit = os.environ.get("PROTRAIN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "protrain"


def _path(directory: Path, key: str) -> Path:
    return Path(directory) / "profiles" / f"{key}.json"


def load_cached(key: str, directory: Path | None = None) -> Profile | None:
    path = _path(directory or cache_dir(), key)
    try:
        profile = Profile.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None  # missing, unreadable or stale: profile again
    return profile if profile.key == key else None


def discard(key: str, directory: Path | None = None) -> bool:
    """Remove a cached profile (one that turned out not to describe this machine any more);
    True when there was one."""
    try:
        _path(directory or cache_dir(), key).unlink()
    except OSError:
        return False
    return True


def store(profile: Profile, directory: Path | None = None) -> Path | None:
    """Write the profile atomically (temporary file, then rename); a cache that cannot be
    written is not an error -- the next run profiles again."""
    path = _path(directory or cache_dir(), profile.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(profile.to_json())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return None
    return path
