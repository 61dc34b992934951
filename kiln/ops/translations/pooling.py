"""Translations of max, average and adaptive pooling, decomposed into movement and elementwise
prims.

A pooling window is a box, so pooling is separable: max (or sum) over the box is max (or sum)
along one spatial dim after another. Along one dim, the input is padded (``-inf``, the dtype's
minimum for integers, or 0) to cover every window, and the ``kernel`` strided slices that hold
each window's j-th element are combined elementwise::

    F.max_pool1d(x, 3, stride=2)   # x: f32[1, 2, 7]
    t0 = slice(x, dim=2, start=0, stop=5, step=2); t1 = slice(x, dim=2, start=1, stop=6, step=2)
    t2 = slice(x, dim=2, start=2, stop=7, step=2); t3 = maximum(t0, t1); t4 = maximum(t3, t2)

Averages sum in float32 for reduced-precision inputs and divide once by the window sizes
(products of per-dim counts, a scalar when all windows are equal), then round once, as eager's
CPU kernels do. Adaptive pooling is in ``adaptive_pooling.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.types import Dim, same_size
from kiln.ops import prims
from kiln.ops.sampling import FLOATS, NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.linalg import reshape
from kiln.ops.translations.reductions import compute_dtype
from kiln.ops.translations.shape import shape_of
from kiln.ops.translations.table import FallbackToExtern, translation

IntArg = int | Sequence[int]
MAX_OFFSET_WINDOW = 27  # elements of a window whose max pool routes gradients by offsets


@dataclass(frozen=True)
class Window:
    """The pooling geometry along one spatial dim."""

    kernel: int
    stride: int
    padding: int
    dilation: int = 1
    ceil_mode: bool = False

    def output_size(self, size: Dim) -> Dim:
        """PyTorch's ``pooling_output_shape``: a window may not start in the high padding."""
        span = size + 2 * self.padding - self.dilation * (self.kernel - 1) - 1
        extra = self.stride - 1 if self.ceil_mode else 0
        out = (span + extra) // self.stride + 1
        if self.ceil_mode and (out - 1) * self.stride >= size + self.padding:
            out -= 1
        return out


def _ints(value: IntArg, spatial: int, op: str, name: str) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else tuple(value)
    if len(values) == 1:
        return values * spatial
    if len(values) != spatial:
        count = ("one", "two", "three")[spatial - 1]
        raise RuntimeError(f"{op}: {name} must either be a single int, or a tuple of {count} ints")
    return values


def windows(
    op: str,
    spatial: int,
    kernel_size: IntArg,
    stride: IntArg | None,
    padding: IntArg,
    dilation: IntArg = 1,
    ceil_mode: bool = False,
) -> list[Window]:
    """Per-dim windows from the functional arguments (``stride`` None or empty: the kernel)."""
    kernels = _ints(kernel_size, spatial, op, "kernel_size")
    if stride is None or (isinstance(stride, list | tuple) and not stride):
        strides = kernels  # (stride=() and [] mean the kernel size too)
    else:
        strides = _ints(stride, spatial, op, "stride")
    pads = _ints(padding, spatial, op, "padding")
    dilations = _ints(dilation, spatial, op, "dilation")
    result = []
    for k, s, p, d in zip(kernels, strides, pads, dilations, strict=True):
        if k <= 0:
            raise RuntimeError(f"{op}: kernel_size should be greater than zero, but got {k}")
        if s <= 0:
            raise RuntimeError(f"{op}: stride should not be zero")
        if d <= 0:
            raise RuntimeError(f"{op}: dilation should be greater than zero, but got {d}")
        if p < 0 or p > (d * (k - 1) + 1) // 2:
            raise RuntimeError(
                f"{op}: pad should be at most half of effective kernel size, but got pad={p}, "
                f"kernel_size={k} and dilation={d}"
            )
        result.append(Window(k, s, p, d, bool(ceil_mode)))
    return result


def check_input(op: str, input: Value, spatial: int) -> None:
    """Pooling takes (C, *spatial) or (N, C, *spatial) with non-empty spatial dims."""
    rank = input.type.rank
    features = input.type.shape[1:] if rank == spatial + 2 else input.type.shape  # N may be 0
    if rank not in (spatial + 1, spatial + 2) or any(size == 0 for size in features):
        raise RuntimeError(
            f"{op}: non-empty {spatial + 1}D or {spatial + 2}D (batch mode) tensor expected for "
            f"input, got {list(input.type.shape)}"
        )


