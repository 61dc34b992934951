"""The graph IR: what every stage of Kiln reads and writes.

Input: nothing (this is the bottom of the pipeline). Output: the data structures.

- :mod:`kiln.ir.types`: ``TensorType`` (shape, dtype, device, requires_grad).
- :mod:`kiln.ir.symbolic`: ``Sym``, symbolic sizes decided by guards in a ``ShapeEnv``.
- :mod:`kiln.ir.op`: the ``Op`` enum and the registry interface (rows live in ``kiln.ops``).
- :mod:`kiln.ir.graph`: ``Graph``, ``Node``, ``Value`` (SSA), ``Origin``, ``InputKind``.
- :mod:`kiln.ir.builder`: the active ``GraphBuilder`` that prims emit into.
- :mod:`kiln.ir.printer`: a graph prints as runnable Python with each node's origin.
- :mod:`kiln.ir.verify`: the invariants; every pass's output passes ``verify``.
- :mod:`kiln.ir.interpreter`: the reference interpreter, the oracle of every backend.
- :mod:`kiln.ir.hashing`: a stable structural hash for caches.

Invariant: this package imports no later stage of the pipeline.
"""

from kiln.ir.builder import GraphBuilder, active_builder, emit
from kiln.ir.graph import Graph, InputKind, Node, Operand, Origin, Value
from kiln.ir.hashing import graph_hash
from kiln.ir.interpreter import interpret, run
from kiln.ir.op import Op, OpDef, Sample, Tag, op_def, register, registered_ops
from kiln.ir.printer import format_graph, load_printed
from kiln.ir.symbolic import ShapeEnv, Sym
from kiln.ir.types import Dim, Shape, TensorType
from kiln.ir.verify import verify

__all__ = [
    "Dim",
    "Graph",
    "GraphBuilder",
    "InputKind",
    "Node",
    "Op",
    "OpDef",
    "Operand",
    "Origin",
    "Sample",
    "Shape",
    "ShapeEnv",
    "Sym",
    "Tag",
    "TensorType",
    "Value",
    "active_builder",
    "emit",
    "format_graph",
    "graph_hash",
    "interpret",
    "load_printed",
    "op_def",
    "register",
    "registered_ops",
    "run",
    "verify",
]
