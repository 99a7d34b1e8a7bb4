"""The stream-order checker of the simulated device: a read or write of device memory that no
event orders after another stream's last use of it is an error.

[Note: the stream-order checker]
On a GPU, work on two streams is ordered only by what the program says: an event one records
and the other waits for (``wait_event``, ``wait_stream``), or a host wait between the two. A
missing wait trains silently wrong on the GPU -- the compute stream reads a chunk before its
upload ends, a copy reads a buffer the compute stream already refills -- while every CPU run,
which copies inline, stays right. The simulated device takes the CUDA path with its streams,
so it can see what a GPU would not report: every agent (each stream, the host thread, the CPU
worker) keeps a vector clock, the ticks of every agent it is known to come after. An operator
ticks its agent's own entry; work enqueued on a stream comes after the host's work so far; an
event carries its stream's clock, and waiting for it (``wait_event``, ``synchronize``), like a
stream waiting for another or a host for a worker's job, merges clocks. Each operator's reads
and writes (from its schema) are checked, per storage and byte range, against other agents'
last accesses: a read or write after another agent's write, or a write after another agent's
read, must come after it in the accessing agent's clock, else ``StreamRace`` names both
operators and agents. Not covered: memory freed and reused by an allocator (the simulated
device has none: storages are not reused while the checker sees them), and collectives' buffers
(a simulated collective moves no tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from protrain_core.utils import iter_tensors


class StreamRace(RuntimeError):
    """Two accesses of the same device memory that no event or wait orders."""


@dataclass
class _Access:
    lo: int
    hi: int
    agent: str
    tick: int
    write: bool
    op: str


@dataclass
class RaceChecker:
    clocks: dict[str, dict[str, int]] = field(default_factory=dict)
    _memory: dict[int, list[_Access]] = field(default_factory=dict)

    # ----- the clocks ---------------------------------------------------------------------------
    def clock(self, agent: str) -> dict[str, int]:
        return self.clocks.setdefault(agent, {})

    def snapshot(self, agent: str) -> dict[str, int]:
        return dict(self.clock(agent))

    def merge(self, agent: str, other: dict[str, int]) -> None:
        """``agent`` comes after everything ``other`` (a clock) had seen."""
        mine = self.clock(agent)
        for a, t in other.items():
            if t > mine.get(a, 0):
                mine[a] = t

    def follow(self, agent: str, other: str) -> None:
        self.merge(agent, self.clock(other))

    # ----- the accesses ---------------------------------------------------------------------------
    def operator(self, agent: str, func, args, kwargs, out) -> None:
        """An operator run by ``agent``: its reads and writes checked and recorded."""
        mine = self.clock(agent)
        tick = mine[agent] = mine.get(agent, 0) + 1
        name = func.overloadpacket.__name__
        reads, writes = ([(t, _key(t), byte_span(t)) for t in ts] for ts in _accesses(func, args, kwargs))
        for t, key, span in writes:
            self._check(agent, mine, t, key, span, True, name)
        for t, key, span in reads:
            self._check(agent, mine, t, key, span, False, name)
        for t in iter_tensors(out):
            key, span = _key(t), byte_span(t)
            if not any(key == k and span == s for _, k, s in writes):
                self._memory.pop(key, None)  # a new tensor: its memory's earlier life is over
                writes.append((t, key, span))
        for _, key, span in reads:
            self._record(key, span, agent, tick, False, name)
        for _, key, span in writes:
            self._record(key, span, agent, tick, True, name)

    def fresh(self, out) -> None:
        """Tensors just allocated: nothing has used their memory yet."""
        for t in iter_tensors(out):
            self._memory.pop(_key(t), None)

    def _check(self, agent: str, clock: dict[str, int], t: Tensor, key: int, span: tuple[int, int], write: bool,
               name: str) -> None:
        lo, hi = span
        for a in self._memory.get(key, ()):
            if a.agent == agent or a.hi <= lo or hi <= a.lo or not (a.write or write):
                continue
            if clock.get(a.agent, 0) < a.tick:
                raise StreamRace(
                    f"{name} on {agent} {'writes' if write else 'reads'} a {t.dtype} tensor of shape {tuple(t.shape)} "
                    f"that {a.op} on {a.agent} {'wrote' if a.write else 'read'}, with no event or wait ordering the "
                    f"two ([Note: the stream-order checker] in protrain_core/simulator/races.py): on a GPU they could "
                    "overlap.")

    def _record(self, key: int, span: tuple[int, int], agent: str, tick: int, write: bool, name: str) -> None:
        lo, hi = span
        records = self._memory.setdefault(key, [])
        if write:  # what it covers is superseded (checked already)
            records[:] = [a for a in records if not (lo <= a.lo and a.hi <= hi)]
        else:  # one read per agent and range is enough
            records[:] = [a for a in records if a.write or a.agent != agent or not (lo <= a.lo and a.hi <= hi)]
        records.append(_Access(lo, hi, agent, tick, write, name))


def _accesses(func, args, kwargs) -> tuple[list[Tensor], list[Tensor]]:
    """(read, written) tensors of a call, by its schema's alias annotations."""
    reads, writes = [], []
    arguments = _ARGUMENTS.get(func)
    if arguments is None:
        arguments = _ARGUMENTS[func] = [(arg.name, arg.alias_info is not None and arg.alias_info.is_write)
                                        for arg in func._schema.arguments]
    for i, (name, write) in enumerate(arguments):
        (writes if write else reads).extend(iter_tensors(args[i] if i < len(args) else kwargs.get(name)))
    return reads, writes


_ARGUMENTS: dict = {}  # operator -> its arguments' (name, written)


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def byte_span(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor covers (a strided view: from its first to last element)."""
    size = t.element_size()
    if t.numel() == 0:
        return 0, 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.storage_offset() * size
    return lo, lo + (last + 1) * size
