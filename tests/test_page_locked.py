"""Host memory page-locked in place ([Note: page-locking in place] in runtime/host_pool.py), checked
on the CPU against a stand-in for CUDA's registry of registered pages: ``cudaHostRegister`` of a
range that touches a registered page fails with error 712, as on the GPU, where the first GPU
session found it failing -- buffers sharing a page with a registered neighbour, and freed memory
left registered."""

import gc

import pytest
import torch

from protrain_core.runtime import host_pool
from protrain_core.runtime.device import as_context
from protrain_core.runtime.host_pool import HostPool, PageLocked
from protrain_core.runtime.swap import HostBuffers

PAGE = host_pool._PAGE
CUDA = torch.device("cuda", 0)  # never touched: the stand-in answers every call


class FakeCudart:
    """CUDA's page registry as cudaHostRegister / cudaHostUnregister see it."""

    def __init__(self):
        self.pages: dict[int, int] = {}  # page number -> the registration's start
        self.ranges: dict[int, range] = {}  # start -> its pages
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr))
        if size == 0:
            return 1  # cudaErrorInvalidValue
        pages = range(ptr // PAGE, -(-(ptr + size) // PAGE))
        if any(p in self.pages for p in pages):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.pages.update(dict.fromkeys(pages, ptr))
        self.ranges[ptr] = pages
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        pages = self.ranges.pop(ptr, None)
        if pages is None:
            return 713  # cudaErrorHostMemoryNotRegistered
        for p in pages:
            del self.pages[p]
        return 0

    def cudaGetErrorString(self, err):
        return {712: "part or all of the requested memory range is already mapped"}.get(int(err), "unknown")


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    consumed = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_pool, "_consume_cuda_error", consumed.append)
    fake.consumed = consumed
    return fake


def test_many_small_neighbours_register_whole_pages_of_their_own(cudart):
    """Pools far smaller than a page, allocated one after the other (neighbours in the heap), all
    register: each registers whole pages inside its own allocation, and no two share one."""
    pools = [HostPool([(n, torch.float32, True), (3, torch.bfloat16, True)], pin=True, cuda=CUDA) for n in range(1, 400, 7)]
    assert all(p.locked_bytes == p.nbytes for p in pools) and len(cudart.ranges) == len(pools)
    for start, pages in cudart.ranges.items():
        assert start % PAGE == 0 and len(pages) >= 1
    for p in pools:  # the pool's bytes lie inside its registered pages
        ptr = p.take(1, torch.float32).data_ptr()
        pages = next(r for r in cudart.ranges.values() if r.start <= ptr // PAGE < r.stop)
        assert (ptr + p.nbytes - 1) // PAGE < pages.stop
        assert p.pinned_nbytes == p.nbytes and not p.take(3, torch.bfloat16).any()  # exact size, zeroed (Adam's moments start at 0)
    assert not cudart.consumed


def test_memory_is_unregistered_when_its_last_view_goes_and_never_before(cudart):
    pool = HostPool([(1000, torch.float32, True)], pin=True, cuda=CUDA)
    view = pool.take(1000, torch.float32)
    view.fill_(3.0)
    del pool
    gc.collect()
    assert len(cudart.ranges) == 1  # a view still reads the memory: still registered
    assert view.sum().item() == 3000.0
    del view
    gc.collect()
    assert not cudart.ranges and [c for c, _ in cudart.calls] == ["register", "unregister"]


def test_close_unregisters_once_and_the_memory_stays_readable(cudart):
    pool = HostPool([(10, torch.float32, True)], pin=True, cuda=CUDA)
    view = pool.take(10, torch.float32)
    pool.close()
    assert pool.locked_bytes == 0 and not cudart.ranges
    view.add_(1)  # ordinary host memory now
    pool.close()
    del pool, view
    gc.collect()
    assert [c for c, _ in cudart.calls] == ["register", "unregister"]  # not twice
    assert not cudart.consumed


def test_memory_freed_and_allocated_again_registers_again(cudart):
    """The old failure: freed while registered, the next allocation at the same addresses could
    not be registered. Rounds of allocate / free never meet a registered page."""
    for _ in range(50):
        pools = [HostPool([(n, torch.uint8, True)], pin=True, cuda=CUDA) for n in (100, 5000, 70_000, 300_000)]
        del pools
    gc.collect()
    assert not cudart.ranges and not cudart.consumed


def test_a_failed_registration_takes_cuda_s_error_and_says_what(cudart, monkeypatch):
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda ptr, size, flags: 2)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 8192 bytes for swapped activations failed with CUDA "
                                           r"error 2"):
        PageLocked(5000, device=CUDA, what="swapped activations")
    assert cudart.consumed == [CUDA]  # the next kernel launch will not raise it as its own


def test_nothing_to_lock_registers_nothing(cudart):
    locked = PageLocked(0, device=CUDA, what="nothing")
    assert locked.tensor.numel() == 0
    locked.close()
    assert not cudart.calls


class _Ctx:
    """What HostBuffers reads of a CUDA device context."""

    is_cuda = True
    device = CUDA
    host = torch.device("cpu")
    swap_stream = None

    def check_host_memory(self, nbytes, what):
        pass

    def synchronize_stream(self, stream):
        pass


