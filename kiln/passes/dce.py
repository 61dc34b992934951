"""Dead-code elimination: nodes whose outputs nothing reads are dropped.

Every prim is pure, so a node is dead when none of its outputs is a graph output, a mutation's
new value, or an operand of a live node::

    before:  t0 = exp(x); t1 = sin(x); return (t1,)
    after:   t1 = sin(x); return (t1,)
"""

from __future__ import annotations

import copy

from kiln.ir.graph import Graph, Value


def eliminate_dead_code(graph: Graph) -> Graph:
    """``graph`` with only the nodes its results need (see the package docstring on sharing)."""
    live: set[Value] = set(graph.outputs) | {new for _, new in graph.mutations}
    kept = []
    for node in reversed(graph.nodes):
        if any(output in live for output in node.outputs):
            kept.append(node)
            live.update(node.input_values())
    result = copy.copy(graph)
    result.nodes = kept[::-1]
    return result
