"""The numpy backend's kernels: a graph cut into kernels, each printed as one Python function.

A run of elementwise ops and free views (in graph order) fuses into one kernel; any other op
(a reduction, a matmul, ``cat``) is a kernel of its own. Inside a fused kernel no torch tensor
is made, and each ufunc writes into the buffer of an operand that dies there (``out=``) when
shapes and dtypes agree, so a chain of elementwise ops fills one array::

    # sigmoid(x * w + b) * 2: four ops, one allocation
    def kernel_0(v_x, v_w, v_b):
        v_t0 = np.multiply(v_x, v_w)
        v_t1 = np.add(v_t0, v_b, out=v_t0)
        v_t2 = 1 / (1 + np.exp(-v_t1))
        v_t3 = np.multiply(v_t2, 2.0, out=v_t2)
        return (v_t3,)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.backends.numpy.spellings import UFUNCS, VIEWS, fusible, literal, spell
from kiln.ir.graph import Graph, Node, Value


@dataclass
class NumpyKernel:
    """One kernel: its nodes, the values it reads and returns, its source and function."""

    name: str
    nodes: list[Node]
    inputs: list[Value]
    outputs: list[Value]
    source: str
    function: Callable[..., tuple[Any, ...]]

    def line(self) -> str:
        """``kernel_0 (fused 4 ops): mul, add, sigmoid`` (what ``kiln.explain`` lists)."""
        ops = ", ".join(dict.fromkeys(node.op.printed_name for node in self.nodes))
        fused = f"fused {len(self.nodes)} ops" if len(self.nodes) > 1 else "1 op"
        return f"numpy {self.name} ({fused}): {ops}"


def plan_kernels(graph: Graph) -> list[NumpyKernel]:
    """The kernels computing ``graph``, in order."""
    groups: list[list[Node]] = []
    for node in graph.nodes:
        if fusible(node) and groups and all(fusible(other) for other in groups[-1]):
            groups[-1].append(node)
        else:
            groups.append([node])
    needed = {*graph.outputs, *(new for _, new in graph.mutations)}
    for nodes in groups:
        inside = {value for node in nodes for value in node.outputs}
        needed.update(v for node in nodes for v in node.input_values() if v not in inside)
    users = graph.users()
    return [generate(f"kernel_{i}", nodes, needed, users) for i, nodes in enumerate(groups)]


def generate(
    name: str, nodes: list[Node], needed: set[Value], users: dict[Value, list[Node]]
) -> NumpyKernel:
    """One kernel's function; ``needed`` are the values read outside their kernel."""
    inside = {value for node in nodes for value in node.outputs}
    inputs = list(
        dict.fromkeys(v for node in nodes for v in node.input_values() if v not in inside)
    )
    outputs = [value for node in nodes for value in node.outputs if value in needed]
    last_use = {value: node for node in nodes for value in node.input_values()}
    owned: set[Value] = set()  # arrays this kernel made that nothing aliases
    lines = [f"def {name}({', '.join(_name(v) for v in inputs)}):"]
    for node in nodes:
        args = [_name(o) if isinstance(o, Value) else literal(o) for o in node.inputs]
        expression = spell(node, args)
        out = node.output
        reused = [
            value
            for value in node.input_values()
            if value in owned
            and value not in needed
            and last_use[value] is node
            and value.type.shape == out.type.shape
            and value.type.dtype == out.type.dtype
            and not any(user.op in VIEWS for user in users[value])
        ]
        if node.op in UFUNCS and reused:
            expression = f"{expression[:-1]}, out={_name(reused[0])})"
        lines.append(f"    {_name(out)} = {expression}")
        if node.op not in VIEWS and out.type.rank > 0:  # a new array (in-kernel ops make one)
            owned.add(out)
    lines.append(f"    return ({', '.join(_name(v) for v in outputs)},)")
    source = "\n".join(lines) + "\n"
    scope: dict[str, Any] = {"np": np}
    exec(compile(source, f"<kiln numpy {name}>", "exec"), scope)
    return NumpyKernel(name, nodes, inputs, outputs, source, scope[name])


def _name(value: Value) -> str:
    """A value's variable (prefixed: a graph value may be named ``np``)."""
    return f"v_{value.name}"
