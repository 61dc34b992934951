"""Splitting the flat loop ``x`` of a C++ kernel in two: ``x = lanes*xb + xl``.

A flat ``x`` that enumerates two dims reaches them by floor division and modulo. The rows of
a channels-last BatchNorm's statistics are ``(n, c)`` and read ``C*r + S*(x // C) + (x % C)``;
a flat BatchNorm-apply kernel reads its per-channel values at ``x % C`` (channels-last) or
``(x // HW) % C`` (NCHW). No term is ``x`` itself, so the printed loops cannot see that
neighbouring rows are neighbours in memory, nor that the per-channel math repeats. With
``lanes`` dividing the divisor, the index algebra (:mod:`kiln.schedule.index`) rewrites
``x // C`` as ``xb`` and ``x % C`` as ``xl`` (for ``lanes == C // k``: ``xb // k`` and
``lanes*(xb % k) + xl``), and the generator (:mod:`kiln.codegen.cpp`) can

- reduce such rows as columns, a block of ``lanes`` rows at a time, vectorized over ``xl``
  with contiguous reads (also when a row kernel only stores along ``r``);
- in a flat kernel, compute the values of ``xl`` alone once per kernel into per-lane arrays
  (channels-last scale and shift), and the values of ``xb`` alone once per block (NCHW's).

The sums of a channels-last ``[8, 32, 32, 32]`` BatchNorm, one per ``(n, c)``::

    for (int32_t xb = 0; xb < 8; ++xb) {             // n
      float acc0[32];
      ...
      for (int32_t r = 0; r < 1024; ++r) {           // h*w
        #pragma omp simd
        for (int32_t xl = 0; xl < 32; ++xl) {        // c
          const float t0 = a1[32*r + 32768*xb + xl];
          acc0[xl] += t0;
        }
      }
      #pragma omp simd
      for (int32_t xl = 0; xl < 32; ++xl) { const float t1 = acc0[xl]; a0[32*xb + xl] = t1; }
    }

Without the split the same kernel is one row at a time with a stride-32 gather along ``r``.
Its flat BatchNorm-apply (abridged), with ``rsqrtf`` once per channel, not once per element::

    float lane0[32];                                 // scale, then shift in lane1
    #pragma omp simd
    for (int32_t xl = 0; xl < 32; ++xl) { ...; lane0[xl] = t5; lane1[xl] = t11; }
    for (int64_t xb = 0; xb < 8192; ++xb) {
      #pragma omp simd
      for (int32_t xl = 0; xl < 32; ++xl) { ...; a0[32*xb + xl] = a5[32*xb + xl]*t5 + t11; }
    }
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir.symbolic import Dim
from kiln.schedule.index import FloorDiv, Index, Mod, Var, floordiv, mod, size_key, var
from kiln.schedule.loops import (
    Const,
    Expr,
    IndexValue,
    Load,
    R,
    Reduce,
    X,
    children,
    index_of,
    walk,
)

XB = "xb"  # the block loop variable: which block of lanes
XL = "xl"  # the lane loop variable (vectorized)
MIN_LANES = 16  # fewer lanes than this vectorize poorly
LANE_LIMIT = 16384  # most lanes of a flat kernel
LANE_ARRAY_LIMIT = 65536  # most elements in a flat kernel's per-lane arrays (on the stack)


@dataclass(frozen=True)
class LaneSplit:
    """``x = lanes*xb + xl`` with ``0 <= xl < lanes`` and ``0 <= xb < blocks``."""

    lanes: Dim  # (symbolic only in flat kernels, without per-lane arrays)
    blocks: Dim

    def substitute(self, index: Index) -> Index:
        """``index`` over ``xb`` and ``xl`` instead of ``x``, simplified."""
        split = var(XB, self.blocks) * self.lanes + var(XL, self.lanes)
        total = Index((), index.const)
        for atom, coef in index.terms:
            if isinstance(atom, Var) and atom.name == X:
                part = split
            elif isinstance(atom, FloorDiv):
                part = floordiv(self.substitute(atom.operand), atom.divisor)
            elif isinstance(atom, Mod):
                part = mod(self.substitute(atom.operand), atom.divisor)
            else:
                part = Index(((atom, 1),))
            total = total + part * coef
        return total


@dataclass(frozen=True)
class PointwiseSplit:
    """How a flat kernel runs split: ``lane_values`` (of ``xl`` alone) are computed once
    into per-lane arrays; values that do not vary along ``xl`` (``on_lane`` false) once per
    block; the rest per element."""

    split: LaneSplit
    lane_values: list[Expr]
    on_lane: dict[int, bool]


def x_divisors(indexes: Iterable[Index], symbolic: bool = False) -> list[Dim]:
    """The divisors ``d`` of every ``(... + x) // d`` and ``(... + x) % d`` in ``indexes``,
    ints ascending, then (with ``symbolic``) symbolic ones in a fixed order: the candidate
    inner dims of ``x``."""
    found: dict[Any, Dim] = {}
    pending = list(indexes)
    while pending:
        index = pending.pop()
        for atom, _ in index.terms:
            if isinstance(atom, (FloorDiv, Mod)):
                on_x = any(isinstance(a, Var) and a.name == X for a, _ in atom.operand.terms)
                if on_x and (symbolic or isinstance(atom.divisor, int)):
                    found.setdefault(size_key(atom.divisor), atom.divisor)
                pending.append(atom.operand)
    return [found[key] for key in sorted(found)]


def reads_columns(offsets: list[Index], along: str) -> bool:
    """Whether some read at ``offsets`` is contiguous along the variable ``along`` and none
    that varies along it is contiguous along ``r``: then a block of rows is better read side
    by side than one row at a time. A read of ``r`` alone (a LayerNorm's per-row statistics
    in its weight gradient's column sums) is one value for the whole block."""
    strides = [{a.name: c for a, c in o.terms if isinstance(a, Var)} for o in offsets]
    if not any(s.get(along) == 1 for s in strides):
        return False
    return not any(
        s.get(R) == 1 and along in o.variables() for s, o in zip(strides, offsets, strict=True)
    )


def lane_counts(divisor: int, most: int) -> list[int]:
    """Lane counts for an inner dim of ``divisor``, largest first: the dim itself, or the
    multiples of 16 that divide it, within ``MIN_LANES..most``."""
    counts = {m for m in range(MIN_LANES, most + 1, 16) if divisor % m == 0}
    if MIN_LANES <= divisor <= most:
        counts.add(divisor)
    return sorted(counts, reverse=True)


def column_split(
    xnumel: Dim, offsets: list[Index], most_lanes: int, min_blocks: int
) -> LaneSplit | None:
    """A split under which the reads at ``offsets`` (those that vary along ``r``) are columns
    contiguous along ``xl``; the most lanes that still give ``min_blocks`` blocks (one per
    thread), else the most lanes. None when no inner dim of ``x`` gives columns."""
    for divisor in x_divisors(offsets):
        assert isinstance(divisor, int)
        counts = [n for n in lane_counts(divisor, most_lanes) if xnumel % n == 0]
        if not counts:
            continue
        lanes = next((n for n in counts if xnumel // n >= min_blocks), counts[0])
        split = LaneSplit(lanes, xnumel // lanes)
        if reads_columns([split.substitute(o) for o in offsets], XL):
            return split
    return None


def varies_along(roots: list[Expr], name: str, split: LaneSplit) -> dict[int, bool]:
    """For every expression reachable from ``roots``: whether it varies along the split's
    variable ``name`` (``xb`` or ``xl``)."""
    result: dict[int, bool] = {}
    for expr in walk(roots):
        uses = any(name in split.substitute(index).variables() for index in index_of(expr))
        result[id(expr)] = uses or any(result[id(c)] for c in children(expr))
    return result


def varies_across_rows(roots: list[Expr], split: LaneSplit | None) -> dict[int, bool]:
    """For every expression reachable from ``roots``: whether it varies from one row of a
    column block to the next (along ``xl`` under ``split``, else along ``x``). Reductions do
    (one accumulator slot per row); what does not is computed once per ``r``."""
    name = XL if split is not None else X
    result: dict[int, bool] = {}
    for expr in walk(roots):
        if isinstance(expr, Reduce):
            result[id(expr)] = True
            continue
        indexes = index_of(expr)
        if split is not None:
            indexes = [split.substitute(index) for index in indexes]
        uses = any(name in index.variables() for index in indexes)
        result[id(expr)] = uses or any(result[id(c)] for c in children(expr))
    return result


def loop_invariants(roots: list[Expr], varies: dict[int, bool]) -> list[Expr]:
    """The operands that do not vary of the expressions that do (``varies``, along an outer
    loop's variable): computed once into an array, they are read by the loop instead of
    recomputed. Loads, constants and index values are left out (reading them costs what
    reading the array would), and so are reductions (computed by the loop itself)."""
    found: list[Expr] = []
    seen: set[int] = set()
    for expr in walk(roots, into_reduces=False):
        if not varies[id(expr)]:
            continue
        for child in children(expr):
            if varies[id(child)] or id(child) in seen:
                continue
            if isinstance(child, (Const, Load, IndexValue, Reduce)):
                continue
            seen.add(id(child))
            found.append(child)
    return found


def pointwise_split(xnumel: Dim, roots: list[Expr], min_blocks: int) -> PointwiseSplit | None:
    """The split of a flat kernel by its innermost dim (the smallest divisor of ``x``): worth
    it when some computed value depends on ``xl`` alone or on ``xb`` alone (per-channel math),
    or when it takes divisions out of the indexes (a bias read at ``x % C`` is a gather in
    the flat loop and a contiguous read at ``xl`` in the split one), else None."""
    indexes = [index for expr in walk(roots) for index in index_of(expr)]
    divisors = x_divisors(indexes, symbolic=True)
    # (a symbolic divisor: an NCHW BatchNorm's H*W, each comparison guarded)
    lanes = next((d for d in divisors if d >= MIN_LANES and xnumel % d == 0), 0)
    if not lanes or lanes > LANE_LIMIT or xnumel // lanes < max(min_blocks, 2):
        return None
    split = LaneSplit(lanes, xnumel // lanes)
    on_lane = varies_along(roots, XL, split)
    lane_values = loop_invariants(roots, varies_along(roots, XB, split))
    # (a value of neither xb nor xl, a scaled scalar gradient, is computed where it is read)
    lane_values = [v for v in lane_values if on_lane[id(v)]]
    if not isinstance(lanes, int) or lanes * len(lane_values) > LANE_ARRAY_LIMIT:
        lane_values = []  # recomputed per element rather than risk the stack (or size it)
    fewer_divisions = sum(map(_divisions, indexes)) > sum(
        _divisions(split.substitute(index)) for index in indexes
    )
    if not lane_values and not loop_invariants(roots, on_lane) and not fewer_divisions:
        return None
    return PointwiseSplit(split, lane_values, on_lane)


def block_flags(roots: list[Expr], plan: PointwiseSplit) -> list[Expr]:
    """The booleans of the block alone that lane values read (a padding test of a row, as
    a load's mask or a select's condition), when one of them is read by a boolean lane
    value (the mask of a load of a bool buffer): the C++ generator copies them into per-lane
    arrays. GCC 12 does not vectorize a select of bytes on a loop-invariant condition, nor
    then the selects of floats beside it, and leaves the lane loop scalar (a max pool's
    backward: 178 ms against 10 ms with the copies). Flags that only floats read stay as
    they are: GCC unswitches that loop on them (a max pool's NCHW forward, 1.8x slower with
    copies)."""
    found: dict[int, Expr] = {}
    bytes_read = False
    for expr in walk(roots):
        if not plan.on_lane[id(expr)]:
            continue
        for child in children(expr):
            flag = child.dtype == torch.bool and not isinstance(child, Const)
            if flag and not plan.on_lane[id(child)]:
                found[id(child)] = child
                bytes_read = bytes_read or expr.dtype == torch.bool
    return list(found.values()) if bytes_read else []


def _divisions(index: Index) -> int:
    """How many floor divisions and modulos printing ``index`` takes."""
    count = 0
    for atom, _ in index.terms:
        if isinstance(atom, (FloorDiv, Mod)):
            count += 1 + _divisions(atom.operand)
    return count
