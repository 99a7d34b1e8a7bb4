"""Weights for a model built on the meta device, one tensor at a time as its chunks are filled.

[Note: weights straight into chunks]
A model too large for the host's memory twice over is built on the meta device
(``init_module(empty_init=True)``) and wrapped as it is: the engine fills each chunk in turn,
and every parameter of it still on the meta device takes its value here, just before the chunk
copies it in: from ``ProTrainConfig.weights`` where that holds it (the sources are listed there;
a sharded ProTrain checkpoint directory is read by the engine itself once ``wrap`` has built
it), else from the module's own initialisation (a LoRA layer's, the Hugging Face model's, else
``reset_parameters``).

The parameter keeps its identity (``torch.utils.swap_tensors``): the optimizer holds the same
objects. A value is read (memory-mapped) only when its chunk is filled and let go once copied
in, so the host holds the chunks plus the values of the one being filled. Checkpoint names match
the model's after leading components are dropped on either side (``model.``,
``base_model.model.``) and PEFT's ``.base_layer`` is skipped.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from protrain_core.utils import has_meta

_BASE_LAYER = ".base_layer"


def check_weights(model: nn.Module, source) -> None:
    """``ProTrainConfig.weights`` refused before anything is built where it cannot apply."""
    if source is None:
        return
    if not has_meta(model):
        raise ValueError(
            "ProTrainConfig.weights fills a model built on the meta device, but this model's parameters "
            "all hold values already. Build it under torch.device('meta') (or init_module(empty_init=True)), or load "
            "the checkpoint into it yourself and leave weights=None.")
    if not isinstance(source, Mapping) and not Path(source).exists():
        raise FileNotFoundError(f"ProTrainConfig.weights={str(source)!r} does not exist.")


def meta_names(model: nn.Module) -> list[str]:
    """The parameters and buffers of ``model`` on the meta device."""
    return [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]


def back_to_meta(model: nn.Module, names: list[str]) -> None:
    """These parameters and buffers (``names``) of ``model`` on the meta device again."""
    for name in names:
        module_name, _, attr = name.rpartition(".")
        _to_empty(model.get_submodule(module_name), attr, torch.device("meta"))


class Weights:
    """Where the meta-device tensors of ``model`` take their values (see the note above)."""

    def __init__(self, model: nn.Module, source, host: torch.device) -> None:
        """``source``: a path (see the note), a state dict, or None (every tensor initialised)."""
        self.model, self.host = model, host
        self._files: dict[str, Path] = {}  # key -> safetensors file
        self._state: Mapping[str, Tensor] | None = None  # a state dict (a torch.save'd one memory-mapped)
        self.where = None if source is None else "the state dict given" if isinstance(source, Mapping) else str(source)
        if isinstance(source, Mapping):
            self._state = source
        elif source is not None:
            self._open(Path(source))
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
        self._key = _match(names, self._keys())
        if self.where is not None and names and not self._key:
            raise ValueError(
                f"ProTrainConfig.weights: {self.where} holds none of the model's parameters under any prefix (its "
                f"first keys: {sorted(self._keys())[:3]}; the model's: {names[:3]}). Give the checkpoint of this model.")
        self._saved = set(model.state_dict())  # (not a non-persistent buffer: a checkpoint would hold it)
        self.initialised: list[str] = []  # (saved names filled by their module's initialisation)

    def _open(self, path: Path) -> None:
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                for key, file in json.loads(index.read_text())["weight_map"].items():
                    self._files[key] = path / file
            else:
                for file in sorted(path.glob("*.safetensors")):
                    self._index_safetensors(file)
            if not self._files:
                raise ValueError(f"ProTrainConfig.weights={str(path)!r} is a directory without safetensors files "
                                 "(a Hugging Face model directory, save_pretrained's output, has them) and not a "
                                 "sharded ProTrain checkpoint (save_sharded's, with its .metadata).")
        elif path.suffix == ".safetensors":
            self._index_safetensors(path)
        else:  # (check_weights refused a missing path before anything was built)
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self._state = state.get("state_dict", state) if isinstance(state, dict) else None
            if not isinstance(self._state, dict):
                raise ValueError(f"ProTrainConfig.weights={str(path)!r} holds no state dict (a dict of tensors, or a "
                                 "Lightning checkpoint's 'state_dict').")

    def _index_safetensors(self, file: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                self._files[key] = file

    def _keys(self) -> set[str]:
        return set(self._files) | ({k for k, v in self._state.items() if isinstance(v, Tensor)} if self._state else set())

    def _read(self, key: str) -> Tensor:
        if self._state is not None:
            return self._state[key]
        from safetensors import safe_open

        with safe_open(str(self._files[key]), "pt") as f:  # mapped for this tensor only
            return f.get_tensor(key)

    def fill(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Give each parameter of ``named`` still on the meta device its value, on the host."""
        for name, p in named:
            if not p.is_meta:
                continue
            key = self._key.get(name)
            if key is None:
                self._initialise(name)
                continue
            value = self._read(key)
            if value.shape != p.shape:
                raise ValueError(f"{name}: the model's parameter is {tuple(p.shape)}, {key!r} in {self.where} is "
                                 f"{tuple(value.shape)}; the checkpoint is of another model configuration.")
            # (the file's own pages where the dtype matches: the chunk copies them in, then lets go)
            torch.utils.swap_tensors(p, nn.Parameter(value.to(self.host, p.dtype), requires_grad=p.requires_grad))
            del value

    def fill_buffers(self) -> None:
        """The model's buffers still on the meta device (a checkpoint holds the persistent ones; a
        rotary embedding's frequencies are computed by its initialisation)."""
        for name, b in list(self.model.named_buffers()):
            if not b.is_meta:
                continue
            module_name, _, attr = name.rpartition(".")
            key = self._key.get(name)
            if key is None:
                self._initialise(name, buffer=True)
            else:
                setattr(self.model.get_submodule(module_name), attr, self._read(key).to(self.host, b.dtype, copy=True))

    def warn_initialised(self) -> None:
        """A checkpoint that left parameters to their initialisation says which."""
        if self.where is not None and self.initialised:
            shown = ", ".join(self.initialised[:4]) + (", ..." if len(self.initialised) > 4 else "")
            warnings.warn(f"ProTrain: {len(self.initialised)} tensor(s) of the model are not in {self.where} and were "
                          f"initialised by their modules: {shown}.", stacklevel=2)

    def _initialise(self, name: str, buffer: bool = False) -> None:
        """``name``'s module initialised as the model's own code does, its loaded tensors kept."""
        module_name = name.rpartition(".")[0]
        module = self.model.get_submodule(module_name)
        lora = _lora_layer(self.model, module_name)
        if lora is not None:
            layer, adapter = lora
            layer_name = module_name[:module_name.rindex(".lora_")]
            for d in ("lora_A", "lora_B"):
                if adapter in getattr(layer, d, {}):
                    self._materialise(getattr(layer, d)[adapter], f"{layer_name}.{d}.{adapter}")
            layer.reset_lora_parameters(adapter, True)
        else:
            init = _initialiser(self.model, module_name)
            if init is None:
                kind = "buffer" if buffer else "parameter"
                raise ValueError(
                    f"The model's {kind} {name!r} is on the meta device and neither ProTrainConfig.weights holds it "
                    f"nor can its module ({type(module).__name__}) initialise it (no reset_parameters, not part of a "
                    "Hugging Face model). Give weights= a checkpoint that holds it, or build this module on the host.")
            kept = {k: t.detach().clone() for k, t in _own(module) if not t.is_meta}
            self._materialise(module, module_name)
            init(module)
            with torch.no_grad():
                for k, t in _own(module):
                    if k in kept:
                        t.copy_(kept[k])

    def _materialise(self, module: nn.Module, module_name: str) -> None:
        """The module's own meta tensors on the host, uninitialised (its initialisation follows)."""
        for k, t in _own(module):
            if not t.is_meta:
                continue
            _to_empty(module, k, self.host)
            name = f"{module_name}.{k}" if module_name else k
            if name in self._saved:
                self.initialised.append(name)


