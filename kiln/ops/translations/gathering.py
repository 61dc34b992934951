"""Translations of the indexing functions: gather, scatter, scatter_add, index_select,
index_put, index_add, index_copy, index_fill, take, take_along_dim.

Each checks what eager checks (index dtypes, matching dtypes of self and source) and maps onto
one ``gather``, ``scatter``, ``scatter_add``, ``index`` or ``index_put`` prim::

    x.index_add(1, idx, src)   ->  index_put(x, src, idx, dims=(1,), accumulate=True)
    torch.take(x, idx)         ->  index(reshape(x, shape=(12,)), idx, dims=(0,))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.indexing import indexed_shape
from kiln.ops.sampling import ALL, make_tensor, scalar_for
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.common import (
    autocast,
    broadcast_shapes,
    broadcast_to,
    full,
    normalize_dim,
)
from kiln.ops.translations.elementwise_cases import concat_calls
from kiln.ops.translations.indexing import INDEX_DTYPES, MASK_DTYPES, distinct, fitted
from kiln.ops.translations.math import no_out
from kiln.ops.translations.shape import numel_of, reshape, shape_of
from kiln.ops.translations.slicing import fill_scalar
from kiln.ops.translations.table import Call, CallFn, FallbackToExtern, translation


def _check_index(index: Value, op: str) -> None:
    if index.type.dtype not in INDEX_DTYPES:
        raise RuntimeError(f"{op}(): Expected dtype int32/int64 for index")


def _check_same_dtype(self: Value, source: Value, op: str) -> None:
    if source.type.dtype != self.type.dtype:
        raise RuntimeError(
            f"{op}(): self ({self.type.dtype}) and source ({source.type.dtype}) must have the "
            "same scalar type"
        )


def _flat(value: Value) -> Value:
    return reshape(value, (numel_of(value),))


def _along_calls(x: tuple[int, ...], dim: int, source: tuple[int, ...]) -> CallFn:
    """Samples ``fn(x, dim, index, source)`` with distinct indices, one per row of ``source``
    along ``dim`` (index_copy is defined only without repeated positions)."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        index = distinct(source[dim], x[dim], device) % x[dim]
        tensors = (make_tensor(x, dtype, device), index, make_tensor(source, dtype, device))
        return [Call((tensors[0], dim, *tensors[1:]))]

    return samples


# ---------------------------------------------------------------------------------------------
# gather, scatter, scatter_add


def _gather_samples(dtype: torch.dtype, device: torch.device) -> Sequence[Call]:
    return case_calls(
        ((T((4, 5)), 1, T((4, 3), torch.int64, low=0, high=5)), {}, ""),
        ((T((4, 5)), -2, T((6, 2), torch.int64, low=0, high=4)), {}, "negative dim, longer"),
        ((T(()), 0, T((), torch.int64, low=0, high=1)), {}, "0-d"),
        ((T((4, 5)), 0, T((2, 5), torch.int32, low=0, high=4)), {}, "int32 index"),
    )(dtype, device)


@translation(torch.Tensor.gather, torch.gather, samples=_gather_samples, dtypes=ALL)
def gather(
    input: Value, dim: int, index: Value, *, sparse_grad: bool = False, out: Any = None
) -> Value:
    no_out(out)
    if numel_of(index) == 0 and not index.type.dtype.is_floating_point:
        # Eager takes an empty index of any int type and rank: an empty result of its shape.
        flat = reshape(input, (numel_of(input),))
        return reshape(prims.slice(flat, dim=0, start=0, stop=0, step=1), shape_of(index))
    _check_index(index, "gather")
    if input.type.rank == 0 and index.type.rank == 1:
        input = reshape(input, (1,))  # (eager reads a 0-d input as one element)
    return prims.gather(input, index, dim=normalize_dim(dim, input.type.rank, "gather"))


def _scatter_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    rows = torch.rand(4, 5, device=device).argsort(1)[:, :3]  # distinct along dim 1
    return [
        Call((make_tensor((4, 5), dtype, device), 1, rows, make_tensor((4, 3), dtype, device))),
        Call((make_tensor((4, 5), dtype, device), -1, rows, scalar_for(dtype)), note="value"),
        Call(
            (make_tensor((5, 4), dtype, device), 0, rows.T.contiguous()),
            {"src": make_tensor((3, 6), dtype, device)},
            "dim 0, larger src",
        ),
    ]


