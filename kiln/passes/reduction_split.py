"""Reduction splitting: a reduction over leading and trailing dims becomes two reductions.

A BatchNorm in training reduces ``[N, C, H, W]`` over ``(0, 2, 3)``: only ``C`` rows, each
``N*H*W`` long and strided. One kernel gives each row to one program, so a ResNet's first
BatchNorm (64 rows of 802816) keeps 64 of a GPU's thousands of cores busy. Reducing the
contiguous trailing dims first gives ``N*C`` rows of ``H*W`` (parallel and coalesced), and the
second reduction over ``N`` is small::

    before:  t1 = sum(t0, dims=(0, 2, 3))            # [64, 64, 112, 112] -> [64]
    after:   t2 = sum(t0, dims=(2, 3))               # -> [64, 64]
             t1 = sum(t2, dims=(0,))                 # -> [64]

A reduction over leading dims only (a bias or LayerNorm weight gradient: ``[8192, 768]``
summed over rows) keeps few outputs (768) over long strided columns. A column kernel gives 64
outputs to a program, so 12 programs did all the work (about 0.2-0.5 ms each on BERT-base's
backward, where eager's kernels take 50 us). Chunking the rows gives every program a share::

    before:  t1 = sum(t0, dims=(0,))                 # [8192, 768] -> [768]
    after:   t2 = sum(reshape(t0, [32, 256, 768]), dims=(1,))   # -> [32, 768]
             t1 = sum(t2, dims=(0,))                 # -> [768]

16-bit floats are summed in float32 across both steps (as one reduction accumulates), then
rounded once. Max and min split the same way; arg-reductions and products are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ir.symbolic import Dim, Sym
from kiln.ir.types import same_shape, same_size
from kiln.ops import prims
from kiln.ops.translations.common import size_scalar
from kiln.passes.rewriting import rewrite_nodes, take_over

SPLIT_OPS = (Op.SUM, Op.AMAX, Op.AMIN)
MAX_ROWS = 4096  # split only reductions with fewer output elements than this
MIN_INNER = 64  # and whose trailing reduced dims hold at least this many elements
# Column reductions: a Triton column kernel covers COLUMN_BLOCK outputs per program
# (codegen/triton.choose_blocks); split rows into chunks until about TARGET_PROGRAMS programs
# run (two per SM of a 132-SM H100), keeping chunks at least MIN_CHUNK rows long.
COLUMN_BLOCK = 64
TARGET_PROGRAMS = 264
MIN_CHUNK = 64
MIN_ELEMENTS = 1 << 18  # smaller column reductions (a split's own second step) stay whole
# Spatial pooling of channels-last activations (a squeeze-excitation's mean) aims at more
# programs, eight per SM, in chunks of at least 128 rows: at 128x96x56x56 bf16 on an H100
# 1056 programs took 0.126 ms against 0.233 at 264 (torch.compile 0.176), while BatchNorm's
# statistics ran slower so (``benchmarks/reduction_programs.py``); chunks of 98 rows lost
# (128x240x14x14: 0.079 against 0.064 ms whole).
POOLING_PROGRAMS = 1056
POOLING_MIN_CHUNK = 128
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _operand_shape(node: Node) -> tuple[Dim, ...] | None:
    """The shape a splittable reduction reduces (symbolic sizes too: each plan's choices are
    comparisons, guarded, and chunks divide a symbolic row count only where guarded to)."""
    if node.op not in SPLIT_OPS or not isinstance(node.inputs[0], Value):
        return None
    return tuple(node.inputs[0].type.shape)


def _plan(node: Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(trailing dims, leading dims) of a reduction worth splitting (symbolic sizes too: a
    BatchNorm over a dynamic batch reduced as one row per channel ran 6x slower than split,
    its r index divided and taken modulo the sizes at every element)."""
    shape = _operand_shape(node)
    if shape is None:
        return None
    dims = tuple(sorted(node.attrs.dims))
    trailing: list[int] = []
    for dim in range(len(shape) - 1, -1, -1):
        if dim not in dims:
            break
        trailing.insert(0, dim)
    leading = tuple(d for d in dims if d not in trailing)
    if not trailing or not leading:
        return None
    rows: Dim = 1
    for dim, size in enumerate(shape):
        if dim not in dims:
            rows *= size
    inner: Dim = 1
    for dim in trailing:
        inner *= shape[dim]
    if rows >= MAX_ROWS or inner < MIN_INNER:
        return None
    return tuple(trailing), leading


