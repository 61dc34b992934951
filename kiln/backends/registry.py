"""The backend registry and the interface every backend implements.

A backend turns a verified :class:`~kiln.ir.Graph` into a :data:`CompiledGraph`: a callable that
takes the graph's inputs (in ``graph.inputs`` order) and returns the graph's outputs followed by
the new values of mutated inputs, exactly like :func:`kiln.ir.interpret`. Writing mutations
back and rebuilding the user's return structure is the caller's job, so backends stay small.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kiln.errors import BackendError
from kiln.ir.graph import Graph
from kiln.options import Options

CompiledGraph = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


class Backend(Protocol):
    """Compiles graphs. ``name`` is how users select it: ``kiln.compile(f, backend=name)``;
    ``options`` are the compile's (the code generator, strict mode, ...)."""

    @property
    def name(self) -> str: ...

    def compile(self, graph: Graph, options: Options) -> CompiledGraph: ...


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make ``backend`` selectable by its name; a second backend of the same name is an error."""
    if backend.name in _BACKENDS:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(_BACKENDS))
        raise BackendError(f"unknown backend {name!r} (registered: {known})") from None


def backend_names() -> list[str]:
    return sorted(_BACKENDS)