@translation(torch.Tensor.scatter_, samples=_scatter_samples, dtypes=ALL, inplace=True)
@translation(torch.Tensor.scatter, torch.scatter, samples=_scatter_samples, dtypes=ALL)
def scatter(
    input: Value,
    dim: int,
    index: Value,
    src: Value | bool | int | float | None = None,
    *,
    value: bool | int | float | None = None,
    reduce: str | None = None,
) -> Value:
    _check_index(index, "scatter")
    dim = normalize_dim(dim, input.type.rank, "scatter")
    if isinstance(src, Value):
        if src.type.dtype != input.type.dtype:
            raise RuntimeError("scatter(): Expected self.dtype to be equal to src.dtype")
        source = src
    else:
        scalar = value if src is None else src
        if scalar is None:
            raise TypeError("scatter() needs a src tensor or a value")
        dtype = input.type.dtype
        source = full(index.type.shape, fill_scalar(scalar, dtype), dtype, input.type.device)
    if reduce is None:
        return prims.scatter(input, index, source, dim=dim)
    if reduce == "add":
        return prims.scatter_add(input, index, source, dim=dim)
    raise FallbackToExtern  # reduce="multiply"


def _scatter_add_samples(dtype: torch.dtype, device: torch.device) -> Sequence[Call]:
    return case_calls(
        ((T((3, 4)), 1, T((3, 10), torch.int64, low=0, high=4), T((3, 10))), {}, "duplicates"),
        ((T((5, 2)), 0, T((3, 2), torch.int64, low=0, high=5), T((4, 2))), {}, "dim 0"),
    )(dtype, device)


@translation(torch.Tensor.scatter_add_, samples=_scatter_add_samples, dtypes=ALL, inplace=True)
@translation(torch.Tensor.scatter_add, torch.scatter_add, samples=_scatter_add_samples, dtypes=ALL)
def scatter_add(input: Value, dim: int, index: Value, src: Value) -> Value:
    _check_index(index, "scatter_add")
    if src.type.dtype != input.type.dtype:
        raise RuntimeError("scatter_add(): Expected self.dtype to be equal to src.dtype")
    input, src = autocast("scatter_add", input, src)
    dim = normalize_dim(dim, input.type.rank, "scatter_add")
    return prims.scatter_add(input, index, src, dim=dim)


# ---------------------------------------------------------------------------------------------
# index_select, index_put, index_add, index_copy, index_fill


def _vector_index(index: Value, op: str) -> Value:
    if index.type.dtype not in INDEX_DTYPES:
        raise RuntimeError(f"{op}(): Expected dtype int32 or int64 for index")
    if index.type.rank > 1:
        raise IndexError(f"{op}(): Index is supposed to be a vector")
    return _flat(index)


@translation(
    torch.Tensor.index_select,
    torch.index_select,
    samples=case_calls(
        ((T((4, 5)), 1, T((7,), torch.int64, low=0, high=5)), {}, "duplicates"),
        ((T((4, 5)), -2, T((), torch.int32, low=0, high=4)), {}, "0-d int32 index"),
        ((T(()), 0, T((1,), torch.int64, low=0, high=1)), {}, "0-d input"),
        ((T((4, 5)), 0, T((0,), torch.int64)), {}, "empty index"),
    ),
    dtypes=ALL,
)
def index_select(input: Value, dim: int, index: Value, *, out: Any = None) -> Value:
    no_out(out)
    index = _vector_index(index, "index_select")
    if input.type.rank == 0:
        if shape_of(index) != (1,):
            raise IndexError(
                "index_select(): Index to scalar can have only 1 value, got "
                f"{shape_of(index)[0]} value(s)"
            )
        return reshape(prims.index(reshape(input, (1,)), index, dims=(0,), negative=False), ())
    dim = normalize_dim(dim, input.type.rank, "index_select")
    return prims.index(input, index, dims=(dim,), negative=False)


