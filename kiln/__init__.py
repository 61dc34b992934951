"""Kiln: a just-in-time compiler for PyTorch programs.

The pipeline (see docs/architecture.md)::

    user code --frontends--> Graph (prims) --backends--> callable
                kiln/frontends  kiln/ir, kiln/ops   kiln/backends

``kiln.trace(fn, *inputs)`` gives the graph of a function or module; ``kiln.ir`` prints,
verifies and interprets it; ``kiln.backends.get_backend("eager")`` runs it.
"""

from kiln import (
    backends,  # noqa: F401  (registers the built-in backends)
    ops,  # noqa: F401  (registers every op row and translation)
)
from kiln.api import (
    BreakReason,
    CompiledModule,
    SkipReason,
    compile,
    counters,
    explain,
    graph_break,
    reset,
)
from kiln.errors import KilnError, TraceError
from kiln.frontends import run_traced, trace
from kiln.ir import Graph

__version__ = "0.1.0"

__all__ = [
    "BreakReason",
    "CompiledModule",
    "Graph",
    "KilnError",
    "SkipReason",
    "TraceError",
    "__version__",
    "compile",
    "counters",
    "explain",
    "graph_break",
    "reset",
    "run_traced",
    "trace",
]
