"""What the profiler measured: a frozen ``Profile``, and its cache on disk.

A profile holds three kinds of facts (paper §3.3):
  static    known before anything runs: each chunk's format record (chunks differ: an embedding
            chunk's trainable span, a LoRA chunk's frozen base, a rank's shard, a format per
            chunk), whose bytes persistent, streamed and in each copy the cost model reads
            ([Note: chunk storage] in chunk_format.py); and which chunks must be on the device at once;
  measured  from real iterations of the model on its real batch shape, per *segment* (the
            modules before the first block, each transformer block, the modules after the
            last block): forward, backward and recomputation time, and activation bytes;
            plus every operator of one iteration (time and memory before/during/after);
  hardware  host<->device bandwidth with chunk-size buffers, CPU-Adam and device-Adam rates.

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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from protrain_core.chunk_format import ChunkFormat, timed_formats
from protrain_core.plan import PlanLimits
from protrain_core.utils import atomic_file

PROFILE_VERSION = 15  # 15: one format record per chunk


class ProfileVersionError(ValueError):
    """A profile written by another version of protrain_core (an older format)."""


@dataclass(frozen=True)
class Hardware:
    device: str  # e.g. "cpu (AMD EPYC, 2 threads)" or "cuda:0 NVIDIA H100 80GB HBM3"
    async_copies: bool  # copies and CPU Adam overlap device compute (CUDA) or not (CPU)
    h2d_bytes_per_s: float  # chunk-size copies host -> device (pinned on CUDA)
    d2h_bytes_per_s: float
    cpu_adam_params_per_s: float  # the CPU worker's whole update of one chunk: landing, Adam, copy back
    device_adam_params_per_s: float  # Adam on a persistent chunk on the device
    device_memory_bytes: int  # total device memory (CPU: total RAM)
    # Sharded over several processes: chunk-size all-gather (bytes assembled) and reduce-scatter
    # (bytes reduced) per second; 0 in one process.
    gather_bytes_per_s: float = 0.0
    reduce_bytes_per_s: float = 0.0
    # Parts of the CPU worker's work, per parameter (0: none, or not measured). The landing alone
    # (mixed precision: gradients landed in the compute dtype folded into the fp32 accumulator;
    # a part of ``cpu_adam_params_per_s``), and one elementwise pass over fp32 gradients in place
    # (what clipping adds before Adam: clip_grad_norm_'s multiply, clip_grad_value_'s clamps).
    cpu_land_params_per_s: float = 0.0
    cpu_pass_params_per_s: float = 0.0
    # Frozen weights dequantised on the device after an upload, per element (``frozen_dtype``:
    # the kernels run on the upload stream, after the copy); 0: none, or not measured.
    dequant_params_per_s: float = 0.0
    # Host memory page-locked in place (cudaHostRegister) per second, what ``wrap`` spends on the
    # streamed chunks' page-locked part; 0: nothing is page-locked on this device.
    page_lock_bytes_per_s: float = 0.0


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
    # tensors adds to its forward (copies out) and backward (copies back): every block swapped
    # minus every block checkpointed. None: charge the copy bandwidth (CUDA, where a stream copies).
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
    chunks: tuple[ChunkFormat, ...]  # each chunk's record, in execution order (one rank's when sharded)
    resident_sets: tuple[tuple[int, ...], ...]  # chunks needed on the device at once (PlanLimits)
    segments: tuple[Segment, ...]
    base_bytes: int  # dynamic device bytes alive during the whole iteration (the batch, ...)
    fragmentation: float  # factor on activation bytes (allocator fragmentation)
    hardware: Hardware
    ops: tuple[OpRecord, ...] = ()
    tokens: int = 0  # tokens of the profiled batch as the first block sees it (0: not known)
    iterations: int = 0  # timed iterations (median per segment)
    profile_seconds: float = 0.0

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def world_size(self) -> int:
        """Processes the chunks are sharded over."""
        return self.chunks[0].world_size

    @property
    def state_format(self) -> str:
        """The format of the updated chunks' moments: the one the hardware's CPU update was timed in."""
        return timed_formats(self.chunks)[0]

    @property
    def blocks(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind == "block")

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(n_chunks=self.n_chunks, n_blocks=self.n_blocks, resident_sets=self.resident_sets)

    def at_tokens(self, tokens: int) -> Profile:
        """This profile for a batch of ``tokens`` tokens (same model, same hardware): the
        segments' compute times, swap times and activation bytes scale with the tokens; the
        bytes alive through the step (the batch, the model's buffers) only grow.

        Linear in tokens is exact for everything a transformer block does per token (the
        projections, the MLP, norms, and attention kernels that do not store the score matrix,
        such as SDPA's flash and memory-efficient kernels); an attention that materialises the
        score matrix grows quadratically in the sequence length, so a plan for sequences longer
        than the profiled ones is then optimistic (profiling ahead on the longest batch,
        ``wrap(example_inputs=...)``, is exact for it)."""
        if tokens == self.tokens or self.tokens <= 0:
            return self
        factor = tokens / self.tokens

        def seg(s: Segment) -> Segment:
            times = {f: getattr(s, f) * factor for f in ("fwd_s", "bwd_s", "recompute_s")}
            swaps = {f: None if getattr(s, f) is None else getattr(s, f) * factor for f in ("swap_out_s", "swap_in_s")}
            sizes = {f: math.ceil(getattr(s, f) * factor)
                     for f in ("out_bytes", "saved_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "recompute_peak_bytes")}
            return dataclasses.replace(s, **times, **swaps, **sizes)

        return dataclasses.replace(self, segments=tuple(seg(s) for s in self.segments), tokens=tokens,
                                   base_bytes=math.ceil(self.base_bytes * max(1.0, factor)), ops=())

    def problems(self) -> list[str]:
        """What makes this profile unusable by the cost models (a cache file edited or written
        by a broken run): lengths that disagree, indices out of range, rates that are not
        positive, negative or non-finite measurements. Empty when it is sound."""
        bad = []
        n = self.n_chunks
        if n < 1 or not all(isinstance(c, ChunkFormat) for c in self.chunks):
            bad.append("no chunks, or a chunk that is not a format record")
        elif len({(c.numel, c.world_size) for c in self.chunks}) > 1:
            bad.append("chunks of different sizes or process counts")
        kinds = [s.kind for s in self.segments]
        if len(kinds) < 2 or kinds[0] != "pre" or kinds[-1] != "post" or any(k != "block" for k in kinds[1:-1]):
            bad.append(f"segments are not pre, blocks, post: {kinds}")
        indices = [i for s in self.segments for i in s.chunks] + [i for r in self.resident_sets for i in r]
        if any(not 0 <= i < n for i in indices):
            bad.append("a chunk index is out of range")
        hw = self.hardware
        rates = (hw.h2d_bytes_per_s, hw.d2h_bytes_per_s, hw.cpu_adam_params_per_s, hw.device_adam_params_per_s)
        if not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in rates):
            bad.append("a hardware rate is not a positive number")
        parts = (hw.cpu_land_params_per_s, hw.cpu_pass_params_per_s, hw.page_lock_bytes_per_s)
        if not all(isinstance(r, (int, float)) and math.isfinite(r) and r >= 0 for r in parts):
            bad.append("a part of the CPU update's rate, or the registration rate, is negative or not a number")
        elif hw.cpu_land_params_per_s and hw.cpu_land_params_per_s < hw.cpu_adam_params_per_s:
            bad.append("the landing alone is slower than the whole CPU update it is part of")
        numbers = [getattr(s, f.name) for s in self.segments for f in dataclasses.fields(Segment)
                   if f.name not in ("name", "kind", "chunks")]
        numbers += [self.base_bytes, self.tokens]
        if not all(x is None or (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0) for x in numbers):
            bad.append("a measured time or size is negative or not a number")
        if not (isinstance(self.fragmentation, (int, float)) and 1.0 <= self.fragmentation < 10):
            bad.append(f"fragmentation factor {self.fragmentation!r} is not in [1, 10)")
        return bad

    # ----- serialisation ------------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["chunks"] = [c.to_dict() for c in self.chunks]
        d["version"] = PROFILE_VERSION
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        if d.pop("version", None) != PROFILE_VERSION:
            raise ProfileVersionError("profile written by another version of protrain_core")
        d["hardware"] = Hardware(**d["hardware"])
        d["segments"] = tuple(Segment(**{**s, "chunks": tuple(s["chunks"])}) for s in d["segments"])
        d["ops"] = tuple(OpRecord(**o) for o in d["ops"])
        d["chunks"] = tuple(ChunkFormat.from_dict(c) for c in d["chunks"])
        d["resident_sets"] = tuple(tuple(s) for s in d["resident_sets"])
        return cls(**d)


# ----- cache ----------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$PROTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/protrain``, else ``~/.cache/protrain``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("PROTRAIN_CACHE_DIR") or Path(base) / "protrain")


def _path(directory: Path, key: str) -> Path:
    return Path(directory) / "profiles" / f"{key}.json"


def load_cached(key: str, directory: Path | None = None, *, n_chunks: int | None = None,
                n_blocks: int | None = None) -> Profile | None:
    """The cached profile with this key, or None: missing, written by another version, or
    unsound (``Profile.problems``, or not ``n_chunks`` chunks and ``n_blocks`` blocks) -- the
    last is said in a warning and the file removed, so that it is measured again."""
    path = _path(directory or cache_dir(), key)
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        profile = Profile.from_json(text)
        problems = profile.problems()
        if profile.key != key:
            problems.append(f"its key is {profile.key!r}")
        if n_chunks is not None and profile.n_chunks != n_chunks:
            problems.append(f"{profile.n_chunks} chunks where the model has {n_chunks}")
        if n_blocks is not None and profile.n_blocks != n_blocks:
            problems.append(f"{profile.n_blocks} blocks where the model has {n_blocks}")
    except ProfileVersionError:
        return None  # an older format: profile again (and overwrite it)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        problems = [f"not a profile ({type(e).__name__}: {e})"]
    if not problems:
        return profile
    warnings.warn(f"ProTrain: the cached profile {path} is unusable ({'; '.join(problems)}); it is discarded and "
                  "the model is profiled again.", stacklevel=2)
    discard(key, directory)
    return None


def discard(key: str, directory: Path | None = None) -> bool:
    """Remove a cached profile (one that turned out not to describe this machine any more);
    True when there was one."""
    try:
        _path(directory or cache_dir(), key).unlink()
    except OSError:
        return False
    return True


_UNWRITABLE_WARNED: set[str] = set()


def store(profile: Profile, directory: Path | None = None) -> Path | None:
    """Write the profile atomically (``utils.atomic_file``); a cache that cannot be written is not
    an error -- the next run profiles again -- but it is said once per directory."""
    directory = Path(directory or cache_dir())
    path = _path(directory, profile.key)
    try:
        with atomic_file(path) as f:
            f.write(profile.to_json().encode())
    except OSError as e:
        if str(directory) not in _UNWRITABLE_WARNED:
            _UNWRITABLE_WARNED.add(str(directory))
            warnings.warn(f"ProTrain cannot write its profile cache in {directory} ({e}); every run will profile "
                          "again. Set PROTRAIN_CACHE_DIR to a writable directory.", stacklevel=2)
        return None
    return path
