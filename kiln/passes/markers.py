"""Markers for autodiff dropped once autodiff has used them.

Three externs only pass values through; they exist so that autodiff differentiates something
other than the prims that computed those values:

* ``function_outputs`` (``kiln/ops/autograd_function.py``) passes a custom autograd
  Function's outputs through, with the Function's own backward as its VJP;
* ``untracked_write`` (``kiln/ops/untracked.py``) gives a tensor the values written through
  its ``.data``, with the gradient passed straight to the tensor's old value;
* ``batch_norm_output`` (``kiln/ops/batch_norm_backward.py``) passes a BatchNorm's output
  through, differentiated in closed form on the centred input.

After autodiff (and in graphs nothing differentiates) their readers read the values directly,
so no copy runs::

    before:  t3 = neg(x); t4, = extern(t3, x, fn=function_outputs, ...); t5 = mul(t4, 2)
    after:   t3 = neg(x); t5 = mul(t3, 2)

A graph output that would become a graph input, or a view of one, is copied: outputs are
fresh memory (capture re-creates the views eager returns).
"""

from __future__ import annotations

import copy

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims
from kiln.ops.attrs import Slot
from kiln.ops.autograd_function import function_outputs
from kiln.ops.batch_norm_backward import batch_norm_output
from kiln.ops.untracked import untracked_write

_MARKERS = (function_outputs, untracked_write, batch_norm_output)
_VIEWS = frozenset(
    {Op.RESHAPE, Op.PERMUTE, Op.BROADCAST, Op.EXPAND, Op.SLICE, Op.SQUEEZE, Op.UNSQUEEZE}
)


def is_marker(node: Node) -> bool:
    """Whether ``node`` is one of the markers above."""
    return node.op is Op.EXTERN and node.attrs.fn in _MARKERS


def recomputable_marker(node: Node) -> bool:
    """Whether the backward may recompute ``node``: a BatchNorm's output marker (free once
    markers go; else its output is saved for the ReLU after it). Not the others: a write
    through ``.data`` passes on values the step writes back into the input that saved them."""
    return node.op is Op.EXTERN and node.attrs.fn is batch_norm_output


def _passed_through(node: Node) -> dict[Value, Value] | None:
    """Each output of a marker node -> the operand it passes through; None for other nodes."""
    if not is_marker(node):
        return None
    slots = [slot.index for slot in node.attrs.args if isinstance(slot, Slot)]
    if node.attrs.fn is untracked_write:
        operands = [node.inputs[slots[1]]]
    elif node.attrs.fn is batch_norm_output:
        operands = [node.inputs[slots[0]]]
    else:
        operands = [node.inputs[index] for index in slots[: node.attrs.kwargs["outputs"]]]
    return dict(zip(node.outputs, operands, strict=True))  # type: ignore[arg-type]


def remove_autodiff_markers(graph: Graph) -> Graph:
    """``graph`` without the markers of the module docstring."""
    replaced: dict[Value, Value] = {}
    for node in graph.nodes:
        passed = _passed_through(node)
        if passed is not None:
            replaced.update({out: replaced.get(v, v) for out, v in passed.items()})
    if not replaced:
        return graph
    result = copy.copy(graph)
    result.nodes = []
    for node in graph.nodes:
        if is_marker(node):
            continue
        node.inputs = tuple(replaced.get(i, i) if isinstance(i, Value) else i for i in node.inputs)
        result.nodes.append(node)
    producers = {out: node for node in result.nodes for out in node.outputs}
    inputs = set(result.inputs)
    outputs = []
    with GraphBuilder(result):
        for value in graph.outputs:
            new = replaced.get(value, value)
            if new is not value and _views_input(new, producers, inputs):
                copied = prims.convert(new, dtype=new.type.dtype)
                new = copied
            outputs.append(new)
    result.outputs = outputs
    result.mutations = [(target, replaced.get(new, new)) for target, new in graph.mutations]
    return result


def _views_input(value: Value, producers: dict[Value, Node], inputs: set[Value]) -> bool:
    while value in producers and producers[value].op in _VIEWS:
        operand = producers[value].inputs[0]
        assert isinstance(operand, Value)
        value = operand
    return value in inputs
