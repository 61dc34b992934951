"""The joint graph: a forward graph followed by its reverse-mode derivative.

Walking the forward nodes backwards, each node's VJP rule (its registry row) turns the
cotangents of its outputs into cotangents of its operands; several contributions to one value
are summed. The joint graph's extra inputs are the cotangents of the forward outputs that
require grad; the gradients of the forward inputs that require grad are its ``input_grads``::

    forward:  t0 = mul(x, w)          joint adds:  g_t0 = grad_0
              t1 = sin(t0)                          g_t0' = mul(grad_0, cos(t0)) ...
              return t1                             return (g_x, g_w)

One identity is applied as the sweep runs: a deviation from its own mean, ``d = x - mean(x)``,
squared and summed over the mean's dims (a variance) sends ``-2 g * sum(d) = 0`` to the mean.
That cotangent is kept apart and left out of the mean's gradient, as eager's closed-form
backwards of ``var`` and the normalizations leave it out: a reduction, and an accumulator in
each BatchNorm backward kernel, fewer. (A double backward re-runs the forward under eager
autograd, so it still differentiates the full expression.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.autodiff.rules import vjp_of
from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims
from kiln.passes.reduction_split import mean_count


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
    squares = _squared_deviations(nodes, set(grads))
    apart: dict[Value, Value] = {}  # per deviation: its squares' cotangents (zero sum)
    for node in reversed(nodes):
        if node.outputs[0] in apart:
            operand_grads = _deviation_vjp(node, grads, apart.pop(node.outputs[0]))
        else:
            output_grads = [grads.get(out) for out in node.outputs]
            if all(g is None for g in output_grads):
                continue
            operand_grads = vjp_of(node, output_grads)
        deviation = squares.get(node)
        for operand, grad in zip(node.inputs, operand_grads, strict=True):
            if grad is not None and isinstance(operand, Value) and operand.type.requires_grad:
                _accumulate(apart if operand is deviation else grads, operand, grad)
    return grads


def _squared_deviations(nodes: list[Node], seeded: set[Value]) -> dict[Node, Value]:
    """Each ``mul(d, d)`` or ``pow(d, 2)`` whose only users sum it over the dims of a mean
    ``d = sub(x, mean(x))`` subtracts (``d`` made by one of ``nodes``), with that ``d``."""
    users: dict[Value, list[Node]] = {}
    for node in nodes:
        for operand in node.input_values():
            users.setdefault(operand, []).append(node)
    made = {out for node in nodes for out in node.outputs}
    found: dict[Node, Value] = {}
    for node in nodes:
        if node.op not in (Op.MUL, Op.POW) or node.output in seeded:
            continue
        deviation, other = node.inputs
        two = isinstance(other, int | float) and not isinstance(other, bool) and other == 2
        sums = users.get(node.output, [])
        dims = {tuple(sorted(u.attrs.dims)) if u.op is Op.SUM else () for u in sums}
        squared = other is deviation if node.op is Op.MUL else two
        if not (squared and deviation in made and len(dims) == 1 and () not in dims):
            continue
        assert isinstance(deviation, Value) and deviation.node is not None
        source, mean = deviation.node.inputs if deviation.node.op is Op.SUB else (None, None)
        if (
            isinstance(source, Value)
            and isinstance(mean, Value)
            and mean_count(source, mean, dims.pop()) is not None
        ):
            found[node] = deviation
    return found


def _deviation_vjp(
    node: Node, grads: dict[Value, Value], zero_sum: Value
) -> tuple[Value | None, ...]:
    """The VJP of ``d = sub(x, mean)``: ``x`` gets all of ``d``'s cotangent, the mean only the
    part that is not ``zero_sum`` (the squares' cotangents, which sum to zero over its dims)."""
    rest = grads.get(node.outputs[0])
    total = zero_sum if rest is None else prims.add(rest, zero_sum)
    grads[node.outputs[0]] = total
    source_grad = vjp_of(node, [total])[0]
    mean_grad = None if rest is None else vjp_of(node, [rest])[1]
    return (source_grad, mean_grad)


def _accumulate(grads: dict[Value, Value], value: Value, grad: Value) -> None:
    known = grads.get(value)
    if known is None:
        grads[value] = grad
    else:
        summed = prims.add(known, grad)
        grads[value] = summed