def _index_put_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = (4, 5, 6)
    pairs = torch.unravel_index(torch.randperm(20, device=device)[:3], (4, 5))  # distinct
    return [
        Call((make_tensor(x, dtype, device), pairs, make_tensor((3, 6), dtype, device))),
        Call(
            (
                make_tensor(x, dtype, device),
                [distinct(2, 4, device)],
                make_tensor((6,), dtype, device),
            ),
            {"accumulate": False},
            "list of indices, broadcast values",
        ),
        Call(
            (
                make_tensor(x, dtype, device),
                (torch.randint(0, 4, (8,), device=device),),
                make_tensor((8, 5, 6), dtype, device),
                True,
            ),
            note="accumulate duplicates",
        ),
    ]


@translation(
    torch.Tensor.index_put_, torch.index_put_, samples=_index_put_samples, dtypes=ALL, inplace=True
)
@translation(torch.Tensor.index_put, torch.index_put, samples=_index_put_samples, dtypes=ALL)
def index_put(
    input: Value, indices: Sequence[Value], values: Value, accumulate: bool = False
) -> Value:
    if values.type.dtype != input.type.dtype:
        raise RuntimeError(
            "Index put requires the source and destination dtypes match, got "
            f"{input.type.dtype} for the destination and {values.type.dtype} for the source."
        )
    if not indices or len(indices) > input.type.rank:
        raise IndexError(f"too many indices for tensor of dimension {input.type.rank}")
    if any(index.type.dtype in MASK_DTYPES for index in indices):
        raise FallbackToExtern  # a mask: the positions depend on the data
    shape = broadcast_shapes(*(index.type.shape for index in indices))
    tensors = [broadcast_to(index, shape) for index in indices]
    dims = tuple(range(len(tensors)))
    target = indexed_shape(shape_of(input), dims, shape)
    input, values = autocast("index_put", input, values)
    values = fitted(values, target, input)
    return prims.index_put(input, values, *tensors, dims=dims, accumulate=accumulate)


def _along_dim(
    input: Value, dim: int, index: Value, source: Value, op: str, accumulate: bool
) -> Value:
    """``index_put`` of ``source`` at ``index`` along ``dim`` (index_add, index_copy)."""
    if input.type.rank == 0:
        raise FallbackToExtern
    index = _vector_index(index, op)
    _check_same_dtype(input, source, op)
    dim = normalize_dim(dim, input.type.rank, op)
    expected = list(shape_of(input))
    expected[dim] = shape_of(index)[0]
    if list(shape_of(source)) != expected:
        raise RuntimeError(
            f"{op}(): source tensor shape {list(shape_of(source))} must match self tensor "
            f"shape {list(shape_of(input))}, excluding the specified dimension {dim}"
        )
    copy = op == "index_copy_"
    return prims.index_put(input, source, index, dims=(dim,), accumulate=accumulate, in_range=copy)


_ALONG_CASES = (_along_calls((4, 5), 1, (4, 3)), _along_calls((5, 2), 0, (4, 2)))
_ALONG = concat_calls(*_ALONG_CASES)


@translation(torch.Tensor.index_add_, samples=_ALONG, dtypes=ALL, inplace=True)
@translation(
    torch.Tensor.index_add,
    torch.index_add,
    samples=concat_calls(
        *_ALONG_CASES,
        case_calls(
            (
                (T((3, 4)), 1, T((9,), torch.int64, low=0, high=4), T((3, 9))),
                {"alpha": 2},
                "duplicates, alpha",
            )
        ),
    ),
    dtypes=ALL,
)
def index_add(
    input: Value, dim: int, index: Value, source: Value, *, alpha: bool | int | float = 1
) -> Value:
    if alpha != 1:
        source = prims.mul(source, fill_scalar(alpha, source.type.dtype))
    return _along_dim(input, dim, index, source, "index_add_", accumulate=True)


@translation(torch.Tensor.index_copy_, samples=_ALONG, dtypes=ALL, inplace=True)
@translation(torch.Tensor.index_copy, torch.index_copy, samples=_ALONG, dtypes=ALL)
def index_copy(input: Value, dim: int, index: Value, source: Value) -> Value:
    input, source = autocast("index_copy", input, source)  # (promote: the wider dtype)
    return _along_dim(input, dim, index, source, "index_copy_", accumulate=False)


