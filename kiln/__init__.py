"""Kiln: a just-in-time compiler for PyTorch programs.

The pipeline (``kiln/pipeline.py``; docs/architecture.md)::

    user code --capture--> Graph (prims) --passes--> --autodiff--> --backend--> callable
              kiln/capture  kiln/ir, kiln/ops                      schedule -> codegen -> runtime

``kiln.compile(fn)`` compiles a function or module; ``kiln.trace(fn, *inputs)`` gives the graph
of one call; ``kiln.export(fn, args)`` gives it as a program to save and ``kiln.load``
elsewhere; ``kiln.ir`` prints, verifies and interprets graphs;
``kiln.get_backend("eager")(graph, inputs)(inputs)`` runs one. ``kiln.register_backend(name,
compile_fn)`` adds a backend (docs/backends.md); ``kiln.testing.check_backend(name)`` checks one.
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
from kiln.backends import get_backend, list_backends, register_backend
from kiln.errors import KilnError, TraceError
from kiln.exported import Dim, ExportedProgram, ExportError, ExportFileError, export, load
from kiln.frontends import from_fx, register_lowering, run_traced, to_fx, trace
from kiln.ir import Graph

__version__ = "0.1.0"

__all__ = [
    "BreakReason",
    "CompiledModule",
    "Dim",
    "ExportError",
    "ExportFileError",
    "ExportedProgram",
    "Graph",
    "KilnError",
    "SkipReason",
    "TraceError",
    "__version__",
    "compile",
    "counters",
    "explain",
    "export",
    "from_fx",
    "get_backend",
    "graph_break",
    "list_backends",
    "load",
    "mark_dynamic",
    "mark_static",
    "mark_step_begin",
    "register_backend",
    "register_lowering",
    "reset",
    "run_traced",
    "to_fx",
    "trace",
]
