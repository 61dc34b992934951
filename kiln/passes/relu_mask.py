"""ReLU masks read back from the ReLU's output: other readers of ``le(x, 0)`` use ``le(y, 0)``.

ReLU is ``y = where(le(x, 0), 0, x)``, and its gradient ``where(le(x, 0), 0, g)`` reads the
same mask. In a training backward that recomputes the ReLU (its output feeds a convolution's
weight gradient), the mask kept the pre-activation ``x`` alive: the scheduler stored both the
BatchNorm output ``x`` and ``y`` at full size, and the gradient kernel read ``x`` back. The mask
is a function of ``y`` alone, as eager's ``threshold_backward`` uses it: ``y <= 0`` exactly when
``x <= 0`` (``x = -0.0`` gives ``y = 0``; NaN stays NaN and compares false both ways). So every
reader of the mask but the ReLU itself reads ``le(y, 0)`` instead, and ``x`` is needed only
where ``y`` is computed::

    before:  t1 = le(t0, 0); t2 = where(t1, 0, t0); t4 = where(t1, 0, t3)
    after:   t1 = le(t0, 0); t2 = where(t1, 0, t0); t5 = le(t2, 0); t4 = where(t5, 0, t3)

``lt(x, 0)`` masks are left alone: there ``y = where(x < 0, 0, x)`` has ``y < 0`` never, so the
mask is not a function of ``y``.
"""

from __future__ import annotations

import copy

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims


def _is_zero(operand: object) -> bool:
    return isinstance(operand, int | float) and not isinstance(operand, bool) and operand == 0


def _relu_mask(node: Node) -> Value | None:
    """The mask of ``node`` when it is a ReLU ``where(le(x, 0), 0, x)``."""
    if node.op is not Op.WHERE:
        return None
    mask, zero, x = node.inputs
    if not (isinstance(mask, Value) and isinstance(x, Value) and _is_zero(zero)):
        return None
    test = mask.node
    if test is None or test.op is not Op.LE or test.inputs[0] is not x:
        return None
    if not _is_zero(test.inputs[1]):
        return None
    if x.type.dtype != node.output.type.dtype or x.type.dtype.is_complex:
        return None
    return mask


def read_relu_masks_from_outputs(graph: Graph) -> Graph:
    """``graph`` with ReLU masks recomputed from the ReLU's output (module docstring)."""
    users = graph.users()
    relus = {}
    for node in graph.nodes:
        mask = _relu_mask(node)
        if mask is not None and any(user is not node for user in users.get(mask, [])):
            relus[node] = mask
    if not relus:
        return graph
    result = copy.copy(graph)
    result.nodes = []
    replaced: dict[Value, Value] = {}
    builder = GraphBuilder(result)
    with builder:
        for node in graph.nodes:
            reads = [i for i in node.inputs if isinstance(i, Value)]
            if node not in relus and any(i in replaced for i in reads):
                node.inputs = tuple(
                    replaced.get(i, i) if isinstance(i, Value) else i for i in node.inputs
                )
            result.nodes.append(node)
            mask = relus.get(node)
            if mask is not None:
                with builder.origin_scope(node.origin):
                    replaced[mask] = prims.le(node.output, 0)
    return result
