"""Mutations: which mutated graph inputs a kernel writes in place.

The graph is functional: an in-place op on a graph input (a BatchNorm's running statistics)
becomes a new value, listed with the input in ``Graph.mutations``, and whoever runs the graph
copies it into the input afterwards. When the new value can be computed into the input's own
memory without any kernel reading an element that was already overwritten, the kernel computing
it stores it there, and the write-back copy has nothing to do.
"""

from __future__ import annotations

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Tag, op_def
from kiln.schedule.lowering import REDUCE_KINDS, in_kernels, shape_of
from kiln.schedule.program import View
from kiln.schedule.views import VIEW_OPS, is_dense


def in_place_mutations(
    graph: Graph, users: dict[Value, list[Node]], layouts: dict[Value, View]
) -> dict[Value, Value]:
    """New values of mutated inputs that a kernel can store into the input itself (new
    value -> input): when every reader of the old value is elementwise work of the same
    shape that ends only in the new value (a BatchNorm's running mean, ``0.9 * rm + 0.1 *
    mean``), each element is read by the kernel that writes it, at the same position, or
    by an earlier kernel. The write-back copy (159 launches a ResNet-50 training step)
    then has nothing to do. ``layouts``: how the graph inputs are laid out."""
    outputs = set(graph.outputs)
    result: dict[Value, Value] = {}
    for target, new in graph.mutations:
        layout = layouts.get(target)
        node = new.node
        if (
            layout is None
            or target in outputs
            or new in outputs
            or node is None
            or not in_kernels(node)
            or node.op in REDUCE_KINDS
            or node.op in VIEW_OPS
            or new.type.dtype != target.type.dtype
            or shape_of(new) != shape_of(target)
            or not is_dense(layout)
            or 0 in layout.strides
        ):
            continue
        if _only_feeds(users, target, new, outputs):
            result[new] = target
    return result


def _only_feeds(
    users: dict[Value, list[Node]], start: Value, end: Value, outputs: set[Value]
) -> bool:
    """Whether every path from ``start`` through its readers is same-shaped elementwise
    work reaching ``end`` and nothing else."""
    shape = shape_of(start)
    stack, seen = [start], {start}
    while stack:
        current = stack.pop()
        if current is end:
            continue
        readers = users.get(current, ())
        if not readers or (current is not start and current in outputs):
            return False
        for user in readers:
            if (
                len(user.outputs) != 1
                or Tag.ELEMENTWISE not in op_def(user.op).tags
                or not in_kernels(user)
                or shape_of(user.output) != shape
            ):
                return False
            if user.output not in seen:
                seen.add(user.output)
                stack.append(user.output)
    return True
