"""A simulated device: the runtime's CUDA code path on CPU or meta tensors, timed by a stated
model of a GPU, its host link and its host ([Note: the simulated device] in device.py).

    from protrain_core.simulator import SimulatedDevice, simulate
    sim = SimulatedDevice("h100")                       # or "h200", a JSON file, a DeviceSpec
    result = simulate(model, optimizer, batch, device=sim, precision="bf16-mixed")
    print(result.text())                                # simulated step, cost model, idle time by cause

``protrain plan --simulate`` (protrain_core/cli.py) does this for a model config on the meta
device. Nothing below this package (runtime, profiler, planner) imports it: the runtime sees a
``DeviceContext`` (runtime/device.py).
"""

from protrain_core.simulator.device import SimulatedDevice, SimulatedGroup
from protrain_core.simulator.hardware import H100, H200, DeviceSpec, cpu_spec, load_spec
from protrain_core.simulator.report import StepReport
from protrain_core.simulator.run import Simulation, simulate

__all__ = ["DeviceSpec", "H100", "H200", "SimulatedDevice", "SimulatedGroup", "Simulation", "StepReport", "cpu_spec",
           "load_spec", "simulate"]