def _index_fill_samples(dtype: torch.dtype, device: torch.device) -> Sequence[Call]:
    return case_calls(
        ((T((4, 5)), 1, T((3,), torch.int64, low=-5, high=5), scalar_for(dtype)), {}, ""),
        ((T((4, 5)), 0, T((6,), torch.int64, low=0, high=4), T(())), {}, "0-d value"),
    )(dtype, device)


@translation(torch.Tensor.index_fill_, samples=_index_fill_samples, dtypes=ALL, inplace=True)
@translation(torch.Tensor.index_fill, torch.index_fill, samples=_index_fill_samples, dtypes=ALL)
def index_fill(input: Value, dim: int, index: Value, value: Value | bool | int | float) -> Value:
    if input.type.rank == 0:
        raise FallbackToExtern
    if isinstance(value, Value) and value.type.requires_grad:
        # Eager's value gradient sums the gradient at each listed index, a repeated index
        # counted each time; the filled positions (each once) would give another number.
        raise FallbackToExtern
    index = _vector_index(index, "index_fill_")
    if isinstance(value, Value) and value.type.rank != 0:
        raise RuntimeError(
            "index_fill_ only supports a 0-dimensional value tensor, but got tensor with "
            f"{value.type.rank} dimension(s)."
        )
    dim = normalize_dim(dim, input.type.rank, "index_fill_")
    target = list(shape_of(input))
    target[dim] = shape_of(index)[0]
    fill = fitted(value, target, input)
    return prims.index_put(input, fill, index, dims=(dim,), accumulate=False)


# ---------------------------------------------------------------------------------------------
# take, take_along_dim


@translation(
    torch.Tensor.take,
    torch.take,
    samples=case_calls(
        ((T((3, 4)), T((2, 5), torch.int64, low=-12, high=12)), {}, ""),
        ((T(()), T((3,), torch.int64, low=0, high=1)), {}, "0-d input"),
    ),
    dtypes=ALL,
)
def take(input: Value, index: Value) -> Value:
    if index.type.dtype != torch.int64:
        raise RuntimeError(f"take(): Expected a long tensor for index, but got {index.type.dtype}")
    return prims.index(_flat(input), index, dims=(0,))


@translation(
    torch.Tensor.take_along_dim,
    torch.take_along_dim,
    samples=case_calls(
        ((T((3, 4)), T((3, 2), torch.int64, low=0, high=4), 1), {}, ""),
        ((T((3, 1, 4)), T((1, 5, 2), torch.int64, low=0, high=4)), {"dim": -1}, "broadcast"),
        ((T((3, 4)), T((5,), torch.int64, low=0, high=12)), {}, "flattened"),
    ),
    dtypes=ALL,
)
def take_along_dim(
    input: Value, indices: Value, dim: int | None = None, *, out: Any = None
) -> Value:
    no_out(out)
    if indices.type.dtype != torch.int64:
        raise RuntimeError(
            f"torch.take_along_dim(): dtype of indices should be Long but got {indices.type.dtype}"
        )
    if dim is None:
        return prims.gather(_flat(input), _flat(indices), dim=0)
    if input.type.rank != indices.type.rank:
        raise RuntimeError(
            "torch.take_along_dim(): input and indices should have the same number of "
            f"dimensions, but got {input.type.rank} dimensions for input, and "
            f"{indices.type.rank} dimensions for indices"
        )
    dim = normalize_dim(dim, input.type.rank, "take_along_dim")
    outside = [list(shape_of(input)), list(shape_of(indices))]
    for shape in outside:
        shape[dim] = 1
    source_shape, index_shape = list(broadcast_shapes(*map(tuple, outside))), []
    index_shape = list(source_shape)
    source_shape[dim], index_shape[dim] = shape_of(input)[dim], shape_of(indices)[dim]
    source = broadcast_to(input, tuple(source_shape))
    indices = _wrapped(indices, shape_of(input)[dim])
    return prims.gather(source, broadcast_to(indices, tuple(index_shape)), dim=dim)


def _wrapped(indices: Value, size: Any) -> Value:
    """``indices`` modulo ``size``, as eager's take_along_dim reads them along a dim (-1 is the
    last, and it does not check bounds: 5 reads element 1 of 4); gather, and scatter in the
    backward, accept only ``0 <= i < size``."""
    return prims.remainder(indices, size) if size else indices
