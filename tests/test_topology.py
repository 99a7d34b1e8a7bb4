"""Where the CPU worker runs ([Note: CPU worker placement] in runtime/topology.py), on host
topologies given as fake sysfs trees: a two-socket host with GPUs on either node, processes
sharing it, a launcher's binding, the user's cores."""

import itertools

import pytest
import torch

import protrain_core as pt
from protrain_core.runtime.host_pool import HostPool
from protrain_core.runtime.topology import HostTopology, Placement, parse_cpulist, place_worker

ALL = frozenset(range(16))


def fake_sysfs(root, nodes: list[str], gpus: dict[str, str]):
    for i, cpulist in enumerate(nodes):
        d = root / "devices" / "system" / "node" / f"node{i}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    (root / "devices" / "system" / "node" / "possible").write_text("0-1\n")  # not a node directory
    for bus, node in gpus.items():
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    return root


def two_sockets(tmp_path, gpu_nodes=("0", "0", "1", "1")) -> HostTopology:
    buses = [f"0000:{b:02x}:00.0" for b in (0x18, 0x3b, 0x86, 0xaf)][:len(gpu_nodes)]
    root = fake_sysfs(tmp_path, ["0-7", "8-15"], dict(zip(buses, gpu_nodes)))
    return HostTopology.read(root, tuple(b.upper() for b in buses))


def test_sysfs_is_read_as_linux_writes_it(tmp_path):
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11) and parse_cpulist("") == ()
    topo = two_sockets(tmp_path, ("0", "1", "-1"))
    assert topo.nodes == (tuple(range(8)), tuple(range(8, 16)))
    assert topo.gpu_nodes == (0, 1, None)  # -1: the kernel does not know
    assert topo.node_of((9, 10)) == 1 and topo.node_of((7, 8)) is None
    assert HostTopology.read(tmp_path / "nowhere").nodes == (tuple(range(__import__("os").cpu_count())),)
    (tmp_path / "devices" / "system" / "node" / "node2").mkdir()  # a memory-only node: no cpulist
    assert HostTopology.read(tmp_path).nodes == topo.nodes + ((),)


def test_a_node_without_cores_keeps_the_numbering(tmp_path):
    """Nodes are numbered as sysfs numbers them: a memory-only node between two (CXL memory)
    takes no process, and a GPU on node 2 gets node 2's cores."""
    root = fake_sysfs(tmp_path, ["0-3", "", "4-7"], {"0000:18:00.0": "2"})
    topo = HostTopology.read(root, ("0000:18:00.0",))
    assert topo.nodes == ((0, 1, 2, 3), (), (4, 5, 6, 7)) and topo.gpu_nodes == (2,)
    assert place_worker(topo, allowed=frozenset(range(8)), local_rank=0, local_processes=1, device_index=0).cores == (5, 6, 7)
    spread = [place_worker(HostTopology.read(root), allowed=frozenset(range(8)), local_rank=r, local_processes=2).node
              for r in range(2)]
    assert spread == [0, 2]


def test_one_process_takes_its_gpus_node_less_a_core_for_the_driving_thread(tmp_path):
    topo = two_sockets(tmp_path, ("1",))
    p = place_worker(topo, allowed=ALL, local_rank=0, local_processes=1, device_index=0)
    assert p.cores == tuple(range(9, 16)) and p.node == 1
    assert p.describe() == ("7 threads on cores 9-15 of NUMA node 1 (node 1's 8 cores / 1 process (GPU 0's node), "
                            "one left for the thread that drives the device)")


@pytest.mark.parametrize("gpu_nodes", [("0", "0", "1", "1"), ("0", "1", "0", "1"), ("-1", "-1", "-1", "-1")])
@pytest.mark.parametrize("processes", [1, 2, 3, 4])
def test_processes_on_one_host_never_share_a_core_and_stay_on_their_gpus_node(tmp_path, gpu_nodes, processes):
    topo = two_sockets(tmp_path, gpu_nodes)
    places = [place_worker(topo, allowed=ALL, local_rank=r, local_processes=processes, device_index=r)
              for r in range(processes)]
    for a, b in itertools.combinations(places, 2):
        assert not set(a.cores) & set(b.cores)
    for r, p in enumerate(places):
        assert p.node is not None  # one node each: the memory it touches is local
        if topo.gpu_nodes[r] is not None:
            assert p.node == topo.gpu_nodes[r]
        # The share's first core is left for the thread that drives the device.
        node = topo.nodes[p.node]
        assert p.cores[0] - 1 in node and p.cores[0] - 1 not in {c for q in places for c in q.cores}
    if gpu_nodes[0] == "-1":  # unknown: ranks spread evenly over the nodes
        assert [p.node for p in places] == [r * 2 // processes for r in range(processes)]


def test_more_processes_than_cores_share_single_cores(tmp_path):
    topo = two_sockets(tmp_path, ("-1",))
    places = [place_worker(topo, allowed=ALL, local_rank=r, local_processes=32) for r in range(32)]
    assert all(len(p.cores) == 1 for p in places) and {p.node for p in places} == {0, 1}


def test_a_launchers_binding_and_the_users_cores_are_kept(tmp_path):
    topo = two_sockets(tmp_path)
    bound = place_worker(topo, allowed=frozenset({4, 5, 6, 7}), local_rank=1, local_processes=2, device_index=1)
    assert bound.cores == (5, 6, 7) and bound.node == 0
    assert "4 cores this process is bound to, one left for the thread that drives the device" in bound.describe()
    mine = place_worker(topo, allowed=ALL, local_rank=0, local_processes=1, device_index=0, cores=(2, 3))
    assert mine.cores == (2, 3) and "RuntimeConfig.worker_cores" in mine.describe()
    assert pt.RuntimeConfig(worker_cores=[8, 9]).worker_cores == (8, 9)
    for bad in ("8-15", [], [-1], [1.5]):
        with pytest.raises(ValueError, match="worker_cores must be a non-empty list of core numbers"):
            pt.RuntimeConfig(worker_cores=bad)


def test_pageable_host_states_are_first_touched_on_the_workers_cores():
    """The pageable region (masters, moments) is zeroed by a thread bound to the placement, so
    its pages land on that node; the page-locked part is zeroed where it is allocated."""
    import os

    seen = []

    class Seen(Placement):
        def touch(self, t):
            seen.append(t.numel())
            super().touch(t)

    placement = Seen((0,), 0, "the test's")
    try:
        pool = HostPool([(100, torch.bfloat16, True), (300, torch.float32, False), (300, torch.float32, False)],
                        pin=False, touch=placement.touch)
        assert seen == [pool.pageable_nbytes] == [2 * 1216]
        assert not pool.take(100, torch.bfloat16).any() and not pool.take(300, torch.float32).any()
        assert placement._toucher.submit(lambda: os.sched_getaffinity(0)).result() == {0}
    finally:
        placement.close()
