"""A stable structural hash of a graph, the key of compiled-artifact caches.

Two graphs hash equal when they have the same inputs (types and kinds), the same nodes (ops,
attributes, operand structure) and the same outputs and mutations, whatever their value names
and origins. The hash is stable across processes (no ``id``/``hash`` of objects).
"""

from __future__ import annotations

import hashlib

from kiln.ir.graph import Graph, Value
from kiln.ir.printer import format_value


def graph_hash(graph: Graph) -> str:
    """Hex sha256 of ``graph``'s structure."""
    canonical: dict[Value, str] = {}

    def name(value: Value) -> str:
        return canonical[value]

    lines = []
    for index, value in enumerate(graph.inputs):
        canonical[value] = f"i{index}"
        kind = value.kind.value if value.kind else "?"
        lines.append(f"input i{index} {value.type} {kind}")
    counter = 0
    for node in graph.nodes:
        operands = [name(i) if isinstance(i, Value) else format_value(i) for i in node.inputs]
        outs = []
        for out in node.outputs:
            canonical[out] = f"v{counter}"
            outs.append(f"v{counter}:{out.type}")
            counter += 1
        attrs = format_value(node.attrs) if node.attrs is not None else ""
        lines.append(f"{','.join(outs)} = {node.op.name}({','.join(operands)}) {attrs}")
    lines.append("outputs " + ",".join(name(v) for v in graph.outputs))
    lines.append(f"user outputs {graph.user_outputs}")
    lines.append("mutations " + ",".join(f"{name(t)}<-{name(n)}" for t, n in graph.mutations))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
