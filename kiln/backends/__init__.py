"""Backends: Graph -> callable.

Input: a verified Graph. Output: a ``CompiledGraph`` (inputs in ``graph.inputs`` order ->
outputs then mutated-input values). ``eager`` runs the reference interpreter; ``kiln`` (the
default) schedules, generates and loads kernels (``kiln.py``; ``kernels.py`` picks each device's
generator and loads what it printed). Only the pipeline and the tools import this package.
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
