"""Training steps of a model on a simulated device, next to the cost model's prediction.

``simulate(model, optimizer, batch, device=SimulatedDevice(...))`` profiles the model on the
simulated device (the profiler's own passes and probes, in simulated time: the profile describes
the device the run sees), searches a plan within the budget unless one is given, wraps the model
on the device with that plan, runs training steps and returns a ``Simulation``: the step's
``StepReport`` (report.py), the cost model's prediction for the same plan and schedule, and the
``Timeline`` of the steps (the same one ``Engine.record_timeline`` gives on a GPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from protrain_core.api import default_host_budget, default_memory_budget, wrap
from protrain_core.autoplan import AutoPlanner, refitter
from protrain_core.config import ProTrainConfig
from protrain_core.phase import StepObserver
from protrain_core.plan import Plan, as_plan
from protrain_core.planner.cost import MemoryEstimate, RuntimeEstimate, estimate_memory, estimate_runtime
from protrain_core.planner.profiles import Profile
from protrain_core.planner.search import PlanChoice
from protrain_core.precision import parse_precision
from protrain_core.profiler.profiler import call, default_loss, profile_model
from protrain_core.runtime.storage import chunk_formats
from protrain_core.runtime.sharding import ONE_PROCESS
from protrain_core.simulator.device import SimulatedDevice, SimulatedGroup
from protrain_core.simulator.report import StepReport
from protrain_core.structure.blocks import find_blocks
from protrain_core.structure.layout import build_layout
from protrain_core.update import overlap_mode
from protrain_core.utils import format_bytes, format_seconds


@dataclass(frozen=True)
class Simulation:
    """What ``simulate`` found. ``predicted`` and ``memory``: the cost models' estimates for
    the same plan and update schedule; ``choice``: the search's, when it chose the plan."""

    hardware: str
    description: str
    plan: Plan
    precision: str
    overlap: str
    world_size: int
    report: StepReport
    predicted: RuntimeEstimate
    memory: MemoryEstimate
    device_memory_bytes: int
    host_budget_bytes: int | None  # what wrap lets the host states take (the search's too; None: a CPU device)
    timeline: dict
    profile: Profile
    device_peak_bytes: int | None  # the most device memory allocated at once in the steps (simulated; None: a CPU device)
    choice: PlanChoice | None = None

    @property
    def step_s(self) -> float:
        return self.report.step_s

    @property
    def error(self) -> float:
        """Simulated over predicted step time, minus 1."""
        return self.report.step_s / self.predicted.total_s - 1

    def text(self) -> str:
        p = self.plan
        fits = self.memory.peak_bytes <= self.device_memory_bytes
        host_fits = self.host_budget_bytes is None or self.memory.planned_host_bytes <= self.host_budget_bytes
        head = [
            f"{self.hardware}: {self.description}",
            f"plan {p.n_persist}/{p.n_buffer}/{p.n_swap}/{p.n_checkpoint} (persist/buffer/swap/checkpoint), "
            f"{self.precision}, {self.overlap}" + (f", {self.world_size} simulated ranks" if self.world_size > 1 else ""),
            f"cost model: step {format_seconds(self.predicted.total_s)} (forward {format_seconds(self.predicted.forward_s)}, "
            f"backward {format_seconds(self.predicted.backward_s)}, bottleneck {self.predicted.bottleneck}); peak "
            f"{format_bytes(self.memory.peak_bytes)} of {format_bytes(self.device_memory_bytes)}"
            + ("" if fits else " -- does NOT fit the device") + f"; host {format_bytes(self.memory.planned_host_bytes)} "
            + (f"of its budget {format_bytes(self.host_budget_bytes)}" if self.host_budget_bytes is not None else "")
            + ("" if host_fits else " -- does NOT fit the host"),
        ]
        if self.device_peak_bytes is not None:
            head.append(f"simulated device memory: peak {format_bytes(self.device_peak_bytes)} in the steps (cost model "
                        f"{format_bytes(self.memory.peak_bytes)})" + ("" if self.device_peak_bytes <= self.device_memory_bytes
                                                                       else " -- does NOT fit the device"))
        return "\n".join(head + [self.report.text(self.predicted.total_s)])


class _Marks(StepObserver):
    """Compute-stream positions of each step's phases (an engine observer)."""

    def __init__(self, sim: SimulatedDevice) -> None:
        self.sim = sim
        self.backward: list[float] = []
        self.backward_end: list[float] = []

    def backward_begins(self) -> None:
        self.backward.append(self.sim.stamp())

    def backward_ends(self) -> None:
        self.backward_end.append(self.sim.stamp())