def _to_empty(module: nn.Module, attr: str, device: torch.device) -> None:
    """``module``'s parameter or buffer ``attr`` replaced by an uninitialised one on ``device`` (a
    parameter keeps its identity: ``torch.utils.swap_tensors``)."""
    t = getattr(module, attr)
    if isinstance(t, nn.Parameter):
        torch.utils.swap_tensors(t, nn.Parameter(torch.empty_like(t, device=device), requires_grad=t.requires_grad))
    else:
        setattr(module, attr, torch.empty_like(t, device=device))


def _own(module: nn.Module):
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _lora_layer(model: nn.Module, module_name: str):
    """(PEFT's LoRA layer, adapter name) when ``module_name`` is one of its adapter modules."""
    parts = module_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] in ("lora_A", "lora_B") and i + 1 < len(parts):
            layer = model.get_submodule(".".join(parts[:i]))
            if hasattr(layer, "reset_lora_parameters"):
                return layer, parts[i + 1]
    return None


def _initialiser(model: nn.Module, module_name: str):
    """The module's initialisation: its Hugging Face model's ``_init_weights``, else its own
    ``reset_parameters``; None where neither exists."""
    parts = module_name.split(".") if module_name else []
    for i in range(len(parts), -1, -1):  # the module and each one above it
        ancestor = model.get_submodule(".".join(parts[:i]))
        if hasattr(ancestor, "_init_weights") and hasattr(ancestor, "config"):
            return ancestor._init_weights
    module = model.get_submodule(module_name)
    reset = getattr(module, "reset_parameters", None)
    return (lambda m: reset()) if callable(reset) else None


def _match(names: list[str], keys: set[str]) -> dict[str, str]:
    """The checkpoint key of each model name: the renaming (leading components dropped from the
    names, from the keys; PEFT's ``.base_layer`` skipped) that matches the most names, one to one."""
    best: dict[str, str] = {}
    plain = {n: n.replace(_BASE_LAYER, "") for n in names}
    for drop_key in range(3):
        by_key = _tails({k: k for k in keys}, drop_key)
        for drop_name in range(4):
            by_name = _tails(plain, drop_name)
            if by_key is not None and by_name is not None:
                found = {n: by_key[t] for t, n in by_name.items() if t in by_key}
                if len(found) > len(best):
                    best = found
    return best


def _tails(names: dict[str, str], drop: int) -> dict[str, str] | None:
    """Each name of ``names`` (name -> its form to cut) by its form's tail after ``drop`` leading
    components, where two are left (a bare "weight" names nothing); None if two share a tail."""
    by_tail = {}
    for name, form in names.items():
        parts = form.split(".")
        if drop == 0 or len(parts) >= drop + 2:
            tail = ".".join(parts[drop:])
            if tail in by_tail:
                return None
            by_tail[tail] = name
    return by_tail
