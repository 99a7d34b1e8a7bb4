"""The architecture as tests (docs/architecture.md): layers without import cycles, a pure
planner, no reads of another module's private attributes, no Lightning in protrain_core, one
owner of autocast and one table of precision names."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("protrain_core", "lightning_protrain", "ops")


def _modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "ops":
            parts[0] = "protrain_ops"
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere in the file (function bodies too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    mods = _modules(package)
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_no_import_cycle_in_protrain_core():
    # The package __init__ ("protrain_core") is a node too: it re-exports the public names, so a
    # module it loads must not import the package back.
    graph = _graph("protrain_core")
    assert graph["protrain_core"]  # the checker sees the re-exports
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_layers_depend_downwards():
    """structure, the chunk format record and the planner know nothing of the runtime or the
    profiler; the runtime knows nothing of the profiler, the planner's search or the entry points."""
    graph = _graph("protrain_core")
    sim = "protrain_core.simulator"  # the simulated device sits on top: nothing below knows it
    # The modules above the runtime: the entry points, and the checkpoint and export functions of
    # the engine they return (function-level imports count too).
    above = ("protrain_core.api", "protrain_core.engine", "protrain_core.checkpoint", "protrain_core.export",
             "protrain_core.autoplan", "protrain_core.cli", "protrain_core.timeline_figure")
    rules = {
        "protrain_core.planner": ("protrain_core.runtime", "protrain_core.profiler", "protrain_core.structure",
                                  "protrain_core.api", sim),
        "protrain_core.structure": ("protrain_core.runtime", "protrain_core.profiler", "protrain_core.planner",
                                    "protrain_core.api", sim),
        # The chunk format record sits below the runtime, which allocates by it, and the planner,
        # whose profile carries it: it knows neither, nor the model's structure.
        "protrain_core.chunk_format": ("protrain_core.runtime", "protrain_core.profiler", "protrain_core.planner",
                                       "protrain_core.structure", "protrain_core.api", sim),
        "protrain_core.runtime": ("protrain_core.profiler", "protrain_core.planner", sim) + above,
        "protrain_core.profiler": ("protrain_core.api", "protrain_core.planner.search", "protrain_core.planner.cost", sim),
        "protrain_core.api": (sim,),
        "protrain_core.autoplan": (sim,),
    }
    for layer, forbidden in rules.items():
        for m, deps in graph.items():
            if m.startswith(layer):
                bad = sorted(d for d in deps if d.startswith(forbidden))
                assert bad == [], f"{m} imports {bad}"


# The worker's own micro-benchmark times the runtime's parts directly, by design.
RUNTIME_BENCHMARKS = {"bench_adam.py"}


def test_the_lightning_adapters_use_the_engines_public_face_only():
    """lightning_protrain, the examples and the benchmarks drive the engine through its own
    methods and parts, never through the runtime behind it (``engine.scheduler``); the adapters
    import none of the runtime's modules, but for the optimizer check they share with ``wrap``."""
    offences = []
    paths = [*(ROOT / "lightning_protrain").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
             *(p for p in (ROOT / "benchmarks").rglob("*.py") if p.name not in RUNTIME_BENCHMARKS)]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "scheduler":
                offences.append(f"{path.name}:{node.lineno} .scheduler")
    graph = _graph("lightning_protrain")
    for m, path in _modules("lightning_protrain").items():
        for imported in _imports(path, set(_modules("protrain_core"))):
            if imported.startswith("protrain_core.runtime") and imported != "protrain_core.runtime.optim":
                offences.append(f"{m} imports {imported}")
    assert graph and offences == []


def test_planner_installs_no_hooks():
    """The planner is pure: it imports only the plan, the chunks' format records, the update's
    configuration (update.py: the schedule the cost model predicts), the utilities and itself,
    and registers nothing."""
    graph = _graph("protrain_core")
    for m, deps in graph.items():
        if not m.startswith("protrain_core.planner"):
            continue
        pure = {"protrain_core.plan", "protrain_core.chunk_format", "protrain_core.update", "protrain_core.utils"}
        assert deps <= pure | {d for d in graph if d.startswith("protrain_core.planner")}, m
        source = _modules("protrain_core")[m].read_text()
        assert "register_" not in source and "saved_tensors_hooks" not in source, m


