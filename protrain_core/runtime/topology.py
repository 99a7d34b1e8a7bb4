"""Where the CPU worker runs: the host's NUMA nodes, the node a GPU hangs off, and the share of
cores each process on a host takes.

[Note: CPU worker placement]
The CPU worker's update is memory-bound: its speed is the bandwidth of the DRAM its pages sit
in. So the worker's threads are bound to cores (``Placement.cores``), and the pageable host
states ([Note: what is page-locked] in host_pool.py) are first-touched by a thread bound the
same way (``Placement.touch``), so that Linux puts their pages on those cores' node. The cores:
- ``RuntimeConfig.worker_cores`` when the user names them;
- else the process's CPU affinity when a launcher bound it to part of the machine (SLURM,
  ``numactl``, ``taskset``);
- else a share of one NUMA node: the node the process's GPU is attached to (sysfs), or, unknown,
  node ``local_rank * nodes // local_processes``, divided evenly among the node's processes
  (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so that processes on one host never share a core.
In the last two cases the first core of the share is left for the thread that drives the device
(which is not bound: data loader workers inherit its affinity). Pools allocated later are
first-touched by the thread allocating them. ``HostTopology.read`` takes the sysfs root.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


def parse_cpulist(text: str) -> tuple[int, ...]:
    """sysfs's CPU list format ("0-3,8,10-11") as the cores it names."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cores += range(int(first), int(last or first) + 1)
    return tuple(cores)