def test_swap_buffers_are_page_locked_in_place_and_released(cudart):
    buffers = HostBuffers(_Ctx())
    held = [buffers.get(n) for n in (10, 100, 100, 4096, 5000)]
    assert len(cudart.ranges) == len(held)
    for b in held[1:]:
        buffers.put(b)
    buffers.trim()  # all used since the last trim: kept
    assert len(cudart.ranges) == len(held)
    buffers.trim()  # idle since: released (the first is still out)
    assert len(cudart.ranges) == 1
    buffers.close()
    assert not cudart.ranges and not cudart.consumed


MIXED = dict(compute_dtype=torch.bfloat16, master_dtype=torch.float32)
FORMATS = {  # name -> (format, page-locked bytes per element, all host bytes per element)
    "fp32": (dict(compute_dtype=torch.float32, master_dtype=torch.float32), 8, 16),
    "bf16-true": (dict(compute_dtype=torch.bfloat16, master_dtype=torch.bfloat16), 4, 8),
    "bf16-mixed": (MIXED, 2, 18),
    "bf16-mixed, bf16 moments": (dict(MIXED, state_format="bf16"), 2, 14),
    "bf16-mixed, 8-bit moments": (dict(MIXED, state_format="8bit"), 2, 12),
    "bf16-mixed, no accumulator": (dict(MIXED, accumulator=False), 2, 14),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_only_what_the_copies_touch_is_page_locked(cudart, name):
    """Issue 54, item 2: a streamed chunk page-locks its host copy (the uploads' source, the
    mixed modes' gradient landing) and, without a separate master, the accumulator its gradients
    land in -- not the master and moments that only the CPU worker touches: 2 of 18 bytes per
    parameter in bf16-mixed instead of all 18. What is registered is exactly those tensors."""
    from protrain_core.chunk_format import BLOCK, ChunkFormat
    from protrain_core.runtime.storage import ChunkStorage

    kw, locked_per, host_per = FORMATS[name]
    S = 4096
    fmt = ChunkFormat(numel=S, **kw)
    scales = 2 * 4 * S // BLOCK if fmt.eight_bit else 0  # 8-bit moments' fp32 block scales
    assert (fmt.streamed_pinned_bytes, fmt.streamed_host_bytes) == (locked_per * S, host_per * S + scales)
    storage = ChunkStorage(fmt, persistent=False, ctx=as_context("cpu"), pin=True, n_members=1)
    (start, pages), = cudart.ranges.items()
    registered = range(start, start + len(pages) * PAGE)
    inside = lambda t: t.data_ptr() in registered and t.data_ptr() + t.nbytes - 1 in registered  # noqa: E731
    assert len(pages) * PAGE == -(-fmt.streamed_pinned_bytes // PAGE) * PAGE == -(-storage.pool.pinned_nbytes // PAGE) * PAGE
    assert inside(storage.host_copy)
    lands_in_accumulator = not fmt.separate_master and storage.grad_acc is not None
    assert lands_in_accumulator is (name in ("fp32", "bf16-true"))
    if lands_in_accumulator:
        assert inside(storage.grad_acc)
    pageable = [storage.exp_avg, storage.exp_avg_sq, storage.absmax, storage.wide,
                *([storage.master] + ([storage.grad_acc] if storage.grad_acc is not None else []) if fmt.separate_master
                  else [])]
    assert all(not (t.data_ptr() in registered or t.data_ptr() + t.nbytes - 1 in registered)
               for t in pageable if t is not None and t.numel())
    assert storage.host_locked_bytes == storage.pool.pinned_nbytes < storage.host_bytes
    storage.pool.close()
    assert storage.host_locked_bytes == 0 and not cudart.ranges


@pytest.mark.parametrize("parked", [False, True])
def test_a_parked_chunk_is_page_locked_whole(cudart, parked):
    """``offload_states`` moves every state of a persistent chunk to the host and back, so the
    host buffer it parks the chunk in is page-locked whole; a re-plan that streams the chunk
    from now on locks only what the copies touch, as ``wrap`` does."""
    from protrain_core.chunk_format import ChunkFormat
    from protrain_core.runtime.storage import ChunkStorage

    fmt = ChunkFormat(numel=4096, **MIXED)
    storage = ChunkStorage(fmt, persistent=True, ctx=as_context("cpu"), pin=True, n_members=1)
    assert not cudart.ranges
    storage.make_streamed(parked=parked)
    (start, pages), = cudart.ranges.items()
    registered = range(start, start + len(pages) * PAGE)
    states = [storage.master, storage.host_copy, storage.grad_acc, storage.exp_avg, storage.exp_avg_sq]
    assert all(t is not None for t in states)
    locked = [t.data_ptr() in registered and t.data_ptr() + t.nbytes - 1 in registered for t in states]
    assert locked == ([True] * 5 if parked else [False, True, False, False, False])
    assert (storage.host_locked_bytes == storage.host_bytes) is parked
    if parked:  # onloaded (the buffer kept for the next offload), then streamed by a re-plan
        storage.make_persistent(keep_host=True)
        assert storage.host_locked_bytes == storage.host_bytes
        storage.make_streamed()
        assert 0 < storage.host_locked_bytes == storage.pool.pinned_nbytes < storage.host_bytes
        assert len(cudart.ranges) == 1  # the kept buffer unregistered
