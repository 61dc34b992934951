"""The shared mechanics of passes that replace single nodes by a few prims.

A pass decides, per node, whether it rewrites it; :func:`rewrite_nodes` rebuilds the graph with
each chosen node's replacement emitted in its place (through the prims, so the new nodes get
types and origins), and :func:`take_over` makes the replacement's last value the old output
Value, so every later reader, output and mutation stays connected without renaming.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value

Emit = Callable[[Node, GraphBuilder], None]


def rewrite_nodes(graph: Graph, chosen: set[Node], emit: Emit) -> Graph:
    """``graph`` with ``emit(node, builder)`` in place of every node in ``chosen``."""
    if not chosen:
        return graph
    result = copy.copy(graph)
    result.nodes = []
    builder = GraphBuilder(result)
    with builder:
        for node in graph.nodes:
            if node in chosen:
                emit(node, builder)
            else:
                result.nodes.append(node)
    return result


def take_over(output: Value, replacement: Value) -> None:
    """Make the node computing ``replacement`` compute ``output`` instead."""
    node = replacement.node
    assert node is not None, "a replacement is computed by a node"
    node.outputs = (output,)
    output.node = node