def _cores_text(cores: tuple[int, ...]) -> str:
    """The inverse of ``parse_cpulist``, for messages."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


@dataclass(frozen=True)
class HostTopology:
    """The cores of each NUMA node by its number, and the node of each CUDA device (None: unknown)."""

    nodes: tuple[tuple[int, ...], ...]
    gpu_nodes: tuple[int | None, ...] = ()

    @classmethod
    def read(cls, root: str | Path = "/sys", gpu_bus_ids: tuple[str, ...] = ()) -> HostTopology:
        """From sysfs under ``root``; one node of every core where it says nothing (not Linux)."""
        base = Path(root, "devices", "system", "node")  # (a node without cores: memory only)
        found = {int(d.name[4:]): _read(d / "cpulist", parse_cpulist, ()) for d in base.glob("node[0-9]*")}
        nodes = tuple(found.get(i, ()) for i in range(max(found, default=-1) + 1))
        if not any(nodes):
            nodes = (tuple(range(os.cpu_count() or 1)),)
        gpus = (_read(Path(root, "bus", "pci", "devices", bus.lower(), "numa_node"), int, None) for bus in gpu_bus_ids)
        return cls(nodes, tuple(n if n is not None and 0 <= n < len(nodes) else None for n in gpus))

    def node_of(self, cores: tuple[int, ...]) -> int | None:
        """The node holding all of ``cores`` (None: several, or none)."""
        owners = {i for i, node in enumerate(self.nodes) for c in cores if c in node}
        return owners.pop() if len(owners) == 1 else None


def _read(path: Path, parse, default):
    """``parse`` of the text of the sysfs file ``path``; ``default`` where it is unreadable."""
    try:
        return parse(path.read_text())
    except (OSError, ValueError):
        return default


def gpu_bus_ids() -> tuple[str, ...]:
    """Each CUDA device's PCI address as sysfs names it ("0000:18:00.0"); () where unknown."""
    ids = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        parts = [getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
        if None in parts:
            return ()
        ids.append(f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0")
    return tuple(ids)


class Placement:
    """The cores the CPU worker's threads run on, and why ([Note: CPU worker placement])."""

    def __init__(self, cores: tuple[int, ...], node: int | None, why: str) -> None:
        assert cores
        self.cores, self.node, self.why = cores, node, why
        self._toucher: ThreadPoolExecutor | None = None

    @property
    def threads(self) -> int:
        return len(self.cores)

    def describe(self) -> str:
        where = f"cores {_cores_text(self.cores)}" + (f" of NUMA node {self.node}" if self.node is not None else "")
        return f"{self.threads} thread{'s' if self.threads > 1 else ''} on {where} ({self.why})"

    def bind(self) -> None:
        """Run the calling thread (and the intra-op threads it starts) on these cores."""
        os.sched_setaffinity(0, self.cores)  # 0: the calling thread
        torch.set_num_threads(self.threads)

    def touch(self, t: Tensor) -> None:
        """Zero ``t`` from a thread bound here: its pages' first touch places them on this node."""
        if self._toucher is None:
            self._toucher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="protrain-first-touch",
                                               initializer=self.bind)
        self._toucher.submit(t.zero_).result()

    def close(self) -> None:
        if self._toucher is not None:
            self._toucher.shutdown()
            self._toucher = None


def place_worker(topology: HostTopology, *, allowed: frozenset[int], local_rank: int, local_processes: int,
                 device_index: int | None = None, cores: tuple[int, ...] | None = None) -> Placement:
    """The worker's cores ([Note: CPU worker placement]): ``cores`` when given; else the process's
    affinity ``allowed`` when it is part of the machine; else this process's share of its node."""
    if cores:
        return Placement(tuple(cores), topology.node_of(tuple(cores)), "RuntimeConfig.worker_cores")
    every = {c for node in topology.nodes for c in node}
    if allowed and allowed < every:
        share, how = tuple(sorted(allowed)), f"{len(allowed)} cores this process is bound to"
    else:
        node, peers = _node_and_peers(topology, local_rank, local_processes, device_index)
        mine = topology.nodes[node]
        k = max(1, len(mine) // len(peers))
        i = peers.index(local_rank) % max(1, len(mine) // k)
        share = mine[i * k:(i + 1) * k]
        how = (f"node {node}'s {len(mine)} cores / {len(peers)} process{'es' if len(peers) > 1 else ''}"
               + (f" (GPU {device_index}'s node)" if _gpu_node(topology, device_index) is not None else ""))
    worker = share[1:] if len(share) > 1 else share
    return Placement(worker, topology.node_of(worker), f"{how}, one left for the thread that drives the device")


def _gpu_node(topology: HostTopology, device: int | None) -> int | None:
    return topology.gpu_nodes[device] if device is not None and device < len(topology.gpu_nodes) else None


def _node_and_peers(topology: HostTopology, rank: int, processes: int, device: int | None) -> tuple[int, list[int]]:
    """This process's node and the local ranks on it (by their GPUs' nodes, else spread evenly)."""
    with_cores = [i for i, cores in enumerate(topology.nodes) if cores]
    processes = max(1, processes)
    gpu = _gpu_node(topology, device)
    if gpu is not None and topology.nodes[gpu] and processes <= len(topology.gpu_nodes):
        node, peers = gpu, [r for r in range(processes) if topology.gpu_nodes[r] == gpu]
    else:
        spread = lambda r: with_cores[r * len(with_cores) // processes]  # noqa: E731
        node = spread(min(rank, processes - 1))
        peers = [r for r in range(processes) if spread(r) == node]
    return node, sorted(set(peers) | {rank})


def worker_placement(world: int, cores: tuple[int, ...] | None = None) -> Placement:
    """The placement of this process's CPU worker on a CUDA host sharded over ``world`` processes
    (``cores``: ``RuntimeConfig.worker_cores``): local ranks from torchrun's variables, else the devices."""
    device = torch.cuda.current_device()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    local = int(local) if local else min(world, max(1, torch.cuda.device_count()))
    rank = int(os.environ.get("LOCAL_RANK", device))
    topology = HostTopology.read(gpu_bus_ids=gpu_bus_ids())
    return place_worker(topology, allowed=frozenset(os.sched_getaffinity(0)), local_rank=rank,
                        local_processes=local, device_index=device, cores=cores)

