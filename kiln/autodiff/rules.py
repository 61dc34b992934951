"""Applying registry rows' VJP rules.

A row's ``vjp(attrs, inputs, outputs, grads)`` runs inside an active ``GraphBuilder`` and
returns one entry per operand of the forward node: a Value of exactly that operand's type (the
gradient with respect to it), or None where the operand is not differentiable (an integer or
bool tensor, a Python scalar, an index) or receives no gradient. ``inputs`` are the node's
operands (Values and Python scalars), ``outputs`` its output Values, and ``grads`` one
cotangent per output (a Value of the output's type, or None when nothing flows back into that
output). Rules are written with ``kiln.ops.prims`` so the backward graph is made of the same
fusible prims as the forward one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Node, Value
from kiln.ir.op import Op, Tag, op_def
from kiln.ir.types import carries_gradient


def is_differentiable(item: Any) -> bool:
    """Gradients flow only into floating (and complex) tensors."""
    if isinstance(item, Value):
        return carries_gradient(item.type.dtype)
    return isinstance(item, torch.Tensor) and carries_gradient(item.dtype)


def differentiable_inputs(op: Op, inputs: Sequence[Any]) -> list[int]:
    """Positions of ``op``'s operands that can receive a gradient."""
    row = op_def(op)
    if Tag.NONDIFFERENTIABLE in row.tags or Tag.RANDOM in row.tags:
        return []
    return [i for i, item in enumerate(inputs) if is_differentiable(item)]


def vjp_of(node: Node, grads: Sequence[Value | None]) -> tuple[Value | None, ...]:
    """The gradient of each of ``node``'s operands, given its outputs' cotangents (emitted
    into the active builder's graph)."""
    row = op_def(node.op)
    inputs = tuple(node.inputs)
    if all(g is None for g in grads) or not differentiable_inputs(node.op, inputs):
        return (None,) * len(inputs)
    if row.vjp is None:
        raise NotImplementedError(f"{node.op.name} has no VJP rule")
    result = row.vjp(node.attrs, inputs, tuple(node.outputs), tuple(grads))
    result = tuple(result)
    if len(result) != len(inputs):
        raise AssertionError(
            f"{node.op.name}: VJP returned {len(result)} gradients for {len(inputs)} operands"
        )
    checked: list[Value | None] = []
    for operand, grad in zip(inputs, result, strict=True):
        if grad is None or not is_differentiable(operand):
            checked.append(None)
            continue
        assert isinstance(operand, Value) and isinstance(grad, Value)
        if grad.type.shape != operand.type.shape or grad.type.dtype != operand.type.dtype:
            raise AssertionError(
                f"{node.op.name}: gradient {grad.type} for an operand of type {operand.type}"
            )
        checked.append(grad)
    return tuple(checked)
