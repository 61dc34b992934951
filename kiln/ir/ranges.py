"""Bounds a graph's ops alone put on a value, whatever its inputs: a uniform random draw lies in
``[0, 1]`` for every seed. Capture asks :func:`known_truth` before it breaks the graph at
``bool(tensor)``; LayerDrop in training, as older transformers releases write it::

    dropout_probability = torch.rand([])
    if dropout_probability < self.layerdrop:   # layerdrop == 0.0 (guarded): False on every call

needs no break. Bounds are closed intervals holding every value the op can produce (sound, not
tight: ``rand < 1.0`` stays undecided), followed through moves and conversions only (rounded
arithmetic could step outside them). The constant is rounded to the compared value's dtype
first, as PyTorch compares.
"""

from __future__ import annotations

import operator

import torch

from kiln.ir.graph import Value
from kiln.ir.op import Op

_MOVES = {Op.CONVERT, Op.BROADCAST, Op.EXPAND, Op.RESHAPE, Op.PERMUTE, Op.SQUEEZE, Op.UNSQUEEZE}
_COMPARISONS = {Op.LT: operator.lt, Op.LE: operator.le, Op.GT: operator.gt, Op.GE: operator.ge}
_MIRRORED = {Op.LT: Op.GT, Op.LE: Op.GE, Op.GT: Op.LT, Op.GE: Op.LE}  # c < x is x > c


def bounds(value: Value) -> tuple[float, float] | None:
    """A closed interval holding every element of ``value``, or None when unknown."""
    node = value.node
    while node is not None and node.op in _MOVES and isinstance(node.inputs[0], Value):
        node = node.inputs[0].node
    if node is not None and node.op is Op.RANDOM_UNIFORM and node.attrs.dtype.is_floating_point:
        return (0.0, 1.0)
    return None


def known_truth(value: Value) -> bool | None:
    """``bool(value)`` when its bounds decide it for every element, else None."""
    node = value.node
    if node is None or node.op not in _COMPARISONS or len(node.inputs) != 2:
        return None
    if any(size != 1 for size in value.type.shape):
        return None  # (bool() of several elements raises, as eager's does)
    left, right = node.inputs
    op = node.op
    if isinstance(right, Value) and not isinstance(left, Value):
        left, right, op = right, left, _MIRRORED[op]
    if not isinstance(left, Value) or type(right) not in (int, float):
        return None
    interval = bounds(left)
    if interval is None or not left.type.dtype.is_floating_point:
        return None
    constant = torch.tensor(right, dtype=left.type.dtype).item()  # (NaN: never decided)
    # Each comparison is monotone in x: true at both ends of the interval is true inside.
    at_low, at_high = (_COMPARISONS[op](end, constant) for end in interval)
    return at_low if at_low == at_high and constant == constant else None
