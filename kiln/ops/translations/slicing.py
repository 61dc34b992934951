"""Translations that take parts of a tensor or rearrange its elements in place: narrow, select,
diagonal, diag, flip, roll, tril/triu and F.pad.

They build on ``slice``, ``flip``, ``cat`` and ``pad``; a diagonal is a strided slice of the
flattened matrix, and a triangle a ``where`` over an ``iota`` comparison::

    x.diagonal()     ->  slice(reshape(x, shape=(12,)), dim=0, start=0, stop=11, step=5)
    x.roll(1, 0)     ->  cat(slice(x, dim=0, start=2, stop=3), slice(x, dim=0, start=0, stop=2))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.symbolic import Dim, Sym
from kiln.ops import prims
from kiln.ops.sampling import ALL
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.common import broadcast_to, normalize_dim
from kiln.ops.translations.shape import (
    case,
    numel_of,
    reorder,
    reshape,
    shape_args,
    shape_of,
    squeeze_dims,
    take_slice,
    tensor_calls,
)
from kiln.ops.translations.table import Call, FallbackToExtern, translation

# ---------------------------------------------------------------------------------------------
# narrow, select, diagonal, diag


@translation(
    torch.Tensor.narrow,
    torch.narrow,
    samples=tensor_calls(
        [
            case((5, 4), 0, 1, 3),
            case((5, 4), -1, -3, 2, note="negative dim and start"),
            case((5, 4), 1, 4, 0, note="empty at the end"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def narrow(input: Value, dim: int, start: int | Value, length: int) -> Value:
    if isinstance(start, Value):
        raise FallbackToExtern  # a start given by a tensor
    shape = shape_of(input)
    dim = normalize_dim(dim, len(shape), "narrow")
    size = shape[dim]
    if not -size <= start <= size:
        raise IndexError(
            f"start out of range (expected to be in range of [{-size}, {size}], but got {start})"
        )
    begin: Dim = start + size if start < 0 else start
    if length < 0:
        raise RuntimeError("narrow(): length must be non-negative.")
    if begin + length > size:
        raise RuntimeError(f"start ({begin}) + length ({length}) exceeds dimension size ({size}).")
    return take_slice(input, dim, begin, begin + length)


def select_index(value: Value, dim: int, index: Dim, op: str = "select") -> Value:
    """``value`` indexed by ``index`` along ``dim``, which disappears (negative index wraps)."""
    shape = shape_of(value)
    dim = normalize_dim(dim, len(shape), op)
    if not shape:
        raise IndexError(f"{op}() cannot be applied to a 0-dim tensor.")
    size = shape[dim]
    if not -size <= index < size:
        raise IndexError(
            f"{op}(): index {index} out of range for tensor of size {list(shape)} at dimension "
            f"{dim}"
        )
    if index < 0:
        index = index + size
    return squeeze_dims(take_slice(value, dim, index, index + 1), (dim,))


@translation(
    torch.Tensor.select,
    torch.select,
    samples=tensor_calls(
        [case((3, 4), 0, 1), case((3, 4), -1, -1, note="negative"), case((2,), 0, 1)]
    ),
    dtypes=ALL,
    view=True,
)
def select(input: Value, dim: int, index: Dim) -> Value:
    return select_index(input, dim, index if isinstance(index, Sym) else int(index))


def diagonal_of(value: Value, offset: int, dim1: int, dim2: int) -> Value:
    """The diagonal of dims ``dim1``, ``dim2`` as a last dim: a strided slice of their product."""
    shape = shape_of(value)
    if len(shape) < 2:
        raise RuntimeError("diagonal dimensions requires ndim larger than 1")
    first, second = (
        normalize_dim(dim1, len(shape), "diagonal"),
        normalize_dim(dim2, len(shape), "diagonal"),
    )
    if first == second:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    rest = [d for d in range(len(shape)) if d not in (first, second)]
    rows, columns = shape[first], shape[second]
    length = max(0, min(rows, columns - offset) if offset >= 0 else min(rows + offset, columns))
    moved = reorder(value, [*rest, first, second])
    flat = reshape(moved, (*(shape[d] for d in rest), rows * columns))
    if length == 0:
        return take_slice(flat, len(rest), 0, 0)
    start = offset if offset >= 0 else -offset * columns
    stop = start + (length - 1) * (columns + 1) + 1
    return take_slice(flat, len(rest), start, stop, columns + 1)


@translation(
    torch.Tensor.diagonal,
    torch.diagonal,
    samples=tensor_calls(
        [
            case((3, 4)),
            case((3, 4), 1, note="offset"),
            case((4, 3), -2, note="negative offset"),
            case((2, 3, 4), 0, -1, 0, note="batched, dims reversed"),
            case((3, 4), offset=5, note="empty"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def diagonal(input: Value, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Value:
    return diagonal_of(input, offset, dim1, dim2)


def _diagonal_matrix(vector: Value, offset: int) -> Value:
    """A square matrix with ``vector`` on diagonal ``offset``: each element followed by ``side``
    zeros, flattened, lands on the diagonal once the matrix is cut to ``side * side``."""
    (count,) = shape_of(vector)
    side = count + abs(offset)
    start = offset if offset >= 0 else -offset * side
    rows = prims.pad(
        reshape(vector, (count, 1)),
        low=(0, 0),
        high=(0, side),
        value=fill_scalar(0, vector.type.dtype),
    )
    flat = reshape(rows, (count * (side + 1),))
    placed = prims.pad(
        flat,
        low=(start,),
        high=(side * side - start - count * (side + 1),),
        value=fill_scalar(0, vector.type.dtype),
    )
    return reshape(placed, (side, side))


@translation(
    torch.Tensor.diag,
    torch.diag,
    samples=tensor_calls(
        [case((3,)), case((3,), 2, note="offset"), case((2,), -1), case((3, 4), 1, note="2-d")]
    ),
    dtypes=ALL,
)
def diag(input: Value, diagonal: int = 0) -> Value:
    if input.type.rank == 1:
        return _diagonal_matrix(input, diagonal)
    if input.type.rank == 2:
        return diagonal_of(input, diagonal, 0, 1)
    raise RuntimeError(f"diag(): Supports 1D or 2D tensors. Got {input.type.rank}D")


# ---------------------------------------------------------------------------------------------
# flip, roll


def flipped(value: Value, dims: Sequence[int], op: str = "flip") -> Value:
    rank = value.type.rank
    normalized = [normalize_dim(d, rank, op) for d in dims]
    if len(set(normalized)) != len(normalized):
        raise RuntimeError(f"dim {normalized[0]} appears multiple times in the list of dims")
    kept = tuple(sorted(d for d in normalized if shape_of(value)[d] > 1))
    return prims.flip(value, dims=kept) if kept else value


_FLIP_CASES = [
    case((3, 4), (0,)),
    case((2, 3, 4), (-1, 0), note="two dims"),
    case((3, 4), [], note="no dims"),
    case((0, 2), (0,), note="0-size"),
    case((2, 3, 4), dims=(0, 2), note="dims keyword"),
]


@translation(torch.flip, samples=tensor_calls(_FLIP_CASES), dtypes=ALL)
@translation(
    torch.Tensor.flip,
    samples=tensor_calls([*_FLIP_CASES, case((3, 4), 1, 0, note="varargs")]),
    dtypes=ALL,
)
def flip(input: Value, *dims: Any, **keywords: Any) -> Value:
    if "dims" in keywords:  # torch.flip(x, dims=(0, 1))
        dims = (keywords.pop("dims"),)
    if keywords:
        raise TypeError(f"flip() got an unexpected keyword argument '{next(iter(keywords))}'")
    # (dims are positions, not sizes: shape_args only flattens the varargs)
    return flipped(input, [cast(int, d) for d in shape_args(dims)])


@translation(torch.Tensor.fliplr, torch.fliplr, samples=tensor_calls([case((3, 4))]), dtypes=ALL)
def fliplr(input: Value) -> Value:
    if input.type.rank < 2:
        raise RuntimeError("Input must be >= 2-d.")
    return flipped(input, (1,))


@translation(torch.Tensor.flipud, torch.flipud, samples=tensor_calls([case((3, 4))]), dtypes=ALL)
def flipud(input: Value) -> Value:
    if input.type.rank < 1:
        raise RuntimeError("Input must be >= 1-d.")
    return flipped(input, (0,))


def _roll_dim(value: Value, shift: Dim, dim: int) -> Value:
    size = shape_of(value)[dim]
    if size == 0 or shift % size == 0:
        return value
    cut = size - shift % size
    return prims.cat(take_slice(value, dim, cut, size), take_slice(value, dim, 0, cut), dim=dim)


@translation(
    torch.Tensor.roll,
    torch.roll,
    samples=tensor_calls(
        [
            case((3, 4), 1, 0),
            case((3, 4), (-1, 6), (1, 0), note="two dims, large shift"),
            case((3, 4), 5, note="flattened"),
            case((0, 4), 2, 0, note="0-size"),
        ]
    ),
    dtypes=ALL,
)
def roll(
    input: Value, shifts: Dim | Sequence[Dim], dims: int | Sequence[int] | None = None
) -> Value:
    shift_list = [shifts] if isinstance(shifts, int | Sym) else list(shifts)
    if dims is None:
        if len(shift_list) != 1:
            raise RuntimeError(
                f"shifts and dimensions must align. shifts: {len(shift_list)}, dims:0"
            )
        flat = reshape(input, (numel_of(input),))
        return reshape(_roll_dim(flat, shift_list[0], 0), shape_of(input))
    dim_list = [dims] if isinstance(dims, int) else list(dims)
    if len(shift_list) != len(dim_list):
        raise RuntimeError(
            f"shifts and dimensions must align. shifts: {len(shift_list)}, dims:{len(dim_list)}"
        )
    result = input
    for shift, dim in zip(shift_list, dim_list, strict=True):
        result = _roll_dim(result, shift, normalize_dim(dim, input.type.rank, "roll"))
    return result


# ---------------------------------------------------------------------------------------------
# tril, triu


def _triangle(input: Value, diagonal: int, lower: bool) -> Value:
    """``input`` with elements off the triangle zeroed: keep ``column - row <= diagonal``
    (lower) or ``>= diagonal`` (upper), comparing iotas broadcast over the last two dims."""
    shape = shape_of(input)
    name = "tril" if lower else "triu"
    if len(shape) < 2:
        raise RuntimeError(f"{name}: input tensor must have at least 2 dimensions")
    rows, columns = shape[-2:]
    device = input.type.device
    row = prims.iota(length=rows, start=0, step=1, dtype=torch.int64, device=device)
    column = prims.iota(length=columns, start=0, step=1, dtype=torch.int64, device=device)
    grid = (rows, columns)
    distance = prims.sub(
        prims.broadcast(column, shape=grid, dims=(1,)), prims.broadcast(row, shape=grid, dims=(0,))
    )
    keep = prims.le(distance, diagonal) if lower else prims.ge(distance, diagonal)
    zero = False if input.type.dtype == torch.bool else 0
    return prims.where(broadcast_to(keep, shape), input, zero)


_TRIANGLE_CASES = tensor_calls(
    [
        case((3, 4)),
        case((2, 4, 3), 1, note="batched, offset"),
        case((4, 3), diagonal=-1, note="negative"),
        case((0, 3), note="0-size"),
    ]
)


@translation(torch.Tensor.tril_, samples=_TRIANGLE_CASES, dtypes=ALL, inplace=True)
@translation(torch.Tensor.tril, torch.tril, samples=_TRIANGLE_CASES, dtypes=ALL)
def tril(input: Value, diagonal: int = 0) -> Value:
    return _triangle(input, diagonal, lower=True)


@translation(torch.Tensor.triu_, samples=_TRIANGLE_CASES, dtypes=ALL, inplace=True)
@translation(torch.Tensor.triu, torch.triu, samples=_TRIANGLE_CASES, dtypes=ALL)
def triu(input: Value, diagonal: int = 0) -> Value:
    return _triangle(input, diagonal, lower=False)


# ---------------------------------------------------------------------------------------------
# pad


def fill_scalar(value: bool | int | float | Sym, dtype: torch.dtype) -> bool | int | float | Sym:
    """A Python scalar as an element of ``dtype`` (floats truncate into integers, as in eager);
    a symbolic size stays symbolic (an int)."""
    if dtype == torch.bool:
        return bool(value)
    if isinstance(value, Sym):
        return value
    if dtype.is_floating_point:
        return float(value)
    return int(value)


def _pad_pairs(pad: Sequence[Dim], rank: int) -> list[tuple[Dim, Dim]]:
    """``(low, high)`` per dim from F.pad's flat list, which starts at the last dim."""
    if len(pad) % 2:
        raise RuntimeError("Padding length must be divisible by 2")
    if len(pad) > 2 * rank:
        raise RuntimeError(
            "Padding length should be less than or equal to two times the input dimension but "
            f"got padding length {len(pad)} and input of dimension {rank}"
        )
    given = [(pad[i], pad[i + 1]) for i in range(0, len(pad), 2)]
    return [(0, 0)] * (rank - len(given)) + given[::-1]