# Private attributes that are read across objects on purpose.
ALLOWED_PRIVATE = {
    "_version",  # a tensor's version counter, for autograd's in-place check on swapped tensors
    "_protrain_engine",  # the engine's own marker on the module it wraps (no double wrap)
    # Lightning's launcher hook, which its connectors call on every strategy: ProTrain's strategies
    # call it on the DDP strategy they delegate the launch to (lightning_protrain/_common.py).
    "_configure_launcher",
    # The stream-order checker (simulator/races.py) inside a TorchDispatchMode: which arguments an
    # operator writes (its schema's alias annotations, as torch's own dispatch modes read them), and a
    # storage's identity (a meta storage has no data pointer).
    "_schema",
    "_cdata",
    # A Hugging Face model's initialisation of one module, which from_config and post_init run on
    # each: a model built on the meta device is initialised chunk by chunk (runtime/weights.py);
    # transformers has no public per-module form.
    "_init_weights",
    # torch.compile's wrapper of a module the user compiled (dynamo's OptimizedModule), which has no
    # public accessor: its module, and Lightning's record of the arguments it was compiled with
    # (runtime/compiled.py compiles each unit with them instead).
    "_orig_mod",
    "_compile_kwargs",
}


def test_no_module_reads_another_objects_private_attributes():
    offences = []
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                    continue
                base = node.value
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if isinstance(base, ast.Name) and base.id == "torch" or node.attr in ALLOWED_PRIVATE:
                    continue
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert offences == []


def test_the_engine_sets_its_parts_through_their_methods():
    """The engine hands the scheduler and the gradients their settings as immutable policies
    (``set_policy``), never by assigning their fields."""
    parts = {"scheduler", "grads", "ctx", "hooks", "activations", "step_state", "clipping", "states", "memory"}
    offences = []
    path = ROOT / "protrain_core" / "runtime" / "engine.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                owner = t.value if isinstance(t, ast.Attribute) else None
                if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and \
                        owner.value.id == "self" and owner.attr in parts:
                    offences.append(f"engine.py:{node.lineno} {ast.unparse(t)}")
    assert offences == []


def test_one_class_per_name():
    """No two classes of the library share a name (the engine ``wrap`` returns is ``Engine``;
    the runtime it extends, which the profiler also builds, is ``RuntimeEngine``)."""
    where: dict[str, list[str]] = {}
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_the_scheduler_and_the_storage_are_small():
    """Scheduler (the mechanism: fetch, offload, evict, update) and ChunkStorage (a chunk's
    tensors) have fewer than 30 methods each (properties included): which chunk gives its device
    buffer up is a policy of its own (``BufferPolicy``), and the ranks' usage check is
    ``UsageCheck``'s (sharding.py)."""
    for file, name in (("scheduler.py", "Scheduler"), ("storage.py", "ChunkStorage")):
        methods = _methods(_class(ROOT / "protrain_core" / "runtime" / file, name))
        assert len(methods) < 30, (name, len(methods), sorted(methods))