def _product(sizes: tuple[Dim, ...]) -> Dim:
    total: Dim = 1
    for size in sizes:
        total = total * size
    return total


def _chunks(rows: Dim, kept: Dim, target: int = 0, min_chunk: int = MIN_CHUNK) -> int | None:
    """How many chunks to cut ``rows`` into for a column reduction keeping ``kept`` outputs,
    aiming at ``target`` programs (0: ``TARGET_PROGRAMS``) of at least ``min_chunk`` rows
    each (None: it has programs enough, or rows too few to cut). A symbolic ``rows`` is cut
    as its hint would be, guarded to sizes the count divides (GPT-2's bias gradients over a
    dynamic batch ran 0.71x of static speed uncut); other sizes compile again."""
    target = target or TARGET_PROGRAMS
    programs = (kept + COLUMN_BLOCK - 1) // COLUMN_BLOCK
    if programs == 0 or 2 * programs >= target or rows * kept < MIN_ELEMENTS:
        return None
    wanted = (target + programs - 1) // programs
    if isinstance(rows, Sym):
        # A power of two (rows of any size it divides, long enough, share the program):
        # the largest dividing the hint, up to the first at least ``wanted``.
        least = wanted.hint if isinstance(wanted, Sym) else wanted  # (no guard: a choice)
        cap = min(1 << (least - 1).bit_length(), rows.hint // min_chunk)
        powers = [1 << k for k in range(1, cap.bit_length()) if rows.hint % (1 << k) == 0]
        if not powers or rows % powers[-1] != 0 or rows // powers[-1] < min_chunk:
            return None  # (false at the hint: these questions only record their guards)
        return powers[-1]
    divisors = [d for d in range(2, rows // min_chunk + 1) if rows % d == 0]
    if not divisors:
        return None
    above = [d for d in divisors if d >= wanted]
    return above[0] if above else divisors[-1]


def _column_plan(node: Node) -> tuple[Dim, int] | None:
    """(rows, chunks) of a reduction over leading dims only, worth chunking: on the GPU,
    whose column kernels give each program 64 outputs. The C++ kernels already run columns
    in parallel, and chunked ones index each element by division (bert_tiny's decoder-bias
    gradient took 1.7 ms a step chunked)."""
    shape = _operand_shape(node)
    if shape is None or not _chunks_columns(node.inputs[0]):  # type: ignore[arg-type]
        return None
    dims = tuple(sorted(node.attrs.dims))
    if not dims or dims != tuple(range(len(dims))) or len(dims) == len(shape):
        return None
    rows = _product(shape[: len(dims)])
    chunks = _chunks(rows, _product(shape[len(dims) :]))
    return None if chunks is None else (rows, chunks)


def _channels_last_shape(node: Node, dims: tuple[int, ...]) -> tuple[Dim, ...] | None:
    """The shape of a 4-D reduction over ``dims`` of a value held channels-last."""
    shape = _operand_shape(node)
    if shape is None or len(shape) != 4 or tuple(sorted(node.attrs.dims)) != dims:
        return None
    return shape if _holds_channels_last(node.inputs[0]) else None  # type: ignore[arg-type]


def _channels_last_plan(node: Node) -> tuple[Dim, int | None] | None:
    """(rows, chunks or None) of a BatchNorm-style reduction of an ``[N, C, H, W]`` tensor on
    the GPU, which holds it channels-last (``[N, H, W, C]`` in memory, as it feeds or comes
    from a convolution): there it is a column reduction of ``[N*H*W, C]``."""
    shape = _channels_last_shape(node, (0, 2, 3))
    if shape is None:
        return None
    rows = shape[0] * shape[2] * shape[3]
    return rows, _chunks(rows, shape[1])


def _pooling_plan(node: Node) -> tuple[Dim, int] | None:
    """(rows, chunks) of a spatial pooling, ``[N, C, H, W]`` reduced over ``(2, 3)``, held
    channels-last on the GPU: ``N`` column reductions of ``[H*W, C]`` whose ``N*C`` outputs
    are too few programs for their long rows (a squeeze-excitation's mean over 56x56)."""
    shape = _channels_last_shape(node, (2, 3))
    if shape is None:
        return None
    rows = shape[2] * shape[3]
    chunks = _chunks(rows, shape[0] * shape[1], POOLING_PROGRAMS, POOLING_MIN_CHUNK)
    return None if chunks is None else (rows, chunks)


def _chunks_columns(value: Value) -> bool:
    """Whether column reductions of ``value`` are cut into chunks (on the GPU)."""
    return value.type.device.type == "cuda"


def _holds_channels_last(value: Value) -> bool:
    """Whether the scheduler lays 4-D values out channels-last (on the GPU, around convs)."""
    return value.type.device.type == "cuda"


def _emit(node: Node, builder: GraphBuilder, deviations: _Deviations | None) -> None:
    operand = node.inputs[0]
    assert isinstance(operand, Value)
    dtype = operand.type.dtype
    widen = node.op is Op.SUM and dtype in _LOW_PRECISION
    with builder.origin_scope(node.origin):
        steps, inner, outer = _steps(node, _widened(operand, widen))
        if deviations is not None and outer is not None and _chunks_columns(operand):
            values, _, _ = _steps(node, _widened(deviations.source, widen))
            result = _spread_sum(values, inner, outer)
        else:
            result = prims.call(node.op, steps, dims=inner)
            if outer is not None:
                result = prims.call(node.op, result, dims=outer)
        if widen:
            result = prims.convert(result, dtype=dtype)
    take_over(node.output, result)


def _widened(value: Value, widen: bool) -> Value:
    return prims.convert(value, dtype=torch.float32) if widen else value


def _steps(node: Node, source: Value) -> tuple[Value, tuple[int, ...], tuple[int, ...] | None]:
    """``source`` (shaped as ``node``'s operand) laid out for ``node``'s split, with the dims
    its first step reduces and the dims the second step then reduces (None: one step)."""
    channels_last = _channels_last_plan(node)
    pooling = _pooling_plan(node)
    plan = _plan(node)
    shape = source.type.shape
    if pooling is not None:
        rows, pieces = pooling
        n, c = shape[:2]
        rows_first = prims.permute(source, dims=(0, 2, 3, 1))
        return prims.reshape(rows_first, shape=(n, pieces, rows // pieces, c)), (2,), (1,)
    if channels_last is not None:
        rows, chunks = channels_last
        flat = prims.reshape(prims.permute(source, dims=(0, 2, 3, 1)), shape=(rows, shape[1]))
        return _column_steps(flat, rows, chunks, (shape[1],))
    if plan is not None:
        trailing, leading = plan
        return source, trailing, leading
    columns = _column_plan(node)
    assert columns is not None
    rows, chunks = columns
    return _column_steps(source, rows, chunks, shape[len(node.attrs.dims) :])


def _column_steps(
    source: Value, rows: Dim, chunks: int | None, kept: tuple[Dim, ...]
) -> tuple[Value, tuple[int, ...], tuple[int, ...] | None]:
    """The leading ``rows`` of ``source`` (shape ``[..., *kept]``) as one column reduction, or
    as ``chunks`` of rows reduced first, then across chunks."""
    if chunks is None:
        return prims.reshape(source, shape=(rows, *kept)), (0,), None
    return prims.reshape(source, shape=(chunks, rows // chunks, *kept)), (1,), (0,)


def _spread_sum(values: Value, inner: tuple[int, ...], outer: tuple[int, ...]) -> Value:
    """The sum of squared deviations of ``values`` from their mean over ``inner + outer``, in
    two steps whose first reads ``values`` once, in one loop: each group (``inner``) sums its
    values and their squares, both shifted by the group's first value; the second step adds
    the groups' own spreads and their means' spread about the mean of all (Chan, Golub and
    LeVeque's pairwise update).

    Each group's spread is its sum of squares less its sum squared over its size. That loses
    digits only as the group's mean lies far from its first value, counted in deviations: the
    shift keeps a mean of 1000 with spread 0.01 exact where unshifted sums lost it all, and an
    outlier first costs only its own group. The group means are kept relative to the first
    group's shift, so their spread too keeps its digits however far from zero the values lie.
    (Taking each group's deviations from its own mean instead needs the mean first: a group
    too long for registers then read its values twice, at 41% of copy speed on an H100.)"""
    shape = values.type.shape
    kept = tuple(d for d in range(len(shape)) if d not in inner)
    first = values
    for dim in inner:
        first = prims.slice(first, dim=dim, start=0, stop=1)
    groups = tuple(shape[d] for d in kept)
    shifts = prims.reshape(first, shape=groups)
    shifted = prims.sub(values, prims.broadcast(shifts, shape=shape, dims=kept))
    group_size = size_scalar(_product(tuple(shape[d] for d in inner)))
    sums = prims.sum(shifted, dims=inner)
    squares = prims.sum(prims.mul(shifted, shifted), dims=inner)
    group_means = prims.div(sums, group_size)
    within = prims.sub(squares, prims.mul(sums, group_means))
    remaining = tuple(d for d in range(len(groups)) if d not in outer)
    origin = shifts
    for dim in outer:
        origin = prims.slice(origin, dim=dim, start=0, stop=1)
    origin = prims.reshape(origin, shape=tuple(groups[d] for d in remaining))
    offsets = prims.sub(shifts, prims.broadcast(origin, shape=groups, dims=remaining))
    centres = prims.add(offsets, group_means)
    group_count = _product(tuple(groups[d] for d in outer))
    mean = prims.div(prims.sum(centres, dims=outer), size_scalar(group_count))
    apart = prims.sub(centres, prims.broadcast(mean, shape=groups, dims=remaining))
    between = prims.sum(prims.mul(apart, apart), dims=outer)
    return prims.add(prims.sum(within, dims=outer), prims.mul(between, group_size))


@dataclass(frozen=True)
class _Deviations:
    """A sum of ``(source - mean) ** 2`` over its dims, ``mean`` the sum of ``source`` over the
    same dims divided by ``count``, broadcast back (``translations.reductions.moments``)."""

    source: Value
    count: Dim


_SHAPE_ONLY = (Op.UNSQUEEZE, Op.SQUEEZE, Op.RESHAPE, Op.BROADCAST, Op.EXPAND)


def _deviations_of(node: Node) -> _Deviations | None:
    """What ``node`` sums the squared deviations of, if it does (a variance: BatchNorm's
    statistics), checked down to which reduced element each mean is subtracted from."""
    if node.op is not Op.SUM:
        return None
    square = node.inputs[0].node if isinstance(node.inputs[0], Value) else None
    if square is None or square.op is not Op.MUL or square.inputs[0] is not square.inputs[1]:
        return None
    difference = square.inputs[0].node  # type: ignore[union-attr]
    if difference is None or difference.op is not Op.SUB:
        return None
    for source, mean in (difference.inputs, difference.inputs[::-1]):
        if isinstance(source, Value) and isinstance(mean, Value):
            count = mean_count(source, mean, tuple(sorted(node.attrs.dims)))
            if count is not None and source.type.dtype not in _LOW_PRECISION:
                return _Deviations(source, count)
    return None


def mean_count(source: Value, mean: Value, dims: tuple[int, ...]) -> Dim | None:
    """The count ``mean`` divides ``source``'s sum over ``dims`` by, when ``mean`` is that
    quotient broadcast so that each element of ``source`` meets its own row's mean."""
    chain: list[Node] = []  # the shape-only steps on either side of the division
    quotient: Node | None = None
    value = mean
    while value.node is not None:
        step = value.node
        if step.op is Op.DIV and quotient is None and isinstance(step.inputs[0], Value):
            quotient = step
        elif step.op in _SHAPE_ONLY:
            chain.append(step)
        else:
            break
        value = step.inputs[0]  # type: ignore[assignment]
    total = value.node
    if quotient is None or total is None or total.op is not Op.SUM or total.inputs[0] is not source:
        return None
    if tuple(sorted(total.attrs.dims)) != dims:
        return None
    shape = source.type.shape
    count = _product(tuple(shape[d] for d in dims))
    divisor = quotient.inputs[1]
    if not (
        count.same(divisor)
        if isinstance(count, Sym)
        else isinstance(divisor, int | float)
        and not isinstance(divisor, bool)
        and float(divisor) == float(count)
    ):
        return None
    # Which dim of ``source`` each dim of the value stands for (None: a unit dim).
    origin: list[int | None] = [d for d in range(len(shape)) if d not in dims]
    for step in reversed(chain):
        moved = _moved(step, origin)
        if moved is None:
            return None
        origin = moved
    if len(origin) != len(shape) or not same_shape(mean.type.shape, shape):
        return None
    for dim, came_from in enumerate(origin):
        if came_from is None and dim not in dims and not _is_one(shape[dim]):
            return None
        if came_from is not None and came_from != dim:
            return None
    return count


def _moved(step: Node, origin: list[int | None]) -> list[int | None] | None:
    """``origin`` (see ``mean_count``) after a shape-only ``step``; None when a reshape
    regroups dims. (Only unit dims grow, so the final shape check catches stretching.)"""
    before = step.inputs[0].type.shape  # type: ignore[union-attr]
    after = step.output.type.shape
    moved: list[int | None] = list(origin)
    if step.op is Op.UNSQUEEZE:
        for dim in sorted(step.attrs.dims):
            moved.insert(dim, None)
    elif step.op is Op.SQUEEZE:
        moved = [o for d, o in enumerate(origin) if d not in step.attrs.dims]
    elif step.op is Op.BROADCAST:
        moved = [None] * len(after)
        for d, out in enumerate(step.attrs.dims):
            moved[out] = origin[d]
    elif step.op is Op.RESHAPE:  # only unit dims may come or go
        real = [(o, size) for o, size in zip(origin, before, strict=True) if not _is_one(size)]
        sizes = [size for size in after if not _is_one(size)]
        if len(real) != len(sizes) or not all(
            same_size(size, other) for (_, size), other in zip(real, sizes, strict=True)
        ):
            return None
        remaining = iter(real)
        moved = [None if _is_one(size) else next(remaining)[0] for size in after]
    return moved


def _is_one(size: Dim) -> bool:
    return not isinstance(size, Sym) and size == 1


def _chosen(node: Node) -> bool:
    plans = (_channels_last_plan, _pooling_plan, _plan, _column_plan)
    return any(plan(node) is not None for plan in plans)


def split_reductions(graph: Graph) -> Graph:
    """``graph`` with its reductions split as the module docstring says."""
    chosen = {node for node in graph.nodes if _chosen(node)}
    # Matched before any rewrite: a variance's mean reads the sum its split replaces.
    deviations = {node: _deviations_of(node) for node in chosen}
    return rewrite_nodes(graph, chosen, lambda node, b: _emit(node, b, deviations[node]))