def _edges(value: Value, dim: int, low: Dim, high: Dim, mode: str) -> list[Value]:
    """The pieces around ``value`` along ``dim`` that a non-constant padding mode adds."""
    size = shape_of(value)[dim]
    if mode == "reflect":
        if low >= size or high >= size:
            raise RuntimeError(
                f"Argument #4: Padding size should be less than the corresponding input "
                f"dimension, but got: padding ({low}, {high}) at dimension {dim} of input "
                f"{list(shape_of(value))}"
            )
        before = flipped(take_slice(value, dim, 1, low + 1), (dim,))
        after = flipped(take_slice(value, dim, size - 1 - high, size - 1), (dim,))
    elif mode == "replicate":
        if size == 0:
            raise RuntimeError("padding mode replicate needs a non-empty dim")
        before, after = take_slice(value, dim, 0, 1), take_slice(value, dim, size - 1, size)
        grown = list(shape_of(value))
        before = prims.expand(before, shape=(*grown[:dim], low, *grown[dim + 1 :]))
        after = prims.expand(after, shape=(*grown[:dim], high, *grown[dim + 1 :]))
    else:  # circular
        if low > size or high > size:
            raise RuntimeError("Padding value causes wrapping around more than once.")
        before, after = take_slice(value, dim, size - low, size), take_slice(value, dim, 0, high)
    return [before, value, after]


