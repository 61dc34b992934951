"""Custom ``torch.autograd.Function``s in graphs: the forward's work, then a marker whose VJP is
the Function's own ``backward``.

Bytecode capture traces ``Fn.apply(x, w)`` as the forward's prims (emitted without gradients,
as eager runs ``forward`` under ``no_grad``) followed by one ``extern`` of
:func:`function_outputs`, which passes the forward's outputs through and carries the
``backward`` traced to a graph (:class:`CustomBackward`). Its operands are the forward's
outputs, then the ``apply`` arguments that are tensors, then the values the backward reads
(``ctx.saved_tensors``, tensors kept on ``ctx``)::

    t3 = neg(x)                      # forward: no gradient through these
    t4, = extern(t3, x, fn=function_outputs, args=(Slot(0), Slot(1)), kwargs={...})
                                     # the outputs again, now requiring grad

Autodiff asks the marker for gradients: :func:`_function_vjp` inlines the backward graph on
the saved values and the output cotangents, so a gradient-reversal or straight-through
Function gets exactly its own gradient. After autodiff, the ``remove_autodiff_markers`` pass
replaces the marker by the outputs it passes through: no copy runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir.builder import require_builder
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.types import same_shape
from kiln.ops import prims
from kiln.ops.attrs import ExternAttrs, Slot
from kiln.ops.externs import EXTERN_VJPS, Grads, extern_call


@dataclass(frozen=True, eq=False)
class CustomBackward:
    """The backward of one ``apply`` call, traced: ``graph`` maps (saved values, one cotangent
    per output of the Function) to one gradient per tensor argument that receives one."""

    function: str  # the Function's qualified name, for printed graphs and errors
    graph: Graph
    saved_count: int  # the graph's first inputs are saved values, then the cotangents
    gradients: tuple[int, ...]  # per graph output: the index of the tensor argument it is for
    materialize: bool  # cotangents of outputs nothing used become zeros (ctx default)

    def __repr__(self) -> str:
        return f"<backward of {self.function}>"


def function_outputs(
    *operands: torch.Tensor, backward: CustomBackward, outputs: int, arguments: int
) -> tuple[torch.Tensor, ...]:
    """The marker's reference implementation: its first ``outputs`` operands (copied, since an
    extern's results are fresh memory), differentiated by the traced backward when eager
    autograd runs the graph (the reference interpreter). Compiled graphs lose the marker."""
    return _FunctionOutputs.apply(backward, outputs, arguments, *operands)


class _FunctionOutputs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, backward: CustomBackward, outputs: int, arguments: int, *operands: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.backward, ctx.outputs, ctx.arguments = backward, outputs, arguments
        ctx.shapes = [(o.shape, o.dtype) for o in operands[outputs : outputs + arguments]]
        ctx.save_for_backward(*operands[outputs + arguments :])
        return tuple(operand.clone() for operand in operands[:outputs])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        from kiln.ir.interpreter import interpret

        backward: CustomBackward = ctx.backward
        # (autograd materializes the cotangents of unused outputs as zeros)
        results = interpret(backward.graph, [*ctx.saved_tensors, *grads])  # type: ignore[list-item]
        gradients: list[torch.Tensor | None] = [None] * ctx.arguments
        for argument, grad in zip(backward.gradients, results, strict=True):
            shape, dtype = ctx.shapes[argument]
            grad = grad.sum_to_size(shape).to(dtype)
            known = gradients[argument]
            gradients[argument] = grad if known is None else known + grad
        saved = [None] * len(ctx.saved_tensors)
        return (None, None, None, *([None] * ctx.outputs), *gradients, *saved)


def emit_function_outputs(
    outputs: Sequence[Value],
    arguments: Sequence[Value],
    saved: Sequence[Value],
    backward: CustomBackward,
) -> tuple[Value, ...]:
    """The marker node over a traced Function call (see the module docstring)."""
    kwargs = {"backward": backward, "outputs": len(outputs), "arguments": len(arguments)}
    result = extern_call(function_outputs, [*outputs, *arguments, *saved], kwargs)
    return tuple(result)


def _function_vjp(attrs: ExternAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    """The gradients of the marker's operands: the Function's backward graph, inlined on the
    saved values and the cotangents, for the tensor arguments; nothing for the rest."""
    backward: CustomBackward = attrs.kwargs["backward"]
    count, arguments = attrs.kwargs["outputs"], attrs.kwargs["arguments"]
    slots = [slot.index for slot in attrs.args if isinstance(slot, Slot)]
    cotangents = []
    for output, grad in zip(outputs, grads, strict=True):
        if grad is None and backward.materialize:
            kind = output.type
            grad = prims.full(shape=kind.shape, value=0, dtype=kind.dtype, device=kind.device)
        cotangents.append(grad)
    saved = [inputs[index] for index in slots[count + arguments :]]
    results = inline_graph(backward.graph, [*saved, *cotangents])
    gradients: list[Value | None] = [None] * len(inputs)
    for argument, result in zip(backward.gradients, results, strict=True):
        operand = inputs[slots[count + argument]]
        if not isinstance(operand, Value) or not operand.type.requires_grad:
            continue
        result = fit_gradient(result, operand)
        known = gradients[slots[count + argument]]
        gradients[slots[count + argument]] = result if known is None else prims.add(known, result)
    return tuple(gradients)


def fit_gradient(grad: Value, operand: Value) -> Value:
    """``grad`` summed to ``operand``'s shape and cast to its dtype, as eager autograd does
    with what a custom backward returns."""
    shape = operand.type.shape
    if not same_shape(grad.type.shape, shape):
        lead = grad.type.rank - len(shape)
        sizes = grad.type.shape
        dims = tuple(range(lead)) + tuple(
            lead + i for i, n in enumerate(shape) if n == 1 != sizes[lead + i]
        )
        if dims:
            grad = prims.sum(grad, dims=dims)
        if not same_shape(grad.type.shape, shape):
            grad = prims.reshape(grad, shape=shape)
    if grad.type.dtype != operand.type.dtype:
        grad = prims.convert(grad, dtype=operand.type.dtype)
    return grad


def inline_graph(graph: Graph, arguments: Sequence[Value]) -> list[Value]:
    """Emit ``graph``'s nodes into the active builder, its inputs bound to ``arguments`` (its
    constants lifted into the active graph); its outputs, mapped."""
    builder = require_builder()
    mapped: dict[Value, Any] = {}
    given = iter(arguments)
    for value in graph.inputs:
        if value.kind is InputKind.CONSTANT:
            mapped[value] = builder.constant(graph.constants[value.name])
        else:
            mapped[value] = next(given)
    for node in graph.nodes:
        operands = tuple(mapped.get(i, i) if isinstance(i, Value) else i for i in node.inputs)
        with builder.origin_scope(node.origin):
            result = builder.emit(node.op, operands, node.attrs)
        results = result if isinstance(result, tuple) else (result,)
        mapped.update(zip(node.outputs, results, strict=True))
    return [mapped[out] for out in graph.outputs]


EXTERN_VJPS[function_outputs] = _function_vjp
