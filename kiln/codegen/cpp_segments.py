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

A column reduction's rows get the same treatment (:func:`row_segments`): its loop over the
rows of a block runs once per run of rows whose masks are constant.

Within a segment, a select on one of its constant masks is its chosen operand (:func:`folded`):
the other operand, and the loads only it needs, are not printed at all, nor are masks no value
reads. A DenseNet concatenation of 24 inputs under a chain of 24 selects otherwise printed
every input's load and mask in every segment: DenseNet-121-tiny's training programs were
13 MB of C++, now 6.4 MB (g++ folded them itself: the build time did not move).

Masks are evaluated here at compile time, for every lane at once and each expression node
once, with C++'s integer semantics (truncating division), so a segment's constants are exactly
what the loop would have computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.codegen.cpp_split import XL, LaneSplit
from kiln.ir.op import Op
from kiln.ir.symbolic import Dim
from kiln.schedule.index import FloorDiv, Index, Mod, Var
from kiln.schedule.loops import Apply, Const, Expr, IndexValue, X

MAX_SEGMENTS = 8  # more loops than this cost more than the masked loads they save
MAX_ROW_SEGMENTS = 64  # a column reduction's: each loop reads one input of a cat
MAX_LANES = 4096  # most lanes (or rows) evaluated at compile time

# Ops on lane values, by their torch functions' names: booleans, then integer arithmetic.
_OPS = "lt le gt ge eq ne logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor"
_COMPARE = {Op[name.upper()]: getattr(torch, name) for name in _OPS.split()}
_ARITHMETIC = {Op[name.upper()]: getattr(torch, name) for name in ("add", "sub", "mul")}


@dataclass(frozen=True)
class Segment:
    """Lanes ``start <= xl < stop``, where each expression id of ``constants`` has its value."""

    start: int
    stop: Dim  # (the lanes of a split of a symbolic count: one segment)
    constants: dict[int, bool]


class _NotConstant(Exception):
    """The expression is not a function of the lane alone that this module evaluates."""


def lane_segments(
    split: LaneSplit, values: list[Expr], limit: int = MAX_SEGMENTS
) -> list[Segment] | None:
    """Segments of ``split``'s lanes over which every boolean of ``values`` (functions of
    ``xl`` alone) is constant; None when there is one segment, more than ``limit``, or no
    such value. A column reduction's (a BatchNorm's statistics over a channels-last ``cat``)
    allows as many as :func:`row_segments`: each segment's loop reads one input."""
    if not isinstance(split.lanes, int):
        return None  # (lanes of a symbolic count: one loop over them)
    return _segments(values, split.lanes, (split.substitute, XL), limit)


def row_segments(rows: Dim, values: list[Expr]) -> list[Segment] | None:
    """Segments of a column reduction's rows ``0 <= x < rows`` over which every boolean of
    ``values`` (functions of ``x`` alone) is constant: a BatchNorm's statistics over a
    DenseNet ``cat`` of up to 32 inputs, whose every element otherwise walked a 32-deep chain
    of masked loads. Each segment's loop reads one input, so more segments pay here."""
    if not isinstance(rows, int):
        return None  # (rows of a symbolic count: one loop over them)
    return _segments(values, rows, (lambda index: index, X), MAX_ROW_SEGMENTS)


_How = tuple[Callable[[Index], Index], str]  # the index in the lane variable, and its name


def _segments(values: list[Expr], count: int, how: _How, limit: int) -> list[Segment] | None:
    if count > MAX_LANES:
        return None
    lanes = torch.arange(count, dtype=torch.int64)
    known: dict[int, torch.Tensor | None] = {}  # by expression id: its lanes, None: unknown
    columns: dict[int, torch.Tensor] = {}
    for mask in values:
        column = _lanes(mask, how, lanes, known) if mask.dtype is torch.bool else None
        if column is not None:
            columns[id(mask)] = column.bool().expand(count)
    if not columns:
        return None
    stacked = torch.stack(list(columns.values()))
    changed = (stacked[:, 1:] != stacked[:, :-1]).any(0).nonzero().flatten() + 1
    starts = [0, *changed.tolist()]
    if not 1 < len(starts) <= limit:
        return None
    stops = [*starts[1:], count]
    return [
        Segment(start, stop, {key: bool(column[start]) for key, column in columns.items()})
        for start, stop in zip(starts, stops, strict=True)
    ]