def _pad_edges(value: Value, pairs: Sequence[tuple[Dim, Dim]], mode: str) -> Value:
    if any(amount < 0 for pair in pairs for amount in pair):
        raise FallbackToExtern  # cropping in a non-constant mode
    for dim, (low, high) in enumerate(pairs):
        if (low, high) != (0, 0):
            parts = [p for p in _edges(value, dim, low, high, mode) if shape_of(p)[dim]]
            value = prims.cat(*parts, dim=dim) if len(parts) > 1 else parts[0]
    return value


_PAD_MODES = ("constant", "reflect", "replicate", "circular")


def pad_tensor(
    input: Value, pad: Sequence[int], mode: str = "constant", value: float | None = None
) -> Value:
    """``F.pad``: pairs of amounts from the last dim; constant, reflect, replicate, circular."""
    pairs = _pad_pairs(shape_args((pad,)), input.type.rank)
    if mode not in _PAD_MODES:
        raise NotImplementedError(f"Unrecognised padding mode {mode}")
    if mode == "constant":
        if all(pair == (0, 0) for pair in pairs):
            return input
        fill = fill_scalar(0 if value is None else value, input.type.dtype)
        low, high = zip(*pairs, strict=True)
        return prims.pad(input, low=tuple(low), high=tuple(high), value=fill)
    if value is not None and value != 0:
        raise RuntimeError(f'Padding mode "{mode}" doesn\'t take in value argument')
    count = len(pad) // 2
    if not count + 1 <= input.type.rank <= count + 2:
        raise NotImplementedError(
            "Only 2D, 3D, 4D, 5D padding with non-constant padding are supported for now"
        )
    return _pad_edges(input, pairs, mode)


