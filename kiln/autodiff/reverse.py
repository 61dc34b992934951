"""The joint graph: a forward graph followed by its reverse-mode derivative.

Walking the forward nodes backwards, each node's VJP rule (its registry row) turns the
cotangents of its outputs into cotangents of its operands; several contributions to one value
are summed. The joint graph's extra inputs are the cotangents of the forward outputs that
require grad; the gradients of the forward inputs that require grad are its ``input_grads``::

    forward:  t0 = mul(x, w)          joint adds:  g_t0 = grad_0
              t1 = sin(t0)                          g_t0' = mul(grad_0, cos(t0)) ...
              return t1                             return (g_x, g_w)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.autodiff.rules import vjp_of
from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ops import prims


@dataclass
class Joint:
    graph: Graph  # forward nodes, then backward nodes; inputs: forward inputs, then cotangents
    forward_count: int  # the first ``forward_count`` nodes are the forward graph's
    cotangents: list[Value]  # one per forward output position that requires grad
    differentiable_outputs: list[int]  # those output positions
    input_grads: list[Value | None]  # per forward input: its gradient (None: no gradient)


def build_joint(graph: Graph) -> Joint:
    """The forward graph's nodes followed by their VJPs (the forward graph is not changed)."""
    joint = Graph(
        inputs=list(graph.inputs),
        nodes=list(graph.nodes),
        outputs=[],
        mutations=list(graph.mutations),
        constants=dict(graph.constants),
        name=f"{graph.name}_joint",
    )
    joint._names = set(graph._names)
    joint._counter = graph._counter
    grads: dict[Value, Value] = {}
    cotangents: list[Value] = []
    positions: list[int] = []
    with GraphBuilder(joint), torch.no_grad():
        for position, output in enumerate(graph.outputs):
            if not output.type.requires_grad:
                continue
            cotangent = joint.add_input(
                output.type.with_(requires_grad=False), name=f"grad_out{position}"
            )
            cotangents.append(cotangent)
            positions.append(position)
            _accumulate(grads, output, cotangent)
        sweep(graph.nodes, grads)
    input_grads = [grads.get(value) if value.type.requires_grad else None for value in graph.inputs]
    return Joint(joint, len(graph.nodes), cotangents, positions, input_grads)


def sweep(nodes: list[Node], grads: dict[Value, Value]) -> dict[Value, Value]:
    """Extend ``grads`` (cotangents of some values) backwards through ``nodes``, emitting each
    node's VJP into the active builder: the reverse sweep, also run on a lazy step's graph."""
    for node in reversed(nodes):
        output_grads = [grads.get(out) for out in node.outputs]
        if all(g is None for g in output_grads):
            continue
        for operand, grad in zip(node.inputs, vjp_of(node, output_grads), strict=True):
            if grad is not None and isinstance(operand, Value) and operand.type.requires_grad:
                _accumulate(grads, operand, grad)
    return grads


def _accumulate(grads: dict[Value, Value], value: Value, grad: Value) -> None:
    known = grads.get(value)
    if known is None:
        grads[value] = grad
    else:
        summed = prims.add(known, grad)
        grads[value] = summed