def _lanes(
    expr: Expr, how: _How, lanes: torch.Tensor, known: dict[int, torch.Tensor | None]
) -> torch.Tensor | None:
    """``expr`` at every lane at once (an integer or boolean tensor over ``lanes``), or None
    when it is not a function of the lane alone that this module evaluates. Each node of the
    expression DAG is evaluated once: a DenseNet's concatenations share deep mask trees (lane
    by lane, unshared, they took 85 of a 100 s first call)."""
    if id(expr) not in known:
        try:
            known[id(expr)] = _evaluate(expr, how, lanes, known)
        except _NotConstant:
            known[id(expr)] = None
    return known[id(expr)]


def _evaluate(
    expr: Expr, how: _How, lanes: torch.Tensor, known: dict[int, torch.Tensor | None]
) -> torch.Tensor:
    if isinstance(expr, Const) and not expr.dtype.is_floating_point:
        return torch.tensor(expr.value, dtype=torch.bool if expr.dtype is torch.bool else None)
    if isinstance(expr, IndexValue):
        return _index(how[0](expr.index), lanes, how[1])
    if not isinstance(expr, Apply):
        raise _NotConstant
    found = [_lanes(arg, how, lanes, known) for arg in expr.args]
    args = [arg for arg in found if arg is not None and not arg.is_floating_point()]
    if len(args) < len(found):
        raise _NotConstant
    if expr.op in _COMPARE:
        return _COMPARE[expr.op](*args)
    if expr.op in _ARITHMETIC and not expr.dtype.is_floating_point:  # bools add as ints
        return _ARITHMETIC[expr.op](*(a.long() if a.dtype is torch.bool else a for a in args))
    if expr.op is Op.LOGICAL_NOT:
        return torch.logical_not(args[0])
    if expr.op is Op.WHERE:
        return torch.where(args[0].bool(), args[1], args[2])
    if expr.op is Op.CONVERT and expr.dtype is torch.bool:
        return torch.ne(args[0], 0)
    if expr.op is Op.CONVERT and not expr.dtype.is_floating_point:
        return args[0]
    raise _NotConstant


def _index(index: Index, lanes: torch.Tensor, variable: str) -> torch.Tensor:
    """``index`` at every lane as the printed C++ computes it (division truncates)."""
    sizes = [index.const, *(c for _, c in index.terms)]
    sizes += [a.divisor for a, _ in index.terms if isinstance(a, (FloorDiv, Mod))]
    if not all(isinstance(n, int) for n in sizes):
        raise _NotConstant  # (a symbolic size: not evaluated per lane)
    total = torch.full_like(lanes, int(index.const))
    for atom, coef in index.terms:
        if isinstance(atom, Var) and atom.name == variable:
            value = lanes
        elif isinstance(atom, (FloorDiv, Mod)):
            operand = _index(atom.operand, lanes, variable)
            divisor = int(atom.divisor)
            quotient = torch.div(operand, divisor, rounding_mode="trunc")
            value = quotient if isinstance(atom, FloorDiv) else operand - quotient * divisor
        else:
            raise _NotConstant  # another loop variable, or a gathered index
        total = total + int(coef) * value
    return total


def folded(expr: Expr, constants: dict[int, bool]) -> Expr | None:
    """What ``expr`` is within a segment whose masks (by expression id) are ``constants``:
    one of them is a literal, a select on one of them the operand it takes (through further
    such selects); else None."""
    if id(expr) in constants:
        return Const(expr.dtype, constants[id(expr)])
    found = None
    while isinstance(expr, Apply) and expr.op is Op.WHERE and id(expr.args[0]) in constants:
        found = expr = expr.args[1] if constants[id(expr.args[0])] else expr.args[2]
    return found  # (a cat's chain of selects: the input read, not one alias per select)