def _pad_case(shape: tuple[int, ...], pad: tuple[int, ...], mode: str) -> Case:
    return case(shape, pad, mode, note=mode)


_CONSTANT_PAD_CASES = case_calls(
    ((T((2, 3)), (1, 2)), {}, "last dim"),
    ((T((2, 3, 4)), (1, 0, -1, 2)), {"value": 1}, "two dims, crop, value"),
    ((T((2, 3)), (0, 0, 0, 0)), {}, "no-op"),
    _pad_case((2, 3, 4), (4, 2), "circular"),
    _pad_case((1, 2, 3, 4), (1, 2, 3, 0), "circular"),
)
_EDGE_PAD_CASES = case_calls(
    _pad_case((2, 3, 4), (2, 1), "reflect"),
    _pad_case((1, 2, 3, 4), (1, 2, 2, 1), "reflect"),
    _pad_case((2, 3), (2, 0), "replicate"),
    _pad_case((1, 2, 3, 4), (1, 2, 0, 3), "replicate"),
)


def _pad_samples(dtype: torch.dtype, device: torch.device) -> Sequence[Call]:
    # Eager has no bool kernels for reflect and replicate padding.
    edges = [] if dtype == torch.bool else list(_EDGE_PAD_CASES(dtype, device))
    return [*_CONSTANT_PAD_CASES(dtype, device), *edges]


@translation(F.pad, torch._C._nn.pad, samples=_pad_samples, dtypes=ALL)
def pad(
    input: Value, pad: Sequence[int], mode: str = "constant", value: float | None = None
) -> Value:
    return pad_tensor(input, pad, mode, value)


@translation(
    torch.constant_pad_nd,
    samples=case_calls(((T((2, 3)), (1, 2)), {}, ""), ((T((2, 3)), (1, -1, 0, 2), 1), {}, "")),
    dtypes=ALL,
)
def constant_pad_nd(input: Value, pad: Sequence[int], value: float = 0) -> Value:
    return pad_tensor(input, pad, "constant", value)
