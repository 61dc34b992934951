"""Backends: Graph -> callable.

Input: a verified Graph. Output: a ``CompiledGraph`` (inputs in ``graph.inputs`` order ->
outputs then mutated-input values). ``eager`` runs the reference interpreter; ``kiln`` (the
default) schedules, generates and loads kernels (``kiln.py``; ``kernels.py`` picks each device's
generator and loads what it printed); ``numpy`` is the worked example of a backend for a new
device (``numpy/``; docs/backends.md). ``split.py`` gives a backend that declares its
capabilities the subgraphs it supports. Only the pipeline and the tools import this package.
"""

from kiln.backends import eager, kiln  # noqa: F401  (register the built-in backends)

try:  # the worked example runs on NumPy, which PyTorch does not require
    from kiln.backends import numpy  # noqa: F401
except ModuleNotFoundError as missing:
    if missing.name != "numpy":
        raise
from kiln.backends.registry import (
    Backend,
    BackendRecord,
    Capabilities,
    CompiledGraph,
    CompileFn,
    add_backend,
    get_backend,
    list_backends,
    lookup_backend,
    register_backend,
)
from kiln.backends.split import compile_split

__all__ = [
    "Backend",
    "BackendRecord",
    "Capabilities",
    "CompileFn",
    "CompiledGraph",
    "add_backend",
    "compile_split",
    "get_backend",
    "list_backends",
    "lookup_backend",
    "register_backend",
]