def simulate(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, *, device: SimulatedDevice,
             plan: Plan | dict | None = None, budget: int | None = None, precision: str = "bf16-mixed",
             config: ProTrainConfig | None = None, world_size: int = 1, profile: Profile | None = None,
             steps: int = 2, description: str = "") -> Simulation:
    """Simulate ``steps`` training steps (at least 2; the report is the first step's period, from
    its backward to the next one's) of ``model`` on ``batch`` (keyword inputs with labels).
    ``profile``: one taken on this device before (the same model, batch, precision and world
    size); ``world_size``: simulated ranks the chunks are sharded over (meta tensors only);
    ``config``: the run's ``ProTrainConfig`` (its clipping, state formats, accumulators; its
    planning part is the arguments')."""
    if steps < 2:
        raise ValueError("simulate(steps=...) needs at least 2 steps: a step's period ends where the next backward begins.")
    if device.device.type != "meta" or any(not p.is_meta for p in model.parameters()):
        raise ValueError("simulate() is a size-only simulation: build the model on the meta device (with "
                         "torch.device('meta'): model = ...; its optimizer over those parameters) and give a "
                         "SimulatedDevice with tensors='meta' (the default).")
    sim, prec = device, parse_precision(precision)
    config = config or ProTrainConfig()
    group = SimulatedGroup(sim, world_size) if world_size > 1 else ONE_PROCESS
    mode = overlap_mode(prec, config.clipping)
    refit = None  # (a refusal's alternatives: of a profile taken here)
    with sim:
        if profile is None:
            block_path, blocks = find_blocks(model)
            layout = build_layout(model, block_path, len(blocks))
            # One timed pass: the simulated clock gives the same times every pass.
            formats = chunk_formats(model, optimizer, layout, prec, config, world_size=world_size)
            profile = profile_model(model, optimizer, layout, example_inputs=batch, precision=prec, device=sim,
                                    iterations=1, cache=False, sharding=group, formats=formats)
            refit = refitter(model, optimizer, layout, prec, config, sim, world_size=world_size)
        choice = None
        if plan is None:
            # The host budget wrap checks a plan against (available RAM less the margin): a plan
            # chosen here is one wrap builds; refused, with what would fit, as wrap refuses it.
            choice = AutoPlanner(None, profile, budget=budget or default_memory_budget(sim),
                                 host_budget=default_host_budget(sim), overlap=mode, refit=refit).first_choice()
            plan = choice.plan
        plan = as_plan(plan)
        engine = wrap(model, optimizer, plan, device=sim, precision=precision, process_group=group, config=config)
        if sim.memory is not None:
            sim.memory.reset_peak()
        try:
            report, timeline, overlap = _run(engine, sim, batch, steps, late=config.clipping is None)
        finally:
            engine.close()
    return Simulation(
        hardware=sim.spec.name, description=description or profile.description, plan=plan, precision=prec.value,
        overlap=overlap, world_size=world_size, report=report,
        predicted=estimate_runtime(profile, plan, schedule=mode.schedule, gradient_passes=mode.gradient_passes), memory=estimate_memory(profile, plan),
        device_memory_bytes=sim.spec.device_memory_bytes, host_budget_bytes=default_host_budget(sim),
        timeline=timeline, profile=profile, device_peak_bytes=sim.memory.peak if sim.memory is not None else None,
        choice=choice,
    )


def _run(engine, sim: SimulatedDevice, batch: dict, steps: int, *, late: bool):
    """Train ``steps`` steps on ``batch``; (the first step's report, the timeline, the schedule)."""
    if late:
        engine.clipping.expect_late(False)  # no step is held for a clipping request: the steady schedule
    sim.phase_of = lambda: engine.step_state.phase.value
    marks = _Marks(sim)
    handle = engine.observe(marks)
    try:
        with engine.record_timeline() as timeline:
            for _ in range(steps):
                engine.backward(default_loss(call(engine.module, batch)))
                engine.step()
                engine.zero_grad()
    finally:
        handle.remove()
    report = StepReport.of(sim.records, (marks.backward[0], marks.backward_end[0]), marks.backward[1],
                           sim.worker_lane.name, asynchronous=sim.asynchronous)
    data = timeline.to_json()
    data.update(plan=str(engine.plan), overlap=engine.overlap)
    return report, data, engine.overlap


def simulate_plain(model: nn.Module, batch: dict, *, device: SimulatedDevice, precision: str = "bf16-mixed",
                   steps: int = 2) -> float:
    """Plain PyTorch's training step of ``model`` on the simulated device, in simulated seconds
    (the last of ``steps``): the parameters on the device, forward with the casts
    ``torch.autocast`` makes in a mixed precision (``_Autocast``), backward, the kernel of
    ``torch.optim.AdamW(fused=True)`` (``torch._fused_adamw_``, which that optimizer refuses to
    run on meta tensors) and ``zero_grad``. The baseline a chosen plan is compared with where the
    whole model fits the device (``protrain plan --simulate``)."""
    from protrain_ops import AdamHyperParams, adam_step

    prec = parse_precision(precision)
    params = [p for p in model.parameters() if p.requires_grad]
    hp = AdamHyperParams(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ends = []
    device.memory.adopt(model.parameters())  # built before the device was entered
    with device, (_Autocast(prec.compute_dtype) if prec.is_mixed else contextlib.nullcontext()):
        moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        counts = [torch.zeros((), device=p.device) for p in params]
        for _ in range(steps):
            default_loss(call(model, batch)).backward()
            adam_step(params, [p.grad for p in params], *moments, [], counts, hp)
            model.zero_grad()
            device.synchronize_device()
            ends.append(device.main.t)
    return ends[-1] - ends[-2] if steps > 1 else ends[-1]


class _Autocast(TorchFunctionMode):
    """``torch.autocast`` for the simulated device's meta tensors (which autocast does not
    touch): the operands of matmuls, linear layers and attention cast to ``dtype`` when they are
    fp32, one charged cast each, as autocast's; everything else in its own dtype."""

    _CAST = {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.bmm, torch.baddbmm, torch.mm,
             torch.addmm, torch.nn.functional.scaled_dot_product_attention}

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._CAST:
            low = lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
            args, kwargs = [low(a) for a in args], {k: low(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
