"""Splitting a split kernel's lane loop into segments where its masks are constant.

A ``cat`` (and the sum of zero-padded pieces a ``split``'s backward makes) reads each input
under a mask of the lane alone: ``xl < 128``, ``128 <= xl < 256``, ``xl >= 256``. Printed as
one vectorized loop over every lane, each input is read with a masked load on every lane
(GCC: a blend or a masked move per input, about five times the cost of the copy). The masks
change value at a few lanes only, so the generator (:mod:`kiln.codegen.cpp`) prints one loop
per segment of lanes with the masks as constants, and the compiler drops the loads a segment
does not need::

    for (int64_t xb = 0; xb < 256; ++xb) {
      #pragma omp simd
      for (int32_t xl = 0; xl < 128; ++xl) {     // t1 = 1, t5 = 0, t7 = 0
        ...; a0[384*xb + xl] = t15;
      }
      #pragma omp simd
      for (int32_t xl = 128; xl < 256; ++xl) { ... }
      ...
    }

Masks are evaluated here, lane by lane, with C++'s integer semantics (truncating division),
so a segment's constants are exactly what the loop would have computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.cpp_split import XL, LaneSplit
from kiln.ir.op import Op
from kiln.schedule.index import FloorDiv, Index, Mod, Var
from kiln.schedule.loops import Apply, Const, Expr, IndexValue

MAX_SEGMENTS = 8  # more loops than this cost more than the masked loads they save
MAX_LANES = 4096  # lanes evaluated one by one at compile time

_COMPARE = {
    Op.LT: lambda a, b: a < b,
    Op.LE: lambda a, b: a <= b,
    Op.GT: lambda a, b: a > b,
    Op.GE: lambda a, b: a >= b,
    Op.EQ: lambda a, b: a == b,
    Op.NE: lambda a, b: a != b,
}
_LOGICAL = {
    Op.LOGICAL_AND: lambda a, b: bool(a) and bool(b),
    Op.LOGICAL_OR: lambda a, b: bool(a) or bool(b),
    Op.LOGICAL_XOR: lambda a, b: bool(a) != bool(b),
    Op.BITWISE_AND: lambda a, b: a & b,
    Op.BITWISE_OR: lambda a, b: a | b,
    Op.BITWISE_XOR: lambda a, b: a ^ b,
}
_ARITHMETIC = {
    Op.ADD: lambda a, b: a + b,
    Op.SUB: lambda a, b: a - b,
    Op.MUL: lambda a, b: a * b,
}


@dataclass(frozen=True)
class Segment:
    """Lanes ``start <= xl < stop``, where each expression id of ``constants`` has its value."""

    start: int
    stop: int
    constants: dict[int, bool]


class _NotConstant(Exception):
    """The expression is not a function of the lane alone that this module evaluates."""


def lane_segments(split: LaneSplit, values: list[Expr]) -> list[Segment] | None:
    """Segments of ``split``'s lanes over which every boolean of ``values`` (functions of
    ``xl`` alone) is constant; None when there is one segment, too many, or no such value."""
    if split.lanes > MAX_LANES:
        return None
    masks = [v for v in values if v.dtype is torch.bool]
    columns: dict[int, list[bool]] = {}
    for mask in masks:
        try:
            columns[id(mask)] = [bool(_value(mask, split, xl)) for xl in range(split.lanes)]
        except _NotConstant:
            continue
    if not columns:
        return None
    starts = [0] + [
        xl
        for xl in range(1, split.lanes)
        if any(column[xl] != column[xl - 1] for column in columns.values())
    ]
    if not 1 < len(starts) <= MAX_SEGMENTS:
        return None
    stops = [*starts[1:], split.lanes]
    return [
        Segment(start, stop, {key: column[start] for key, column in columns.items()})
        for start, stop in zip(starts, stops, strict=True)
    ]


def _value(expr: Expr, split: LaneSplit, xl: int) -> int | float | bool:
    if isinstance(expr, Const):
        return expr.value
    if isinstance(expr, IndexValue):
        return _index(split.substitute(expr.index), xl)
    if not isinstance(expr, Apply):
        raise _NotConstant
    args = [_value(arg, split, xl) for arg in expr.args]
    if expr.op in _COMPARE:
        return _COMPARE[expr.op](*args)
    if expr.op in _LOGICAL:
        return _LOGICAL[expr.op](*args)
    if expr.op in _ARITHMETIC and not expr.dtype.is_floating_point:
        return _ARITHMETIC[expr.op](*args)
    if expr.op is Op.LOGICAL_NOT:
        return not args[0]
    if expr.op is Op.WHERE:
        return args[1] if args[0] else args[2]
    if expr.op is Op.CONVERT and expr.dtype is torch.bool:
        return args[0] != 0
    if expr.op is Op.CONVERT and not expr.dtype.is_floating_point and isinstance(args[0], int):
        return args[0]
    raise _NotConstant


def _index(index: Index, xl: int) -> int:
    """``index`` at lane ``xl`` as the printed C++ computes it (division truncates)."""
    total = index.const
    for atom, coef in index.terms:
        if isinstance(atom, Var) and atom.name == XL:
            value = xl
        elif isinstance(atom, (FloorDiv, Mod)):
            operand = _index(atom.operand, xl)
            quotient = abs(operand) // atom.divisor * (1 if operand >= 0 else -1)
            value = quotient if isinstance(atom, FloorDiv) else operand - quotient * atom.divisor
        else:
            raise _NotConstant  # another loop variable, or a gathered index
        total += coef * value
    return total