def _methods(cls: ast.ClassDef) -> list[str]:
    return [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _class(path, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_engine_is_thin():
    """The engine that ``wrap`` returns has at most 30 methods (properties included), its
    runtime base and the checkpoint verbs together: clipping, state access, memory and the
    step state are parts with faces of their own."""
    runtime = _methods(_class(ROOT / "protrain_core" / "runtime" / "engine.py", "RuntimeEngine"))
    verbs = _methods(_class(ROOT / "protrain_core" / "engine.py", "Engine"))
    assert len(runtime) + len(verbs) <= 30, sorted(runtime + verbs)


# Where the number of processes may decide anything: the collectives (sharding.py: a group of one
# returns at once), the chunk format record (its named property ``whole`` and the bytes it sizes),
# and the simulator and the command line, whose arguments say how many ranks to simulate (and the
# search's report, one sentence of it).
WORLD_BRANCHES = {"protrain_core/runtime/sharding.py", "protrain_core/chunk_format.py", "protrain_core/cli.py",
                  "protrain_core/simulator/run.py", "protrain_core/simulator/device.py", "protrain_core/planner/search.py"}
_WORLD_TEST = re.compile(r"world_size ?(==|>|<|!=|>=|<=)|\bworld ?(==|>|<|!=|>=|<=)")
_NO_GROUP = re.compile(r"sharding is (not )?None|Sharding \| None|sharding=None|sharding else|if (not )?sharding:")


def test_one_process_is_a_group_of_one():
    """``Sharding`` always exists (in one process the group of one, whose collectives return at
    once), so no code asks whether there is one; the number of processes decides something only
    in the collectives and the chunk format record (``whole``), which everything else asks."""
    branching = set()
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            name, text = str(path.relative_to(ROOT)), path.read_text()
            assert not _NO_GROUP.search(text), f"{name}: {_NO_GROUP.search(text).group()} (the group is never None)"
            tests = [n.test for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
            tests += [c for n in ast.walk(ast.parse(text)) if isinstance(n, ast.comprehension) for c in n.ifs]
            if any(_WORLD_TEST.search(ast.unparse(t)) for t in tests):
                branching.add(name)
    assert branching <= WORLD_BRANCHES, f"world-size branches outside the collectives: {sorted(branching - WORLD_BRANCHES)}"


def test_a_chunk_is_described_by_its_format_record():
    """The profile carries one record per chunk (``Profile.chunks``), not parallel per-chunk
    lists; records are made from the configuration in one place (``chunk_formats``), by hand
    nowhere else in the library (the cost model, the runtime and the profiler read them)."""
    import dataclasses

    from protrain_core.planner.profiles import Profile

    sequences = {f.name for f in dataclasses.fields(Profile) if str(f.type).startswith("tuple[")}
    assert sequences == {"chunks", "resident_sets", "segments", "ops"}
    makers = {str(path.relative_to(ROOT)) for package in LIBRARY for path in (ROOT / package).rglob("*.py")
              if re.search(r"\bChunkFormat\(", path.read_text())}
    assert makers == {"protrain_core/runtime/storage.py"}


ADDRESSING = re.compile(r"shards\.(device_offset|span_offset|state_piece|host_piece)\(")


def test_a_chunk_addresses_its_members_through_its_values():
    """Chunk keeps the lifecycle verbs; where a member is in a tensor on this rank is asked of
    ``ChunkValues`` (values.py), the one user outside storage.py of the shard layout's
    per-member answers."""
    owners = {"protrain_core/runtime/storage.py", "protrain_core/runtime/values.py"}
    offences = [f"{path.relative_to(ROOT)}: {m.group()}" for package in LIBRARY for path in (ROOT / package).rglob("*.py")
                if str(path.relative_to(ROOT)) not in owners for m in [ADDRESSING.search(path.read_text())] if m]
    assert offences == []
    assert ADDRESSING.search((ROOT / "protrain_core" / "runtime" / "values.py").read_text())


# Where an environment variable may set a default: the configuration's parts, and the profile
# cache's directory where the cache is read.
ENVIRONMENT_READERS = {"protrain_core/runtime/options.py", "protrain_core/config.py", "protrain_core/planner/profiles.py"}


def test_settings_come_from_the_configuration_not_the_environment():
    """A PROTRAIN_* variable only sets a default of ProTrainConfig, where the configuration is
    created: no other library module names one."""
    offences = []
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            where = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        node.value.startswith("PROTRAIN_") and where not in ENVIRONMENT_READERS:
                    offences.append(f"{where}:{node.lineno} {node.value}")
    assert offences == []


def test_importing_every_protrain_core_module_loads_no_lightning():
    code = (
        "import importlib, sys\n"
        f"for name in {sorted(_modules('protrain_core'))!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric', 'lightning_protrain'))\n"
        "print('LOADED', loaded)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED []" in r.stdout, r.stdout
    for m, deps in _graph("protrain_core").items():
        assert not any(d.startswith("lightning") for d in deps), m


def test_importing_protrain_core_loads_no_compiler_and_no_checkpoint_machinery():
    """Every process the suite and a user's launcher start imports protrain_core: dynamo (a
    second; ``torch.compiler.disable`` at import time pulled it in) and
    ``torch.distributed.checkpoint`` (half a second) load where they are used, not before.
    (Lightning's own import loads dynamo: the strategies' processes pay it anyway.)"""
    code = "import sys, protrain_core\n" \
           "print('LOADED', [m for m in ('torch._dynamo', 'torch.distributed.checkpoint') if m in sys.modules])\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED []" in r.stdout, r.stdout


def test_precision_names_come_from_one_table():
    """The strategies map Lightning's flags with protrain_core.precision's table: what the
    engine accepts, they accept (and refuse the rest with the same message)."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from lightning_protrain._common import precision_of_plugin
    from protrain_core.precision import ALIASES, parse_precision

    for flag in ALIASES:
        plugin = Precision()
        plugin.precision = flag
        assert precision_of_plugin(plugin, (Precision,)) == parse_precision(flag).value
    assert precision_of_plugin(MixedPrecision("bf16-mixed", "cpu"), (MixedPrecision,)) == "bf16-mixed"
    for bad in ("64-true", "16-true", "transformer-engine"):
        plugin = Precision()
        plugin.precision = bad
        with pytest.raises(ValueError, match=f"ProTrain does not support precision='{bad}'"):
            precision_of_plugin(plugin, (Precision,))
    library = "".join(p.read_text() for p in (ROOT / "lightning_protrain").rglob("*.py"))
    assert '"bf16-mixed": ' not in library  # no second table


def test_autocast_is_entered_once_per_forward(monkeypatch):
    """Fabric's forward context and the engine's hook on the module are the same autocast: it
    is entered once per forward call, not twice."""
    from lightning.fabric import Fabric

    import protrain_core as pt
    from conftest import batches, tiny_gpt2
    from lightning_protrain import ProTrainFabricStrategy

    entered = []
    original = torch.autocast.__enter__

    def counting(self):
        entered.append(self.fast_dtype)
        return original(self)

    fabric = Fabric(strategy=ProTrainFabricStrategy(pt.Plan(n_persist=1, n_buffer=2)), accelerator="cpu",
                    devices=1, precision="bf16-mixed")
    fabric.launch()
    model = tiny_gpt2()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    x = batches(1)[0]
    monkeypatch.setattr(torch.autocast, "__enter__", counting)
    loss = model(input_ids=x, labels=x).loss
    monkeypatch.undo()
    assert entered == [torch.bfloat16]
    fabric.backward(loss)
    engine = fabric.strategy.engine
    with torch.no_grad():  # the core API: engine.module's own hook
        monkeypatch.setattr(torch.autocast, "__enter__", counting)
        engine.module(input_ids=x)
        monkeypatch.undo()
    assert entered == [torch.bfloat16] * 2


def test_no_library_function_is_longer_than_60_lines():
    long = []
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > 60:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long == []


def test_every_package_is_installed():
    """pyproject.toml names every package and subpackage: a regular install (a wheel) ships
    only those, and a missing subpackage breaks ``import protrain_core`` there."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for package in LIBRARY:
        for init in (ROOT / package).rglob("__init__.py"):
            parts = list(init.parent.relative_to(ROOT).parts)
            found.add(".".join(["protrain_ops" if parts[0] == "ops" else parts[0], *parts[1:]]))
    assert found == listed
