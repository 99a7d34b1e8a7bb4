"""Small helpers shared by the runtime, the activation manager and the memory tracker."""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor


def iter_tensors(obj) -> Iterator[Tensor]:
    """The tensors in ``obj``, looking into dicts, lists and tuples (model outputs, arguments)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
