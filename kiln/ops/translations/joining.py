"""Translations that join tensors and split them apart: cat, stack, hstack, vstack, split,
chunk, tensor_split, unbind.

Joining promotes dtypes across its inputs as eager does, then emits one ``cat``::

    torch.cat([a, b], dim=-1)   ->  cat(convert(a, dtype=torch.float32), b, dim=1)
                                    # a: i64[2, 3], b: f32[2, 5]

Splitting emits one ``slice`` per piece and returns the tuple eager returns; the pieces are
views of the input (``view=True``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.symbolic import Dim, Sym
from kiln.ops import prims
from kiln.ops.sampling import ALL
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.common import autocast, normalize_dim
from kiln.ops.translations.math import no_out
from kiln.ops.translations.shape import (
    case,
    piece_count,
    reshape,
    shape_of,
    slice_bound,
    squeeze_dims,
    take_slice,
    tensor_calls,
    unsqueeze_dim,
)
from kiln.ops.translations.table import CallFn, FallbackToExtern, translation

# ---------------------------------------------------------------------------------------------
# cat, stack, hstack, vstack


def promoted(tensors: Sequence[Value]) -> list[Value]:
    """``tensors`` converted to their promoted dtype (all tensors rank alike here)."""
    dtype = functools.reduce(torch.promote_types, (t.type.dtype for t in tensors))
    return [prims.convert(t, dtype=dtype) if t.type.dtype != dtype else t for t in tensors]


def _check_cat(tensors: Sequence[Value], dim: int) -> None:
    first = shape_of(tensors[0])
    for number, tensor in enumerate(tensors):
        shape = shape_of(tensor)
        if len(shape) != len(first):
            raise RuntimeError(
                f"Tensors must have same number of dimensions: got {len(first)} and {len(shape)}"
            )
        for axis, (want, got) in enumerate(zip(first, shape, strict=True)):
            if axis != dim and want != got:
                raise RuntimeError(
                    f"Sizes of tensors must match except in dimension {dim}. Expected size "
                    f"{want} but got size {got} for tensor number {number} in the list."
                )


def concatenate(tensors: Sequence[Value], dim: int, op: str = "torch.cat") -> Value:
    """Eager ``torch.cat``: promote, skip legacy empty ``(0,)`` tensors, check, then ``cat``."""
    if not tensors:
        raise ValueError(f"{op}(): expected a non-empty list of Tensors")
    for position, tensor in enumerate(tensors):
        if tensor.type.rank == 0:
            raise RuntimeError(
                f"zero-dimensional tensor (at position {position}) cannot be concatenated"
            )
    values = promoted(autocast("cat", *tensors))
    reference = next((v for v in values if v.type.shape != (0,)), values[0])
    dim = normalize_dim(dim, reference.type.rank, op)
    kept = []
    for value in values:
        if value.type.shape == (0,) and reference.type.rank != 1:
            if not value.type.requires_grad:
                continue
            # (an empty slab instead: eager still gives the skipped tensor a gradient)
            slab = tuple(
                0 if axis == dim else size for axis, size in enumerate(shape_of(reference))
            )
            value = reshape(value, slab)
        kept.append(value)
    _check_cat(kept, dim)
    if len(kept) == 1:
        return kept[0]
    return prims.cat(*kept, dim=dim)


_CAT_CASES = [
    ((T((2, 3)), T((4, 3))), 0),
    ((T((2, 3)), T((2, 0)), T((2, 5))), -1),
    ([T((2, 3)), T((2, 3), torch.int64)], 1),
    ([T((3,))], 0),
    ([T((2, 3)), T((0,), torch.float32)], 1),
    ([T((0,)), T((0,))], 0),
]


@translation(
    torch.cat,
    torch.concat,
    samples=case_calls(
        *[((tensors, dim), {}, "") for tensors, dim in _CAT_CASES],
        (([T((1, 2)), T((3, 2))],), {}, "default dim"),
        (([T((2, 1)), T((2, 2), torch.bool)],), {"dim": -1}, "dim kwarg, bool"),
    ),
    dtypes=ALL,
)
def cat(tensors: Sequence[Value], dim: int = 0, *, out: Any = None) -> Value:
    no_out(out)
    return concatenate(tensors, dim)


@translation(
    torch.concatenate,
    samples=case_calls(
        *[((tensors,), {"axis": dim}, "") for tensors, dim in _CAT_CASES[:3]],
    ),
    dtypes=ALL,
)
def concatenate_(tensors: Sequence[Value], axis: int = 0, *, out: Any = None) -> Value:
    no_out(out)
    return concatenate(tensors, axis, "torch.concatenate")


@translation(
    torch.stack,
    samples=case_calls(
        (([T((2, 3)), T((2, 3))],), {}, ""),
        (([T((2, 3)), T((2, 3), torch.int32)], -1), {}, "last dim, promotion"),
        (([T(()), T(())],), {"dim": 0}, "0-d"),
        (([T((0, 2))],), {"dim": 1}, "0-size"),
    ),
    dtypes=ALL,
)
def stack(tensors: Sequence[Value], dim: int = 0, *, out: Any = None) -> Value:
    no_out(out)
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    first = tensors[0].type.shape
    for number, tensor in enumerate(tensors):
        if tensor.type.shape != first:
            raise RuntimeError(
                "stack expects each tensor to be equal size, but got "
                f"{list(first)} at entry 0 and {list(tensor.type.shape)} at entry {number}"
            )
    dim = normalize_dim(dim, len(first) + 1, "stack")
    values = promoted(autocast("stack", *tensors))
    return concatenate([unsqueeze_dim(v, dim) for v in values], dim, "torch.stack")


def _at_least(value: Value, rank: int) -> Value:
    """``atleast_2d``-style: 0-d becomes ``(1,)``..., 1-d ``(n,)`` becomes ``(1, n)``..."""
    shape = shape_of(value)
    if len(shape) >= rank:
        return value
    if rank == 3 and len(shape) == 2:
        return reshape(value, (*shape, 1))
    if rank == 3 and len(shape) == 1:
        return reshape(value, (1, *shape, 1))
    return reshape(value, (1,) * (rank - len(shape)) + shape)


def _stack_calls(*shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> CallFn:
    """Samples joining two tensors; the second of the first pair is int64 (promotion)."""
    first, *rest = shapes
    return case_calls(
        (([T(first[0]), T(first[1], torch.int64)],), {}, "promotion"),
        *[(([T(a), T(b)],), {}, "") for a, b in rest],
    )


@translation(
    torch.hstack, samples=_stack_calls(((3,), (3,)), ((2, 3), (2, 1)), ((), (2,))), dtypes=ALL
)
def hstack(tensors: Sequence[Value], *, out: Any = None) -> Value:
    no_out(out)
    values = [_at_least(t, 1) for t in tensors]
    dim = 0 if values and values[0].type.rank == 1 else 1
    return concatenate(values, dim, "torch.hstack")


@translation(
    torch.vstack,
    torch.row_stack,
    samples=_stack_calls(((3,), (3,)), ((2, 3), (1, 3)), ((), ())),
    dtypes=ALL,
)
def vstack(tensors: Sequence[Value], *, out: Any = None) -> Value:
    no_out(out)
    return concatenate([_at_least(t, 2) for t in tensors], 0, "torch.vstack")


@translation(
    torch.dstack,
    samples=_stack_calls(((3,), (3,)), ((2, 3), (2, 3)), ((2, 3, 1), (2, 3, 2))),
    dtypes=ALL,
)
def dstack(tensors: Sequence[Value], *, out: Any = None) -> Value:
    no_out(out)
    return concatenate([_at_least(t, 3) for t in tensors], 2, "torch.dstack")


# ---------------------------------------------------------------------------------------------
# split, chunk, tensor_split, unbind


def pieces(value: Value, dim: int, bounds: Sequence[tuple[Dim, Dim]]) -> tuple[Value, ...]:
    """One slice of ``value`` along ``dim`` per ``(start, stop)``."""
    return tuple(take_slice(value, dim, start, stop) for start, stop in bounds)


def _consecutive(lengths: Sequence[Dim]) -> list[tuple[Dim, Dim]]:
    ends = list(itertools.accumulate(lengths))
    return [(end - length, end) for end, length in zip(ends, lengths, strict=True)]


def split_by_lengths(value: Value, lengths: Sequence[Dim], dim: int) -> tuple[Value, ...]:
    shape = shape_of(value)
    dim = normalize_dim(dim, len(shape), "split_with_sizes")
    if any(length < 0 for length in lengths) or sum(lengths) != shape[dim]:
        raise RuntimeError(
            f"split_with_sizes expects split_sizes to sum exactly to {shape[dim]} (input "
            f"tensor's size at dimension {dim}), but got split_sizes={list(lengths)}"
        )
    return pieces(value, dim, _consecutive(lengths))


def split_every(value: Value, size: Dim, dim: int) -> tuple[Value, ...]:
    """Pieces of ``size`` along ``dim``, the last one smaller (``Tensor.split(int)``)."""
    shape = shape_of(value)
    dim = normalize_dim(dim, len(shape), "split")
    total = shape[dim]
    if size < 0 or (size == 0 and total != 0):
        raise RuntimeError(
            f"split_size can only be 0 if dimension size is 0, but got dimension size of {total}"
        )
    count = max(piece_count(total, size), 1) if size else 1
    whole = [(i * size, (i + 1) * size) for i in range(count - 1)]
    return pieces(value, dim, [*whole, ((count - 1) * size, total)])


_SPLIT_CASES = [
    case((6, 4), 2),
    case((5, 4), 2, -1, note="uneven, negative dim"),
    case((6, 4), [1, 2, 3], note="sizes"),
    case((6, 4), (4, 0), 1, note="sizes with 0"),
    case((0, 3), 2, note="0-size"),
]


@translation(
    torch.Tensor.split,
    torch.split,
    samples=tensor_calls([*_SPLIT_CASES, case((4, 6), 4, dim=1, note="dim kwarg")]),
    dtypes=ALL,
    view=True,
)
def split(tensor: Value, split_size: Dim | Sequence[Dim], dim: int = 0) -> tuple[Value, ...]:
    if isinstance(split_size, Sequence):
        return split_by_lengths(tensor, [_size(s) for s in split_size], dim)
    return split_every(tensor, _size(split_size), dim)


def _size(size: Any) -> Dim:
    return size if isinstance(size, Sym) else int(size)


@translation(
    torch.Tensor.split_with_sizes,
    torch.split_with_sizes,
    samples=tensor_calls([_SPLIT_CASES[2], _SPLIT_CASES[3]]),
    dtypes=ALL,
    view=True,
)
def split_with_sizes(self: Value, split_sizes: Sequence[int], dim: int = 0) -> tuple[Value, ...]:
    return split_by_lengths(self, list(split_sizes), dim)


@translation(
    torch.Tensor.chunk,
    torch.chunk,
    samples=tensor_calls(
        [
            case((6, 4), 3),
            case((5, 4), 2, 1, note="uneven"),
            case((6,), 4, note="fewer chunks than asked"),
            case((0,), 3, note="0-size"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def chunk(input: Value, chunks: int, dim: int = 0) -> tuple[Value, ...]:
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    shape = shape_of(input)
    dim = normalize_dim(dim, len(shape), "chunk")
    size = (shape[dim] + chunks - 1) // chunks
    if size == 0:
        return split_by_lengths(input, [0] * chunks, dim)
    return split_every(input, size, dim)


@translation(
    torch.Tensor.tensor_split,
    torch.tensor_split,
    samples=tensor_calls(
        [
            case((7, 2), 3),
            case((10,), [3, -2], note="indices, negative"),
            case((10, 3), (7, 3), note="decreasing indices"),
            case((4, 5), [2, 9], 1, note="past the end"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def tensor_split(
    input: Value,
    indices_or_sections: int | Sequence[int] | Value | None = None,
    dim: int = 0,
    *,
    sections: int | None = None,
    indices: Sequence[int] | None = None,
) -> tuple[Value, ...]:
    if indices_or_sections is None:
        indices_or_sections = sections if sections is not None else indices
    if indices_or_sections is None or isinstance(indices_or_sections, Value):
        raise FallbackToExtern  # sections given by a tensor
    shape = shape_of(input)
    dim = normalize_dim(dim, len(shape), "tensor_split")
    total = shape[dim]
    if isinstance(indices_or_sections, int | Sym):
        sections = int(indices_or_sections)  # (the number of pieces: a symbolic one specializes)
        if sections <= 0:
            raise RuntimeError(f"number of sections must be larger than 0, got {sections}")
        lengths = [total // sections + (i < total % sections) for i in range(sections)]
        return pieces(input, dim, _consecutive(lengths))
    cuts = [0, *indices_or_sections, total]
    bounds = [
        (slice_bound(a, total, 0), slice_bound(b, total, total))
        for a, b in itertools.pairwise(cuts)
    ]
    return pieces(input, dim, bounds)


@translation(
    torch.Tensor.unbind,
    torch.unbind,
    samples=tensor_calls([case((3, 4)), case((3, 4), -1), case((0, 2), 1, note="0-size")]),
    dtypes=ALL,
    view=True,
)
def unbind(input: Value, dim: int = 0) -> tuple[Value, ...]:
    shape = shape_of(input)
    dim = normalize_dim(dim, len(shape), "unbind")
    if not shape:
        raise IndexError("Dimension specified as 0 but tensor has no dimensions")
    return tuple(squeeze_dims(take_slice(input, dim, i, i + 1), (dim,)) for i in range(shape[dim]))
