"""Lowering: each prim becomes a scalar expression of the loop-level IR at a multi-index.

``Lowering.load(value, index)`` answers "what is ``value[index]`` inside this kernel": a load
when the value lives in memory (a buffer, or a strided view of one) and is not computed by this
kernel, otherwise the value's node lowered by the rule of its op. Views become index
arithmetic (``permute`` swaps indices, ``reshape`` re-linearizes), elementwise prims become
:class:`~kiln.schedule.loops.Apply` nodes, and a reduction computed by this kernel becomes a
:class:`~kiln.schedule.loops.Reduce` over the kernel's ``r`` loop, which is only possible at the
kernel's own row (anything else raises :class:`NotFusable`, and the scheduler keeps the value
in memory instead).

Expressions are interned: two requests for the same element give the same object, so a value
used twice in a kernel is computed once (common-subexpression elimination for free).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir.graph import InputKind, Node, Value
from kiln.ir.op import Op, Tag, op_def
from kiln.ir.symbolic import Dim, Sym
from kiln.ir.types import concrete
from kiln.ops import attrs as A
from kiln.schedule import index as ix
from kiln.schedule.index import Index
from kiln.schedule.loops import (
    Apply,
    Buffer,
    Const,
    Expr,
    IndexValue,
    Load,
    Rand,
    Reduce,
    ReduceKind,
)
from kiln.schedule.program import View
from kiln.schedule.views import VIEW_OPS

MultiIndex = tuple[Index, ...]


class NotFusable(Exception):
    """The value cannot be computed inside this kernel (the scheduler keeps it in memory)."""


REDUCE_KINDS = {
    Op.SUM: ReduceKind.SUM,
    Op.PROD: ReduceKind.PROD,
    Op.AMAX: ReduceKind.MAX,
    Op.AMIN: ReduceKind.MIN,
    Op.ARGMAX: ReduceKind.ARGMAX,
    Op.ARGMIN: ReduceKind.ARGMIN,
}


def reduced_dims(node: Node) -> tuple[int, ...]:
    attrs = node.attrs
    return (attrs.dim,) if node.op in (Op.ARGMAX, Op.ARGMIN) else tuple(attrs.dims)


def shape_of(value: Value) -> tuple[Dim, ...]:
    """``value``'s shape; symbolic dims stay symbolic (what the kernels decide on them is
    guarded: ``kiln/backends/kiln.py``)."""
    return tuple(value.type.shape)


@dataclass(frozen=True)
class RowSpace:
    """The iteration space of a reduction kernel: ``shape`` is the reduced operand's shape,
    ``dims`` the reduced dims; rows (``x``) run over the kept dims, ``r`` over the reduced."""

    shape: tuple[Dim, ...]
    dims: tuple[int, ...]

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.dims)

    @property
    def xnumel(self) -> Dim:
        return _product(self.shape[d] for d in self.kept)

    @property
    def rnumel(self) -> Dim:
        return _product(self.shape[d] for d in self.dims)

    def row_index(self, x: Index) -> MultiIndex:
        return ix.decompose(x, [self.shape[d] for d in self.kept])

    def full_index(self, x: Index, r: Index) -> MultiIndex:
        full: list[Index] = [Index()] * len(self.shape)
        for dim, index in zip(self.kept, self.row_index(x), strict=True):
            full[dim] = index
        for dim, index in zip(
            self.dims, ix.decompose(r, [self.shape[d] for d in self.dims]), strict=True
        ):
            full[dim] = index
        return tuple(full)


def _product(sizes: Any) -> Dim:
    total = 1
    for size in sizes:
        total *= size
    return total


class Lowering:
    """Builds the expressions of one kernel.

    ``layouts``: values in memory (graph inputs, earlier kernels' and externs' results, strided
    views of them). ``local``: values this kernel computes itself (never loaded, even when they
    are also stored). ``reductions``: reduction results this kernel computes over ``rows``.
    """

    def __init__(
        self,
        layouts: dict[Value, View],
        local: set[Value],
        x: Index,
        r: Index | None = None,
        rows: RowSpace | None = None,
        reductions: set[Value] | frozenset[Value] = frozenset(),
    ) -> None:
        self.layouts = layouts
        self.local = local
        self.local_buffers = {id(layouts[v].buffer) for v in local if v in layouts}
        self.x, self.r, self.rows = x, r if r is not None else Index(), rows
        self.reductions = reductions
        self.touched: set[Value] = set()  # every graph value the expressions read or compute
        self.loaded: set[Value] = set()  # values read from memory
        self.nodes: dict[int, Node] = {}  # the graph nodes computed in the kernel
        self._memo: dict[tuple[int, MultiIndex], Expr] = {}
        self._interned: dict[tuple[Any, ...], Expr] = {}
        self._masks: list[Expr] = []

    # -- building blocks --------------------------------------------------------------------

    def intern(self, expr: Expr) -> Expr:
        key = _intern_key(expr)
        return self._interned.setdefault(key, expr)

    def const(self, value: Any, dtype: torch.dtype) -> Expr:
        if isinstance(value, Sym):  # (a size: the kernel is given it; as an int64, converted)
            size = self.intern(IndexValue(torch.int64, Index((), value)))
            return size if dtype == torch.int64 else self.apply(Op.CONVERT, (size,), dtype)
        if dtype == torch.bool:
            value = bool(value)
        elif not dtype.is_floating_point:
            value = int(value)
        else:
            value = float(value)
        return self.intern(Const(dtype, value))

    def apply(self, op: Op, args: Sequence[Expr], dtype: torch.dtype) -> Expr:
        return self.intern(Apply(dtype, op, tuple(args)))

    def index_value(self, index: Index) -> Expr:
        if index.is_constant:
            return self.const(index.const, torch.int64)
        return self.intern(IndexValue(torch.int64, index))

    def in_range(self, index: Index, low: Dim, high: Dim) -> Expr | None:
        """A bool expression ``low <= index < high``; None when always true."""
        lo, hi = ix.bounds(index)
        checks: list[Expr] = []
        value = self.index_value(index)
        if lo < low:
            checks.append(self.apply(Op.GE, (value, self.const(low, torch.int64)), torch.bool))
        if hi >= high:
            checks.append(self.apply(Op.LT, (value, self.const(high, torch.int64)), torch.bool))
        if not checks:
            return None
        return checks[0] if len(checks) == 1 else self.apply(Op.LOGICAL_AND, checks, torch.bool)

    def load_view(self, view: View, index: MultiIndex, dtype: torch.dtype) -> Expr:
        offset = ix.linear(index, view.strides, view.offset)
        mask = self._mask()
        other: Any = False if dtype == torch.bool else 0
        return self.intern(Load(dtype, view.buffer, offset, mask, other))

    def _mask(self) -> Expr | None:
        if not self._masks:
            return None
        mask = self._masks[0]
        for more in self._masks[1:]:
            mask = self.apply(Op.LOGICAL_AND, (mask, more), torch.bool)
        return mask

    # -- values ------------------------------------------------------------------------------

    def load(self, value: Value, index: MultiIndex) -> Expr:
        key = (id(value), index)
        if not self._masks and key in self._memo:
            return self._memo[key]
        self.touched.add(value)
        layout = self.layouts.get(value)
        if (
            layout is not None
            and value not in self.local
            and (value.node is None or id(layout.buffer) not in self.local_buffers)
        ):
            self.loaded.add(value)
            expr = self.load_view(layout, index, value.type.dtype)
        elif value.node is None:
            raise NotFusable(f"{value.name} is an input without a layout")
        else:
            expr = self.lower(value.node, value, index)
        if not self._masks:
            self._memo[key] = expr
        return expr

    def lower(self, node: Node, value: Value, index: MultiIndex) -> Expr:
        self.nodes.setdefault(id(node), node)
        if node.op in REDUCE_KINDS:
            return self.reduction(node, value, index)
        rule = RULES.get(node.op)
        if rule is None:
            if Tag.ELEMENTWISE in op_def(node.op).tags:
                return elementwise(self, node, value, index)
            raise NotFusable(f"{node.op.printed_name} is computed outside kernels")
        return rule(self, node, value, index)

    def reduction(self, node: Node, value: Value, index: MultiIndex) -> Expr:
        rows = self.rows
        operand = node.inputs[0]
        assert isinstance(operand, Value)
        if (
            rows is None
            or value not in self.reductions
            or rows.shape != shape_of(operand)
            or rows.dims != tuple(sorted(reduced_dims(node)))
            or index != rows.row_index(self.x)
        ):
            raise NotFusable(f"{value.name} is a reduction of another row space or row")
        if rows.rnumel == 0:  # an empty row: the identity (eager rejects max/min/arg* of none)
            if node.op not in (Op.SUM, Op.PROD):
                raise NotFusable(f"{node.op.printed_name} of an empty dim")
            return self.const(int(node.op is Op.PROD), value.type.dtype)
        # The whole row, whatever selection reads the result: a mask of the reader (a stack
        # piece's positions, which run along r when the stack has the row's length) would
        # drop elements from the reduction. Its reads are in bounds for every row.
        masks, self._masks = self._masks, []
        try:
            body = self.load(operand, rows.full_index(self.x, self.r))
        finally:
            self._masks = masks
        return self.intern(Reduce(value.type.dtype, REDUCE_KINDS[node.op], body))

    def masked(self, mask: Expr | None, compute: Callable[[], Expr]) -> Expr:
        """``compute()`` with every load it makes predicated on ``mask``."""
        if mask is None:
            return compute()
        self._masks.append(mask)
        try:
            return compute()
        finally:
            self._masks.pop()


def _intern_key(expr: Expr) -> tuple[Any, ...]:
    if isinstance(expr, Const):
        return ("const", expr.dtype, type(expr.value), expr.value)
    if isinstance(expr, IndexValue):
        return ("index", expr.index)
    if isinstance(expr, Load):
        return ("load", id(expr.buffer), expr.offset, id(expr.mask), expr.other, expr.dtype)
    if isinstance(expr, Apply):
        return ("apply", expr.op, expr.dtype, tuple(id(a) for a in expr.args))
    if isinstance(expr, Reduce):
        return ("reduce", expr.kind, expr.dtype, id(expr.value))
    if isinstance(expr, Rand):
        return ("rand", id(expr.seed), expr.offset, expr.normal)
    raise TypeError(type(expr).__name__)


# ---------------------------------------------------------------------------------------------
# rules: (lowering, node, output value, output index) -> expression

Rule = Callable[[Lowering, Node, Value, MultiIndex], Expr]


def _operand(node: Node, i: int) -> Value:
    operand = node.inputs[i]
    assert isinstance(operand, Value), f"{node.op.name} operand {i} is not a tensor"
    return operand


def elementwise(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    exponent = node.inputs[1] if node.op is Op.POW else None
    if exponent in (2, 3) and isinstance(node.inputs[0], Value) and not isinstance(exponent, bool):
        base = lowering.load(node.inputs[0], index)  # x**2, x**3 as products (as eager does)
        square = lowering.apply(Op.MUL, (base, base), value.type.dtype)
        return square if exponent == 2 else lowering.apply(Op.MUL, (square, base), value.type.dtype)
    tensors = [o for o in node.inputs if isinstance(o, Value)]
    scalar_dtype = value.type.dtype if node.op is Op.WHERE else tensors[0].type.dtype
    if node.op is Op.CONVERT:
        scalar_dtype = value.type.dtype
    args = [
        lowering.load(o, index) if isinstance(o, Value) else lowering.const(o, scalar_dtype)
        for o in node.inputs
    ]
    return lowering.apply(node.op, args, value.type.dtype)


def _reshape(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source = _operand(node, 0)
    flat = ix.linear(index, ix.contiguous_strides(shape_of(value)))
    return lowering.load(source, ix.decompose(flat, shape_of(source)))


def _permute(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source_index: list[Index] = [Index()] * len(index)
    for out_dim, in_dim in enumerate(node.attrs.dims):
        source_index[in_dim] = index[out_dim]
    return lowering.load(_operand(node, 0), tuple(source_index))


def _broadcast(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source = _operand(node, 0)
    sizes = shape_of(source)
    source_index = tuple(
        Index() if sizes[i] == 1 else index[out_dim] for i, out_dim in enumerate(node.attrs.dims)
    )
    return lowering.load(source, source_index)


def _expand(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source = _operand(node, 0)
    sizes = shape_of(source)
    return lowering.load(
        source, tuple(Index() if s == 1 else i for s, i in zip(sizes, index, strict=True))
    )


def _slice(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    attrs: A.SliceAttrs = node.attrs
    moved = list(index)
    moved[attrs.dim] = index[attrs.dim] * attrs.step + concrete(attrs.start)
    return lowering.load(_operand(node, 0), tuple(moved))


def _squeeze(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source = _operand(node, 0)
    rest = iter(index)
    dims = set(node.attrs.dims)
    full = tuple(Index() if d in dims else next(rest) for d in range(source.type.rank))
    return lowering.load(source, full)


def _unsqueeze(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    dims = set(node.attrs.dims)
    return lowering.load(_operand(node, 0), tuple(i for d, i in enumerate(index) if d not in dims))


def _flip(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    sizes = shape_of(value)
    flipped = list(index)
    for dim in node.attrs.dims:
        flipped[dim] = index[dim] * -1 + (sizes[dim] - 1)
    return lowering.load(_operand(node, 0), tuple(flipped))


def _shifted_load(
    lowering: Lowering, source: Value, index: MultiIndex, dim: int, low: Dim, mask: Expr | None
) -> Expr:
    """``source`` at ``index`` with ``index[dim] - low`` (out-of-range positions masked)."""
    shifted = list(index)
    shifted[dim] = index[dim] - low
    try:
        return lowering.masked(mask, lambda: lowering.load(source, tuple(shifted)))
    except ValueError:  # a view of the source divides a possibly negative index: clamp it
        size = shape_of(source)[dim]
        raw = lowering.index_value(shifted[dim])
        zero = lowering.const(0, torch.int64)
        assert mask is not None
        clamped = lowering.apply(Op.WHERE, (mask, raw, zero), torch.int64)
        shifted[dim] = ix.indirect(clamped, size)
        return lowering.masked(mask, lambda: lowering.load(source, tuple(shifted)))


def _pad(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    attrs: A.PadAttrs = node.attrs
    source = _operand(node, 0)
    sizes = shape_of(source)
    current = list(index)
    masks: list[Expr] = []
    interior = attrs.interior or (0,) * len(sizes)
    for dim, low in enumerate(attrs.low):
        current[dim] = index[dim] - concrete(low)
        if interior[dim]:  # every (interior + 1)-th position holds an element
            step = interior[dim] + 1
            shift = -(-max(concrete(low), 0) // step) * step  # keeps the divided index >= 0
            shifted = current[dim] + shift
            current[dim] = shifted // step - shift // step
            zero = lowering.const(0, torch.int64)
            on_step = lowering.index_value(shifted % step)
            masks.append(lowering.apply(Op.EQ, (on_step, zero), torch.bool))
        check = lowering.in_range(current[dim], 0, sizes[dim])
        if check is not None:
            masks.append(check)
    mask = None
    for check in masks:
        mask = check if mask is None else lowering.apply(Op.LOGICAL_AND, (mask, check), torch.bool)
    if mask is None:
        return lowering.load(source, tuple(current))
    inside = _padded_source(lowering, source, current, mask)
    fill = lowering.const(attrs.value, value.type.dtype)
    return lowering.apply(Op.WHERE, (mask, inside, fill), value.type.dtype)


def _padded_source(lowering: Lowering, source: Value, index: list[Index], mask: Expr) -> Expr:
    try:
        return lowering.masked(mask, lambda: lowering.load(source, tuple(index)))
    except ValueError:
        clamped = []
        zero = lowering.const(0, torch.int64)
        for dim, size in enumerate(shape_of(source)):
            raw = lowering.index_value(index[dim])
            safe = lowering.apply(Op.WHERE, (mask, raw, zero), torch.int64)
            clamped.append(index[dim] if index[dim].is_constant else ix.indirect(safe, size))
        return lowering.masked(mask, lambda: lowering.load(source, tuple(clamped)))


def _cat(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    dim = node.attrs.dim
    pieces: list[tuple[Value, int, int]] = []
    start = 0
    for source in (o for o in node.inputs if isinstance(o, Value)):
        size = shape_of(source)[dim]
        if size:
            pieces.append((source, start, start + size))
        start += size
    result: Expr | None = None
    for source, low, high in reversed(pieces):
        mask = lowering.in_range(index[dim], low, high)
        piece = _shifted_load(lowering, source, index, dim, low, mask)
        if result is None or mask is None:
            result = piece
        else:
            result = lowering.apply(Op.WHERE, (mask, piece, result), value.type.dtype)
    return result if result is not None else lowering.const(0, value.type.dtype)


def _wrapped(lowering: Lowering, raw: Expr, size: Dim, negative: bool = True) -> Index:
    """An index tensor's value as an :class:`Indirect` index, negatives wrapped (if
    ``negative``), checked against ``size`` where it is read (an index outside raises
    IndexError, as in eager)."""
    if raw.dtype != torch.int64:
        raw = lowering.apply(Op.CONVERT, (raw,), torch.int64)
    if not negative:
        return ix.indirect(raw, size, checked=True)
    zero = lowering.const(0, torch.int64)
    below = lowering.apply(Op.LT, (raw, zero), torch.bool)
    shifted = lowering.apply(Op.ADD, (raw, lowering.const(size, torch.int64)), torch.int64)
    wrapped = lowering.apply(Op.WHERE, (below, shifted, raw), torch.int64)
    return ix.indirect(wrapped, size, checked=True, wrapped=True)


def _gather(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source, positions = _operand(node, 0), _operand(node, 1)
    dim = node.attrs.dim
    if not index:  # 0-d: the only element
        return lowering.load(source, ())
    moved = list(index)
    raw = lowering.load(positions, index)
    moved[dim] = _wrapped(lowering, raw, shape_of(source)[dim], negative=False)
    return lowering.load(source, tuple(moved))


def _index(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    source = _operand(node, 0)
    positions = [o for o in node.inputs[1:] if isinstance(o, Value)]
    dims: tuple[int, ...] = node.attrs.dims
    rank = positions[0].type.rank
    adjacent = dims[-1] - dims[0] == len(dims) - 1
    first = dims[0] if adjacent else 0
    index_part = index[first : first + rank]
    rest = iter(index[:first] + index[first + rank :])
    sizes = shape_of(source)
    full: list[Index] = []
    for dim in range(len(sizes)):
        if dim in dims:
            raw = lowering.load(positions[dims.index(dim)], tuple(index_part))
            full.append(_wrapped(lowering, raw, sizes[dim], node.attrs.negative))
        else:
            full.append(next(rest))
    return lowering.load(source, tuple(full))


def _full(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    return lowering.const(node.attrs.value, value.type.dtype)


def _iota(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    attrs: A.IotaAttrs = node.attrs
    dtype = value.type.dtype
    if not dtype.is_floating_point and isinstance(attrs.start, int) and isinstance(attrs.step, int):
        position = lowering.index_value(index[0] * attrs.step + attrs.start)
        return position if dtype == torch.int64 else lowering.apply(Op.CONVERT, (position,), dtype)
    position = lowering.apply(Op.CONVERT, (lowering.index_value(index[0]),), torch.float64)
    step = lowering.const(attrs.step, torch.float64)
    start = lowering.const(attrs.start, torch.float64)
    scaled = lowering.apply(Op.MUL, (position, step), torch.float64)
    result = lowering.apply(Op.ADD, (scaled, start), torch.float64)
    return lowering.apply(Op.CONVERT, (result,), dtype)


def _random(lowering: Lowering, node: Node, value: Value, index: MultiIndex) -> Expr:
    attrs: A.RandomAttrs = node.attrs
    seed = _operand(node, 0)
    layout = lowering.layouts.get(seed)
    if layout is None:
        raise NotFusable("the random seed is not a graph input")
    offset = ix.linear(index, ix.contiguous_strides(shape_of(value)), concrete(attrs.offset))
    if ix.bounds(offset)[1] >= 2**32:
        raise NotFusable("random offsets past 2**32")
    lowering.touched.add(seed)
    drawn = lowering.intern(Rand(torch.float32, layout.buffer, offset, node.op is Op.RANDOM_NORMAL))
    if attrs.dtype == torch.float32:
        return drawn
    converted = lowering.apply(Op.CONVERT, (drawn,), attrs.dtype)
    if node.op is Op.RANDOM_NORMAL:
        return converted
    largest = 1.0 - torch.finfo(attrs.dtype).eps / 2
    return lowering.apply(
        Op.MINIMUM, (converted, lowering.const(largest, attrs.dtype)), attrs.dtype
    )


RULES: dict[Op, Rule] = {
    Op.WHERE: elementwise,
    Op.CONVERT: elementwise,
    Op.RESHAPE: _reshape,
    Op.PERMUTE: _permute,
    Op.BROADCAST: _broadcast,
    Op.EXPAND: _expand,
    Op.SLICE: _slice,
    Op.SQUEEZE: _squeeze,
    Op.UNSQUEEZE: _unsqueeze,
    Op.FLIP: _flip,
    Op.PAD: _pad,
    Op.CAT: _cat,
    Op.GATHER: _gather,
    Op.INDEX: _index,
    Op.FULL: _full,
    Op.IOTA: _iota,
    Op.RANDOM_UNIFORM: _random,
    Op.RANDOM_NORMAL: _random,
}

# Ops whose lowering reads an operand at other positions than the element it computes: two of
# them reading one value may read it at two places (the scheduler counts such reads apart).
REINDEXING_OPS = VIEW_OPS | {Op.FLIP, Op.PAD, Op.CAT, Op.GATHER, Op.INDEX}

# Ops whose results always live in memory, computed by PyTorch (``ExternCall`` steps).
EXTERN_OPS = frozenset(
    {
        Op.MM,
        Op.BMM,
        Op.ADDMM,
        Op.BADDBMM,
        Op.CONVOLUTION,
        Op.SDPA,
        Op.CUMSUM,
        Op.SORT,
        Op.TOPK,
        Op.EXTERN,
        Op.SCATTER,
        Op.SCATTER_ADD,
        Op.INDEX_PUT,
    }
)


def lowerable(op: Op) -> bool:
    return (
        op in RULES
        or op in REDUCE_KINDS
        or (op not in EXTERN_OPS and Tag.ELEMENTWISE in op_def(op).tags)
    )


def in_kernels(node: Node) -> bool:
    """Whether a loop kernel computes ``node``: its op lowers (it is no extern), and its
    operands and results live on one device."""
    if node.op in EXTERN_OPS or not lowerable(node.op):
        return False
    devices = {v.type.device for v in node.outputs}
    devices |= {v.type.device for v in node.input_values() if v.kind is not InputKind.RNG_SEED}
    return len(devices) == 1  # a kernel runs on one device; a transfer is an extern


def buffer_view(buffer: Buffer) -> View:
    return View(buffer, buffer.shape, buffer.strides, buffer.offset)
