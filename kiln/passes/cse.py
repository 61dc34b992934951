"""Common-subexpression elimination: a node equal to an earlier one reuses its outputs.

Two nodes are equal when they apply the same op with equal attributes to the same operands
(Values by identity, scalars by type and value). Random nodes differ by their offsets, so they
never merge; extern nodes are left alone (an opaque function may draw random numbers)::

    before:  t0 = mul(g, x); t1 = mul(g, x); t2 = add(t0, t1)
    after:   t0 = mul(g, x); t2 = add(t0, t0)
"""

from __future__ import annotations

import copy
from typing import Any

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op


def _operand_key(operand: Any) -> Any:
    if isinstance(operand, Value):
        return ("value", id(operand))
    return ("scalar", type(operand).__name__, repr(operand))


def _key(node: Node) -> Any | None:
    if node.op is Op.EXTERN:
        return None
    try:
        hash(node.attrs)
    except TypeError:
        return None
    return (node.op, node.attrs, tuple(_operand_key(operand) for operand in node.inputs))


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """``graph`` without repeated computations (see the package docstring on sharing)."""
    result = copy.copy(graph)
    replaced: dict[Value, Value] = {}
    seen: dict[Any, Node] = {}
    nodes: list[Node] = []
    for node in graph.nodes:
        inputs = tuple(replaced.get(i, i) if isinstance(i, Value) else i for i in node.inputs)
        if inputs != node.inputs:
            node = Node(node.op, inputs, node.attrs, node.outputs, node.origin)
            for output in node.outputs:
                output.node = node
        key = _key(node)
        earlier = seen.get(key) if key is not None else None
        if earlier is not None and all(
            a.type == b.type for a, b in zip(earlier.outputs, node.outputs, strict=True)
        ):
            replaced.update(zip(node.outputs, earlier.outputs, strict=True))
            continue
        if key is not None:
            seen[key] = node
        nodes.append(node)
    result.nodes = nodes
    result.outputs = [replaced.get(v, v) for v in graph.outputs]
    result.mutations = [(target, replaced.get(new, new)) for target, new in graph.mutations]
    return result
