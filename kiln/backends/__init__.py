"""Backends: Graph -> callable.

Input: a verified Graph. Output: a ``CompiledGraph`` (inputs in ``graph.inputs`` order ->
outputs then mutated-input values). ``eager`` (the reference interpreter) is registered here;
``kiln`` (Triton/C++ codegen) comes with the codegen issues. No core package imports this one.
"""

from kiln.backends import eager, kiln  # noqa: F401  (register the eager and kiln backends)
from kiln.backends.registry import (
    Backend,
    CompiledGraph,
    backend_names,
    get_backend,
    register_backend,
)

__all__ = ["Backend", "CompiledGraph", "backend_names", "get_backend", "register_backend"]
