"""One chunk of model states and its residency state machine.

[Note: parameter access]
Every managed parameter's ``.data`` is, at any time, a view of one of two flat tensors of its
chunk: the device tensor ``param_dev`` while the chunk is resident (or persistent), and the host
compute-dtype copy ``param_host`` while it is not. A parameter of a streamed chunk therefore
never holds stale or garbage data: outside forward/backward it reads the up-to-date host copy
(after ``step()`` returns), inside it reads the device buffer.

``param_dev`` is one permanent tensor per chunk; releasing the chunk frees its memory with
``param_dev.untyped_storage().resize_(0)`` and fetching re-allocates it with ``resize_`` and
copies the host values in (FSDP2's technique). Autograd's saved tensors stay valid because
(1) a saved parameter (a leaf) is saved as the parameter object itself, so unpacking reads
whatever ``.data`` points at when backward runs, and (2) a saved *view* of a parameter made in
forward (``weight.t()`` in ``linear``) shares the storage object of ``param_dev``, which the
fetch before that block's backward re-allocates and refills with the same values. Re-pointing
``.data`` does not touch the parameter's version counter, and copying into ``param_dev`` bumps
only the counter of ``param_dev`` itself, so autograd's in-place checks are not triggered.
The runtime guarantees the fetch: a pre-backward hook on each unit's outputs makes the unit's
chunks resident before any of its backward nodes runs (``runtime.py``). That includes the
recomputation of a checkpointed block, which its first backward node triggers; it calls the
block's original ``forward`` and does not re-run the forward hooks (see [Note: block
forwards] in activations.py). The chunks are equal-size, so the
device caching allocator recycles the same ``n_buffer`` blocks: those are the chunk buffers.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future

import torch
from torch import Tensor

from protrain_core.layout import ChunkSpec, ParamSlot


class ChunkState(enum.Enum):
    PERSISTENT = "persistent"  # everything on the device for the whole run
    HOST = "host"  # streamed chunk at rest: host copies are authoritative, no device memory
    FETCHING = "fetching"  # host -> device copy of the compute copy issued
    RESIDENT = "resident"  # device buffer valid; parameters point at it
    OFFLOADING = "offloading"  # backward done; device -> host gradient copy issued
    UPDATING = "updating"  # host copies owned by the CPU worker (grad landing and/or Adam)


# (verb, from-state) -> to-state. Anything else is illegal.
TRANSITIONS: dict[tuple[str, ChunkState], ChunkState] = {
    ("begin_fetch", ChunkState.HOST): ChunkState.FETCHING,
    ("end_fetch", ChunkState.FETCHING): ChunkState.RESIDENT,
    ("release", ChunkState.RESIDENT): ChunkState.HOST,
    ("begin_offload", ChunkState.RESIDENT): ChunkState.OFFLOADING,
    ("end_offload", ChunkState.OFFLOADING): ChunkState.UPDATING,
    ("begin_update", ChunkState.HOST): ChunkState.UPDATING,
    ("end_update", ChunkState.UPDATING): ChunkState.HOST,
}
VERBS = tuple(sorted({verb for verb, _ in TRANSITIONS}))


class IllegalTransition(RuntimeError):
    pass


class Chunk:
    """Flat storage of one chunk and the verbs that move it between states.

    Tensors (S = chunk size in elements, c = compute dtype, m = master dtype: fp32, bf16 in bf16-true):
      param_dev  (S,) c     device; persistent always allocated, streamed only while resident
      master     (S,) m     master weights: device if persistent, host otherwise; without mixed
                            precision (c == m) it aliases param_dev (persistent) / param_host (streamed)
      param_host (S,) c     streamed only: host compute-dtype copy uploaded for forward/backward
      grad_acc   (S,) m     gradient accumulated since zero_grad: device if persistent, host
                            otherwise; only when the chunk has parameters with gradients
      grad_dev   (S,) c     streamed only: device gradient buffer of the current backward
      exp_avg, exp_avg_sq, max_exp_avg_sq (S,) m next to master (when optimized)
    """

    def __init__(
        self,
        spec: ChunkSpec,
        *,
        persistent: bool,
        params: list[torch.nn.Parameter],
        compute_dtype: torch.dtype,
    ) -> None:
        self.spec = spec
        self.index = spec.index
        self.persistent = persistent
        self.params = params  # aligned with spec.members
        self.compute_dtype = compute_dtype
        self.state = ChunkState.PERSISTENT if persistent else ChunkState.HOST
        self.grad_members = [i for i, p in enumerate(params) if p.requires_grad]
        # Set by the engine when allocating storage.
        self.param_dev: Tensor | None = None
        self.param_host: Tensor | None = None
        self.master: Tensor | None = None
        self.grad_acc: Tensor | None = None
        self.grad_dev: Tensor | None = None
        self.exp_avg: Tensor | None = None
        self.exp_avg_sq: Tensor | None = None
        self.max_exp_avg_sq: Tensor | None = None
        self.steps: list[Tensor] = []
        # Gradient bookkeeping.
        self.received: list[bool] = [False] * len(params)  # got a gradient since zero_grad
        self.arrived_this_backward = 0  # gradients of the current backward pass
        self.has_grad_acc = False  # grad_acc holds values (else it is garbage)
        self.updated_this_step = False
        self.initialized: list[bool] = [False] * len(params)  # has Adam state (like torch)
        # Runtime bookkeeping.
        self.pins = 0  # forward uses in flight
        self.last_use = 0  # for least-recently-used eviction
        self.fetch_event = None
        self.offload_event = None
        self.future: Future | None = None

    def __repr__(self) -> str:
        return f"Chunk({self.index}, {self.state.value})"

    # ----- state machine -------------------------------------------------------------------
    def _transition(self, verb: str) -> None:
        target = TRANSITIONS.get((verb, self.state))
        if target is None:
            legal = [v for v, s in TRANSITIONS if s is self.state]
            raise IllegalTransition(
                f"chunk {self.index}: cannot {verb} in state {self.state.name} (legal: {legal or 'none'})"
            )
        self.state = target

    def begin_fetch(self) -> None:
        self._transition("begin_fetch")

    def end_fetch(self) -> None:
        self._transition("end_fetch")

    def release(self) -> None:
        self._transition("release")

    def begin_offload(self) -> None:
        self._transition("begin_offload")

    def end_offload(self) -> None:
        self._transition("end_offload")

    def begin_update(self) -> None:
        self._transition("begin_update")

    def end_update(self) -> None:
        self._transition("end_update")

    # ----- views --------------------------------------------------------------------------
    @property
    def members(self) -> tuple[ParamSlot, ...]:
        return self.spec.members

    def view(self, flat: Tensor, i: int) -> Tensor:
        m = self.spec.members[i]
        return flat[m.offset : m.offset + m.numel].view(m.shape)

    def point_params_at(self, flat: Tensor) -> None:
        """Re-point every parameter's ``.data`` at its slot in ``flat`` (see the Note above)."""
        for i, p in enumerate(self.params):
            p.data = self.view(flat, i)

    @property
    def device_resident(self) -> bool:
        return self.state in (ChunkState.FETCHING, ChunkState.RESIDENT, ChunkState.OFFLOADING)

    def device_bytes(self) -> int:
        """Bytes of device memory this chunk holds right now, read from the storages."""
        tensors = [self.param_dev, self.grad_dev]
        if self.persistent:
            tensors += [self.grad_acc, self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq]
            if self.master is not None and self.master.untyped_storage().data_ptr() != self.param_dev.untyped_storage().data_ptr():
                tensors.append(self.master)
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)