def _output_sizes(op: str, input: Value, wins: Sequence[Window]) -> list[Dim]:
    sizes = list(shape_of(input)[-len(wins) :])
    outs = [w.output_size(s) for w, s in zip(wins, sizes, strict=True)]
    if any(out <= 0 for out in outs):
        raise RuntimeError(
            f"{op}: Given input size: ({'x'.join(map(str, sizes))}). Calculated output size: "
            f"({'x'.join(map(str, outs))}). Output size is too small"
        )
    return outs


# ---------------------------------------------------------------------------------------------
# windows along one dim


def _pad_dim(x: Value, dim: int, low: int, high: Dim, value: bool | int | float) -> Value:
    if low == 0 and same_size(high, 0):  # (a symbolic amount: no guard to save a node)
        return x
    lows = tuple(low if d == dim else 0 for d in range(x.type.rank))
    highs = tuple(high if d == dim else 0 for d in range(x.type.rank))
    return prims.pad(x, low=lows, high=highs, value=value)


def pool_dim(
    x: Value,
    dim: int,
    window: Window,
    out: Dim,
    fill: bool | int | float,
    combine: Callable[[Value, Value], Value],
) -> Value:
    """Combine the ``window.kernel`` elements of each of ``out`` windows along ``dim``."""
    padded, last = _padded_for(x, dim, window, out, fill)
    slices = [
        prims.slice(
            padded,
            dim=dim,
            start=j * window.dilation,
            stop=j * window.dilation + last,
            step=window.stride,
        )
        for j in range(window.kernel)
    ]
    return functools.reduce(combine, slices)


def _padded_for(
    x: Value, dim: int, window: Window, out: Dim, fill: bool | int | float
) -> tuple[Value, Dim]:
    """``x`` padded along ``dim`` to cover ``out`` windows, and the extent of one slice (the
    window's j-th elements: ``padded[j * dilation : j * dilation + last : stride]``)."""
    last = (out - 1) * window.stride + 1
    span = last + window.dilation * (window.kernel - 1)
    high = span - x.type.shape[dim] - window.padding
    return _pad_dim(x, dim, window.padding, high, fill), last


def _lowest(dtype: torch.dtype) -> bool | int | float:
    """The padding that never wins a max."""
    if dtype.is_floating_point:
        return -math.inf
    return torch.iinfo(dtype).min


def divide_by_counts(total: Value, counts: Sequence[Sequence[Dim]]) -> Value:
    """``total`` divided by the outer product of per-dim window sizes (its trailing dims)."""
    flat = [math.prod(cell) for cell in _cells(counts)]
    if all(same_size(count, flat[0]) for count in flat[1:]):
        return prims.div(total, common.size_scalar(flat[0]) if flat else 1.0)
    shape = tuple(len(c) for c in counts)
    dtype, device = total.type.dtype, total.type.device
    if all(isinstance(count, int) for count in flat):
        divisor = common.constant(torch.tensor(flat, dtype=dtype, device=device).reshape(shape))
    else:  # (symbolic window sizes: one full per window)
        cells = [common.full((1,), common.size_scalar(c), dtype, device) for c in flat]
        divisor = reshape(prims.cat(*cells, dim=0), shape)
    return prims.div(total, common.broadcast_to(divisor, total.type.shape))


def _cells(counts: Sequence[Sequence[Dim]]) -> list[tuple[Dim, ...]]:
    cells: list[tuple[Dim, ...]] = [()]
    for per_dim in counts:
        cells = [(*cell, count) for cell in cells for count in per_dim]
    return cells


# ---------------------------------------------------------------------------------------------
# max_pool


def max_pool(
    input: Value,
    spatial: int,
    kernel_size: IntArg,
    stride: IntArg | None,
    padding: IntArg,
    dilation: IntArg,
    ceil_mode: bool,
    return_indices: bool,
) -> Value:
    op = f"max_pool{spatial}d"
    if return_indices:
        raise FallbackToExtern  # argmax positions of windows: no prim expresses them yet
    check_input(op, input, spatial)
    if spatial == 1 and not input.type.dtype.is_floating_point:
        name = str(input.type.dtype).removeprefix("torch.")
        raise NotImplementedError(f"\"max_pool1d_impl\" not implemented for '{name}'")
    wins = windows(op, spatial, kernel_size, stride, padding, dilation, ceil_mode)
    outs = _output_sizes(op, input, wins)
    fill = _lowest(input.type.dtype)
    result = input
    first = input.type.rank - spatial
    if input.type.requires_grad and math.prod(w.kernel for w in wins) <= MAX_OFFSET_WINDOW:
        return _max_pool_by_offsets(input, first, wins, outs, fill)
    # Eager's max pool passes the gradient to the first maximum of a window in row-major order:
    # reduce the last spatial dim first, keeping the earlier element on ties (NaN wins).
    steps = list(enumerate(zip(wins, outs, strict=True)))
    for offset, (window, out) in reversed(steps):
        result = pool_dim(result, first + offset, window, out, fill, _first_max)
    return result


