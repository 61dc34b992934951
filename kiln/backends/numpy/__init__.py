"""The ``numpy`` backend: the worked example of a backend for a new device (docs/backends.md).

NumPy stands in for a chip: its memory is NumPy arrays (``device.py``: transfers at the
boundary of each graph it runs), its kernels are generated Python functions with elementwise
chains fused (``kernels.py``), and its capability table (``spellings.py``) says which prims
and dtypes it runs, so the pipeline's partitioner sends everything else to the default
backend::

    kiln.compile(model, backend="numpy")(x)   # matmuls, reductions, fused chains on NumPy
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.backends.numpy.device import NumpyProgram, counters
from kiln.backends.numpy.spellings import CAPABILITIES
from kiln.backends.registry import Capabilities, CompiledGraph, add_backend
from kiln.ir.graph import Graph
from kiln.options import Options


@dataclass(frozen=True)
class NumpyBackend:
    name: str = "numpy"
    capabilities: Capabilities = CAPABILITIES

    def compile(self, graph: Graph, options: Options) -> CompiledGraph:
        return NumpyProgram(graph)


add_backend(NumpyBackend())

__all__ = ["NumpyBackend", "counters"]
