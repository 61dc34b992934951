"""Translations of adaptive average and max pooling (1d, 2d, 3d), in movement and reduction
prims.

Output cell ``i`` of a dim of size ``n`` pooled to ``out`` cells covers ``floor(i*n/out)`` to
``ceil((i+1)*n/out)``; like fixed windows, adaptive windows are boxes, so pooling goes one dim at
a time. When ``out`` divides ``n`` the windows tile the dim: one reshape and one reduction::

    F.adaptive_avg_pool2d(x, 7)   # x: f32[2, 3, 14, 14]
    t0 = reshape(x, shape=(2, 3, 7, 2, 14)); t1 = sum(t0, dims=(3,))
    t2 = reshape(t1, shape=(2, 3, 7, 7, 2)); t3 = sum(t2, dims=(4,)); t4 = div(t3, 4.0)

Global pooling (every output size 1) is one reduction over all window dims at once, the form
``passes/reduction_split.py`` chunks on the GPU. When ``out`` does not divide ``n``, each cell
is a slice and a reduction, concatenated; dims pooled to more than
``MAX_ADAPTIVE_CELLS`` uneven cells fall back to an extern. Averages accumulate in float32 for
float16/bfloat16 and divide once, as eager's CPU kernels do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.types import Dim
from kiln.ops import prims
from kiln.ops.sampling import FLOATS
from kiln.ops.translations import common
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.linalg import reshape
from kiln.ops.translations.pooling import check_input, divide_by_counts
from kiln.ops.translations.reductions import compute_dtype
from kiln.ops.translations.shape import shape_of
from kiln.ops.translations.table import FallbackToExtern, translation

Reduce = Callable[[Value, int], Value]  # reduce a value over one dim, removing it
MAX_ADAPTIVE_CELLS = 64  # wider adaptive outputs (without an even split) become externs


def _adaptive_sizes(op: str, input: Value, spatial: int, output_size: object) -> list[Dim]:
    """Output sizes per spatial dim (None keeps the input's size)."""
    check_input(op, input, spatial)
    sizes = list(shape_of(input)[-spatial:])
    wanted = [output_size] * spatial if not isinstance(output_size, Sequence) else output_size
    if len(wanted) == 1 and spatial > 1:
        wanted = list(wanted) * spatial
    if len(wanted) != spatial:
        raise ValueError(f"{op}: output_size must be {spatial}, got {list(wanted)}")
    outs = [size if out is None else int(out) for out, size in zip(wanted, sizes, strict=True)]
    if any(out < 0 for out in outs):
        raise RuntimeError(f"{op}: elements of output_size must be greater than or equal to 0")
    return outs


def adaptive_bounds(size: Dim, out: Dim) -> list[tuple[Dim, Dim]]:
    """Each output cell's window ``[floor(i*size/out), ceil((i+1)*size/out))``."""
    return [((i * size) // out, ((i + 1) * size + out - 1) // out) for i in range(out)]


def adaptive_dim(x: Value, dim: int, out: Dim, reduce: Reduce) -> Value:
    """Reduce each adaptive window along ``dim``: one reshape when ``out`` divides the size,
    else one slice per output cell, concatenated."""
    shape = x.type.shape
    size = shape[dim]
    if out and size % out == 0:
        split = reshape(x, (*shape[:dim], out, size // out, *shape[dim + 1 :]))
        return reduce(split, dim + 1)
    if out > MAX_ADAPTIVE_CELLS:
        raise FallbackToExtern  # one slice per cell: too many nodes
    cells = [
        prims.unsqueeze(reduce(prims.slice(x, dim=dim, start=start, stop=stop), dim), dims=(dim,))
        for start, stop in adaptive_bounds(size, out)
    ]
    if not cells:
        return prims.slice(x, dim=dim, start=0, stop=0)
    return prims.cat(*cells, dim=dim)


def _sum_dim(x: Value, dim: int) -> Value:
    return prims.sum(x, dims=(dim,))


def _amax_dim(x: Value, dim: int) -> Value:
    return prims.amax(x, dims=(dim,))


def adaptive_avg_pool(input: Value, spatial: int, output_size: object) -> Value:
    op = f"adaptive_avg_pool{spatial}d"
    outs = _adaptive_sizes(op, input, spatial, output_size)
    dtype = input.type.dtype
    if not dtype.is_floating_point:
        raise RuntimeError(f"\"{op}\" not implemented for '{str(dtype).removeprefix('torch.')}'")
    total = common.convert(input, compute_dtype(dtype))
    first = input.type.rank - spatial
    counts = [[size] for size in input.type.shape[first:]]
    if all(out == 1 for out in outs):  # global pooling: one reduction over every window dim
        pooled = prims.sum(total, dims=tuple(range(first, input.type.rank)))
        total, outs = reshape(pooled, (*input.type.shape[:first], *outs)), []
    for offset, out in enumerate(outs):
        size = input.type.shape[first + offset]
        total = adaptive_dim(total, first + offset, out, _sum_dim)
        counts[offset] = [stop - start for start, stop in adaptive_bounds(size, out)]
    return common.convert(divide_by_counts(total, counts), dtype)


def adaptive_max_pool(
    input: Value, spatial: int, output_size: object, return_indices: bool
) -> Value:
    op = f"adaptive_max_pool{spatial}d"
    if return_indices:
        raise FallbackToExtern  # argmax positions of windows: no prim expresses them yet
    if input.type.requires_grad:
        # Eager's backward sends a window's gradient to its first maximum; pooling one dim
        # at a time (amax) would split it between ties. PyTorch's kernel differentiates.
        raise FallbackToExtern
    outs = _adaptive_sizes(op, input, spatial, output_size)
    result = input
    first = input.type.rank - spatial
    for offset, out in enumerate(outs):
        result = adaptive_dim(result, first + offset, out, _amax_dim)
    return result


def _adaptive_cases(spatial: int) -> list[Case]:
    size = (10, 6, 4)[spatial - 1]
    dims = (size,) * spatial
    cases: list[Case] = [
        ((T((2, 3, *dims)), 1), {}, "global"),
        ((T((2, 3, *dims)), 2), {}, "even split"),
        ((T((1, 2, *dims)), 3), {}, "overlapping windows"),
        ((T((2, *dims)), (size + 1,) * spatial), {}, "unbatched, upsampling"),
    ]
    if spatial > 1:  # the 1-d functions take no None
        cases.append(((T((1, 2, *dims)), (None, *(3,) * (spatial - 1))), {}, "None keeps a size"))
    return cases


def _adaptive_avg_translation(spatial: int, *keys: Callable[..., Any]) -> None:
    def pool(input: Value, output_size: object) -> Value:
        return adaptive_avg_pool(input, spatial, output_size)

    pool.__name__ = pool.__qualname__ = f"adaptive_avg_pool{spatial}d"
    translation(*keys, samples=case_calls(*_adaptive_cases(spatial)), dtypes=FLOATS)(pool)


def _adaptive_max_translation(spatial: int, *keys: Callable[..., Any]) -> None:
    def pool(input: Value, output_size: object, return_indices: bool = False) -> Value:
        return adaptive_max_pool(input, spatial, output_size, return_indices)

    pool.__name__ = pool.__qualname__ = f"adaptive_max_pool{spatial}d"
    translation(*keys, samples=case_calls(*_adaptive_cases(spatial)), dtypes=FLOATS)(pool)


_adaptive_avg_translation(1, torch.adaptive_avg_pool1d)
_adaptive_avg_translation(2, F.adaptive_avg_pool2d)
_adaptive_avg_translation(3, F.adaptive_avg_pool3d)
_adaptive_max_translation(1, F.adaptive_max_pool1d)
_adaptive_max_translation(2, F.adaptive_max_pool2d)
_adaptive_max_translation(3, F.adaptive_max_pool3d)