def _max_pool_by_offsets(
    input: Value, first: int, wins: Sequence[Window], outs: Sequence[Dim], fill: float
) -> Value:
    """A max pool whose gradient flows through the position of each window's maximum.

    The window's elements (one strided slice of the padded input each, in row-major order)
    are compared in turn as eager's kernel does (a later one wins when greater, or NaN), and
    the winner's position is kept as a small integer; the result is the slice at that
    position. Its VJP reads only the positions (int32, one per output element: what the
    partitioner saves, ``partition.py``; the comparison prims take no int8), where the
    separable decomposition's backward recomputed the window's comparisons from the input."""
    padded, lasts = input, []
    for offset, (window, out) in enumerate(zip(wins, outs, strict=True)):
        padded, last = _padded_for(padded, first + offset, window, out, fill)
        lasts.append(last)
    slices = []
    for place in itertools.product(*(range(w.kernel) for w in wins)):
        part = padded
        for offset, (j, window, last) in enumerate(zip(place, wins, lasts, strict=True)):
            start = j * window.dilation
            part = prims.slice(
                part, dim=first + offset, start=start, stop=start + last, step=window.stride
            )
        slices.append(part)
    if len(slices) == 1:
        return slices[0]
    best, position = slices[0], None
    for number, part in enumerate(slices[1:], start=1):
        take = _takes(best, part)
        best = prims.where(take, part, best)
        position = (
            prims.convert(take, dtype=torch.int32)
            if position is None
            else prims.where(take, number, position)
        )
    # One term a window position, the others -0.0 (x + -0.0 is x, -0.0 included): each
    # slice's gradient is then one select, where a chain of selects nested eight deep.
    assert position is not None
    terms = [prims.where(prims.eq(position, n), part, -0.0) for n, part in enumerate(slices)]
    return functools.reduce(prims.add, terms)


def _takes(a: Value, b: Value) -> Value:
    """Whether ``b``, later in the window, replaces the maximum ``a`` so far."""
    take = prims.gt(b, a)
    if a.type.dtype.is_floating_point:
        take = prims.logical_or(take, prims.isnan(b))
    return take


def _first_max(a: Value, b: Value) -> Value:
    return prims.where(_takes(a, b), b, a)


def _max_pool_cases(spatial: int) -> list[Case]:
    size = (9, 7, 5)[spatial - 1]
    dims = (size,) * spatial
    return [
        ((T((2, 3, *dims)), 2), {}, ""),
        ((T((1, 2, *dims)), 3), {"stride": 2, "padding": 1}, "padded"),
        ((T((1, 2, *dims)), 2), {"stride": 1, "dilation": 2}, "dilated"),
        ((T((1, 2, *dims)), 2), {"ceil_mode": True}, "ceil_mode"),
        ((T((1, 2, *dims)), (3,) * spatial, (2,) * spatial, 1, 1, True), {}, "positional"),
        ((T((2, *dims)), 3), {"stride": 2}, "unbatched"),
    ]


def _max_pool_translation(
    spatial: int, *keys: Callable[..., Any], dtypes: frozenset[torch.dtype]
) -> None:
    def max_pool_nd(
        input: Value,
        kernel_size: IntArg,
        stride: IntArg | None = None,
        padding: IntArg = 0,
        dilation: IntArg = 1,
        ceil_mode: bool = False,
        return_indices: bool = False,
    ) -> Value:
        geometry = (kernel_size, stride, padding, dilation, ceil_mode)
        return max_pool(input, spatial, *geometry, return_indices)

    max_pool_nd.__name__ = max_pool_nd.__qualname__ = f"max_pool{spatial}d"
    samples = case_calls(*_max_pool_cases(spatial))
    translation(*keys, samples=samples, dtypes=dtypes)(max_pool_nd)


