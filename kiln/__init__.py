"""Kiln: a just-in-time compiler for PyTorch programs.

The pipeline (``kiln/pipeline.py``; docs/architecture.md)::

    user code --capture--> Graph (prims) --passes--> --autodiff--> --backend--> callable
              kiln/capture  kiln/ir, kiln/ops                      schedule -> codegen -> runtime

``kiln.compile(fn)`` compiles a function or module; ``kiln.trace(fn, *inputs)`` gives the graph
of one call; ``kiln.ir`` prints, verifies and interprets graphs;
``kiln.backends.get_backend("eager").compile(graph, kiln.options.Options())`` runs one.
"""

from kiln import (
    backends,  # noqa: F401  (registers the built-in backends)
    lazy,  # noqa: F401  (kiln.lazy: the lazy-tensor frontend)
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
    mark_dynamic,
    mark_static,
    mark_step_begin,
    reset,
)
from kiln.errors import KilnError, TraceError
from kiln.frontends import register_lowering, run_traced, trace
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
    "mark_dynamic",
    "mark_static",
    "mark_step_begin",
    "register_lowering",
    "reset",
    "run_traced",
    "trace",
]
