"""Print a graph as runnable Python.

``format_graph`` gives a module that imports the prims and defines one function; calling it
with tensors runs each prim's reference implementation, so a printed graph is its own
executable spec::

    import torch
    from kiln.ops.prims import *

    def forward(x: "f32[2, 3]", y: "f32[2, 3]"):
        t0 = add(x, y)  # torch.add  model.py:12
        t1 = sum(t0, dims=(1,))  # torch.Tensor.sum  model.py:13
        return (t1,)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
from typing import Any

import torch

from kiln.ir.graph import Graph, Node, Value

HEADER = "import torch\nfrom kiln.ops.prims import *\n"

_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch", torch),
    ("torch.nn.functional", torch.nn.functional),
    ("torch.Tensor", torch.Tensor),
    ("torch.special", torch.special),
    ("torch.linalg", torch.linalg),
    ("torch.fft", torch.fft),
)


@functools.cache
def _public_names() -> dict[int, str]:
    """id of each public callable of the torch namespaces -> its dotted public name."""
    names: dict[int, str] = {}
    for prefix, namespace in reversed(_NAMESPACES):
        for attr in dir(namespace):
            if not attr.startswith("_") or attr.startswith("__"):
                obj = getattr(namespace, attr, None)
                if callable(obj):
                    names[id(obj)] = f"{prefix}.{attr}"
    return names


def public_name(fn: Any) -> str | None:
    """The public dotted name of a torch callable, or None if it has none."""
    try:
        return _public_names().get(id(fn))
    except Exception:  # a namespace attribute that fails on access
        return None


def callable_name(fn: Any) -> str:
    """An importable dotted name for ``fn`` (``torch.nn.functional.gelu``)."""
    public = public_name(fn)
    if public is not None:
        return public
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def format_value(value: Any) -> str:
    """Python source for an attribute value or scalar operand."""
    if isinstance(value, Value):
        return value.name
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, tuple):
        inner = ", ".join(format_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(
        value, types.BuiltinFunctionType | types.FunctionType | types.MethodDescriptorType
    ):
        return callable_name(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(
            f"{f.name}={format_value(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({fields})"
    return repr(value)


def format_node(node: Node, *, origins: bool = True) -> str:
    args = [format_value(operand) for operand in node.inputs]
    if node.attrs is not None:
        args += [
            f"{f.name}={format_value(getattr(node.attrs, f.name))}"
            for f in dataclasses.fields(node.attrs)
        ]
    targets = ", ".join(out.name for out in node.outputs)
    if len(node.outputs) > 1:
        targets = f"{targets}"
    line = f"{targets} = {node.op.printed_name}({', '.join(args)})"
    if origins and node.origin.api:
        line += f"  # {node.origin}"
    return line


def format_graph(graph: Graph, *, origins: bool = True, header: bool = True) -> str:
    params = ", ".join(f'{value.name}: "{value.type}"' for value in graph.inputs)
    lines = [HEADER + _imports(graph), ""] if header else []
    lines.append(f"def {graph.name}({params}):")
    lines += ["    " + format_node(node, origins=origins) for node in graph.nodes]
    for target, new in graph.mutations:
        lines.append(f"    # mutation: {target.name} ({target.source}) <- {new.name}")
    results = [v.name for v in graph.outputs] + [new.name for _, new in graph.mutations]
    returned = ", ".join(results) + ("," if len(results) == 1 else "")
    lines.append(f"    return ({returned})")
    return "\n".join(lines) + "\n"


def _imports(graph: Graph) -> str:
    """Imports the printed nodes need beyond the prims: modules of extern callables that are
    not torch's, and attribute classes printed inside arguments (a backward's extern holds its
    forward's ``ExternAttrs``)."""
    modules: set[str] = set()
    classes: set[type] = set()

    def visit(value: Any) -> None:
        if isinstance(value, Value | Node | type | enum.Enum):
            return
        if isinstance(value, tuple | list):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            classes.add(type(value))
            for item in dataclasses.fields(value):
                visit(getattr(value, item.name))
        elif callable(value) and public_name(value) is None:
            module = getattr(value, "__module__", None)
            if module and module.split(".")[0] != "torch":
                modules.add(module)

    for node in graph.nodes:
        if node.attrs is not None:
            for item in dataclasses.fields(node.attrs):
                visit(getattr(node.attrs, item.name))
        for operand in node.inputs:
            visit(operand)
    lines = [f"import {module}" for module in sorted(modules)]
    lines += [
        f"from {cls.__module__} import {cls.__name__}"
        for cls in sorted(classes, key=lambda c: c.__name__)
        if cls.__module__ != "kiln.ops.attrs" or cls.__name__ != "Slot"
    ]
    return "".join(f"{line}\n" for line in lines)


def load_printed(graph: Graph) -> Any:
    """Execute the printed graph and return its function (a test of the printer's promise)."""
    namespace: dict[str, Any] = {}
    exec(compile(format_graph(graph), f"<kiln graph {graph.name}>", "exec"), namespace)
    return namespace[graph.name]
