"""The runtime's switches (``RuntimeConfig``, the ``runtime`` part of ``ProTrainConfig``): frozen,
read once by the engine, which passes each decision to the part that acts on it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def env_flag(name: str, default: bool) -> bool:
    """An environment switch: "1" (or any value but "0" and "") turns it on, "0" off; unset:
    ``default``."""
    value = os.environ.get(name, "")
    return default if value == "" else value != "0"


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Switches of the runtime. Each one's default may come from an environment variable (read
    when the configuration is created), so that a run can be changed without editing code."""

    check_invariants: bool = False
    """Check the residency and device-byte invariants at every hook (slow; for tests)."""

    pin_memory: bool = field(default_factory=lambda: not env_flag("PROTRAIN_NO_PIN", False))
    """Page-lock the host copies of streamed chunks on CUDA (full-speed, asynchronous copies).
    False: pageable host memory, for machines whose page-locked memory is limited (a small
    ``ulimit -l``); the copies are then slower and synchronous. Default: True, unless
    ``PROTRAIN_NO_PIN=1``."""

    cpu_adam_thread: bool = field(default_factory=lambda: env_flag("PROTRAIN_CPU_ADAM_THREAD", False))
    """On a CPU device, run the streamed chunks' updates on the worker thread as a GPU always
    does (a GPU run's order of events; slower). Default: False, unless ``PROTRAIN_CPU_ADAM_THREAD=1``."""

    one_pass_kernel: bool = field(default_factory=lambda: env_flag("PROTRAIN_ONEPASS", True))
    """Land and update mixed-precision chunks on the host in one pass (the ``protrain_ops``
    kernel, built on first use, bit for bit the separate passes). False: the separate passes,
    and no kernel is built. Default: True, unless ``PROTRAIN_ONEPASS=0``."""

    worker_cores: tuple[int, ...] | None = None
    """The cores the CPU worker's threads run on (with CUDA), e.g. ``(9, 10, 11, 12)``; the host
    states it updates are first-touched there, so they live on those cores' NUMA node. None: a
    share of the process's GPU's node, or the cores a launcher bound the process to ([Note: CPU
    worker placement] in runtime/topology.py)."""

    def pins(self, ctx) -> bool:
        """Whether streamed chunks' host copies are page-locked on ``ctx`` (a DeviceContext)."""
        return ctx.pin_memory and self.pin_memory

    def __post_init__(self) -> None:
        for name in ("check_invariants", "pin_memory", "cpu_adam_thread", "one_pass_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        cores = self.worker_cores
        if cores is not None:
            if isinstance(cores, str) or not all(type(c) is int and c >= 0 for c in cores) or not cores:
                raise ValueError(f"RuntimeConfig.worker_cores must be a non-empty list of core numbers (e.g. [8, 9, 10, 11]), "
                                 f"got {cores!r}.")
            object.__setattr__(self, "worker_cores", tuple(cores))