_max_pool_translation(1, F.max_pool1d, torch.max_pool1d, dtypes=FLOATS)  # eager: no int kernel
_max_pool_translation(2, F.max_pool2d, torch.max_pool2d, dtypes=NUMERIC)
_max_pool_translation(3, F.max_pool3d, torch.max_pool3d, dtypes=NUMERIC)


# ---------------------------------------------------------------------------------------------
# avg_pool


def _window_counts(window: Window, size: Dim, out: Dim, include_pad: bool) -> list[Dim]:
    """Each window's divisor along one dim, as eager's CPU kernel computes it: the kernel for
    every window when no window reaches past the padding (without ``ceil_mode``) and the
    padding counts or there is none; else one per window (a symbolic ``out`` specializes)."""
    if not window.ceil_mode and (include_pad or window.padding == 0):
        return [window.kernel]
    counts = []
    for i in range(int(out)):
        start = i * window.stride - window.padding
        end = min(start + window.kernel, size + window.padding)
        counts.append(end - start if include_pad else min(end, size) - max(start, 0))
    return counts


def avg_pool(
    input: Value,
    spatial: int,
    kernel_size: IntArg,
    stride: IntArg | None,
    padding: IntArg,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Value:
    op = f"avg_pool{spatial}d"
    check_input(op, input, spatial)
    if divisor_override is not None and divisor_override == 0:
        raise RuntimeError(f"{op}: divisor must be not zero")
    wins = windows(op, spatial, kernel_size, stride, padding, 1, ceil_mode)
    outs = _output_sizes(op, input, wins)
    dtype = input.type.dtype
    if not dtype.is_floating_point:
        raise FallbackToExtern  # eager's integer average rounds like no prim
    total = common.convert(input, compute_dtype(dtype))
    first = input.type.rank - spatial
    counts = []
    for offset, (window, out) in enumerate(zip(wins, outs, strict=True)):
        size = input.type.shape[first + offset]
        total = pool_dim(total, first + offset, window, out, 0, prims.add)
        counts.append(_window_counts(window, size, out, count_include_pad))
    if divisor_override is not None:
        counts = [[divisor_override]]
    return common.convert(divide_by_counts(total, counts), dtype)


def _avg_pool_cases(spatial: int) -> list[Case]:
    size = (9, 7, 5)[spatial - 1]
    dims = (size,) * spatial
    cases: list[Case] = [
        ((T((2, 3, *dims)), 2), {}, ""),
        ((T((1, 2, *dims)), 3), {"stride": 2, "padding": 1}, "padded, counting the padding"),
        ((T((1, 2, *dims)), 3), {"padding": 1, "count_include_pad": False}, "not counting it"),
        ((T((1, 2, *dims)), 2), {"ceil_mode": True, "padding": 1}, "ceil_mode"),
        ((T((2, *dims)), 3), {"stride": 2}, "unbatched"),
    ]
    if spatial > 1:
        cases.append(((T((1, 2, *dims)), 2), {"divisor_override": 3}, "divisor_override"))
    return cases


@translation(torch.avg_pool1d, samples=case_calls(*_avg_pool_cases(1)), dtypes=FLOATS)
def avg_pool1d(
    input: Value,
    kernel_size: IntArg,
    stride: IntArg | None = None,
    padding: IntArg = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> Value:
    geometry = (kernel_size, stride, padding, ceil_mode, count_include_pad)
    return avg_pool(input, 1, *geometry, None)


def _avg_pool_translation(
    spatial: int, key: Callable[..., Any], dtypes: frozenset[torch.dtype]
) -> None:
    def avg_pool_nd(
        input: Value,
        kernel_size: IntArg,
        stride: IntArg | None = None,
        padding: IntArg = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> Value:
        geometry = (kernel_size, stride, padding, ceil_mode, count_include_pad)
        return avg_pool(input, spatial, *geometry, divisor_override)

    avg_pool_nd.__name__ = avg_pool_nd.__qualname__ = f"avg_pool{spatial}d"
    samples = case_calls(*_avg_pool_cases(spatial))
    translation(key, samples=samples, dtypes=dtypes)(avg_pool_nd)


_avg_pool_translation(2, F.avg_pool2d, FLOATS)
# Eager's CPU kernel has no float16/bfloat16 avg_pool3d; the translation computes them anyway.
_avg_pool_translation(3, F.avg_pool3d, frozenset({torch.float32}))
