"""Registry rows of the indexing prims: gather, scatter, scatter_add, index and index_put.

Index operands are int64 or int32 tensors and never carry gradients; the ops are
differentiable with respect to ``x``, ``src`` and ``values``. ``gather`` and ``scatter`` follow
``torch.gather`` / ``torch.scatter`` (indices must be in range); ``index`` and ``index_put``
follow advanced indexing, so negative indices wrap::

    index(x: f32[5, 6, 7], i: i64[2, 3], j: i64[2, 3], dims=(0, 2)) == x[i, :, j]: f32[2, 3, 6]

Checks raise what eager PyTorch raises, as in :mod:`kiln.ops.movement`, whose shared checks
this module uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import IndexOutOfBounds
from kiln.ir.graph import Value
from kiln.ir.op import Op, Sample, Tag
from kiln.ir.types import Shape, TensorType, same_shape
from kiln.ops import prims
from kiln.ops.attrs import GatherAttrs, IndexAttrs, IndexPutAttrs, ScatterAttrs
from kiln.ops.movement import (
    Cotangents,
    Grads,
    check_dim,
    check_dims,
    concrete,
    movement,
    result,
    same_device,
    shape_text,
    shapes_differ,
    tensor_operand,
)
from kiln.ops.sampling import make_tensor

INDEX_DTYPES = frozenset({torch.int64, torch.int32})


def _index_operand(op: Op, operand: object, what: str = "index") -> TensorType:
    index = tensor_operand(op, operand, what)
    if index.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op.printed_name}: {what} must be int64 or int32, got {index.dtype}")
    return index


def _check_same_dtype(op: Op, x: TensorType, other: TensorType, what: str) -> None:
    if other.dtype != x.dtype:
        raise TypeError(
            f"{op.printed_name}: {what} is {other.dtype} but x is {x.dtype} (prims do not promote)"
        )


# ---------------------------------------------------------------------------------------------
# gather, scatter, scatter_add


def _check_fits(op: Op, index: TensorType, other: TensorType, what: str, skip: int = -1) -> None:
    """``index`` has ``other``'s rank and is no larger in any dim but ``skip``."""
    if index.rank != other.rank:
        raise RuntimeError(
            f"{op.printed_name}: index has {index.rank} dims but {what} has {other.rank}"
        )
    for dim, (size, limit) in enumerate(zip(index.shape, other.shape, strict=True)):
        if dim != skip and isinstance(size, int) and isinstance(limit, int) and size > limit:
            raise RuntimeError(
                f"{op.printed_name}: index of shape {shape_text(index.shape)} is larger than "
                f"{what} of shape {shape_text(other.shape)} at dim {dim}"
            )


def _gather_meta(attrs: GatherAttrs, x: TensorType, index: TensorType) -> TensorType:
    x = tensor_operand(Op.GATHER, x)
    index = _index_operand(Op.GATHER, index)
    same_device(Op.GATHER, (x, index))
    check_dim(Op.GATHER, attrs.dim, x.rank, scalar_ok=True)
    _check_fits(Op.GATHER, index, x, "x", skip=attrs.dim)
    return result(x, index.shape)


def _scatter_meta(op: Op) -> Callable[..., TensorType]:
    def meta(attrs: ScatterAttrs, x: TensorType, index: TensorType, src: TensorType) -> TensorType:
        x = tensor_operand(op, x)
        index = _index_operand(op, index)
        src = tensor_operand(op, src, "src")
        _check_same_dtype(op, x, src, "src")
        same_device(op, (x, index, src))
        check_dim(op, attrs.dim, x.rank, scalar_ok=True)
        _check_fits(op, index, src, "src")
        _check_fits(op, index, x, "x", skip=attrs.dim)
        return result(x, x.shape)

    return meta


def _scatter_impl(
    scatter: Callable[..., torch.Tensor],
) -> Callable[[ScatterAttrs, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``scatter(x, dim, index, src)`` on the part of ``src`` that ``index`` covers (the only
    part read), so eager autograd also works where ``src`` is larger than ``index``: torch's
    own derivative gives ``src`` a gradient of ``index``'s shape there and fails."""

    def impl(
        attrs: ScatterAttrs, x: torch.Tensor, index: torch.Tensor, src: torch.Tensor
    ) -> torch.Tensor:
        read = src[tuple(slice(0, size) for size in index.shape)]
        return scatter(x, attrs.dim, index, read)

    return impl


@dataclass(frozen=True)
class ScatterCase:
    """A gather/scatter sample: shapes of x, index and src, and the dim."""

    x: tuple[int, ...]
    dim: int
    index: tuple[int, ...]
    src: tuple[int, ...]
    note: str = ""


# Along ``dim`` each case's index is no longer than x, so scatter can draw distinct indices.
SCATTER_CASES = (
    ScatterCase((4, 5), 1, (4, 3), (4, 6)),
    ScatterCase((5, 3), 0, (2, 3), (2, 3), "dim 0"),
    ScatterCase((4, 5), 1, (2, 3), (3, 4), "index smaller than x and src"),
    ScatterCase((), 0, (), (), "0-d"),
    ScatterCase((4, 5), 1, (4, 0), (4, 0), "empty index"),
    ScatterCase((0, 3), 1, (0, 2), (0, 2), "0-size x"),
    ScatterCase((3, 1, 4), 2, (3, 1, 2), (3, 1, 2), "size-1 dim"),
)
DUPLICATE_SCATTER_CASES = (ScatterCase((3, 4), 1, (3, 10), (3, 10), "many duplicates"),)
GATHER_CASES = (
    *SCATTER_CASES,
    ScatterCase((4, 5), 0, (6, 2), (), "index longer than x along dim"),
)


def _dim_size(shape: tuple[int, ...], dim: int) -> int:
    return shape[dim] if shape else 1


def _random_index(shape: tuple[int, ...], size: int, device: torch.device) -> torch.Tensor:
    """Indices in ``[0, size)``, duplicates likely."""
    return torch.randint(0, max(size, 1), shape, device=device)


def _distinct_index(
    shape: tuple[int, ...], dim: int, size: int, device: torch.device
) -> torch.Tensor:
    """Indices in ``[0, size)`` that never repeat along ``dim`` (scatter is defined only then)."""
    if not shape:
        return torch.zeros((), dtype=torch.int64, device=device)
    full = (*shape[:dim], size, *shape[dim + 1 :])
    return torch.rand(full, device=device).argsort(dim).narrow(dim, 0, shape[dim])


def _gather_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    return [
        Sample(
            (
                make_tensor(c.x, dtype, device),
                _random_index(c.index, _dim_size(c.x, c.dim), device),
            ),
            GatherAttrs(c.dim),
            c.note,
        )
        for c in GATHER_CASES
    ]


def _scatter_samples(distinct: bool) -> Callable[[torch.dtype, torch.device], list[Sample]]:
    cases = SCATTER_CASES if distinct else SCATTER_CASES + DUPLICATE_SCATTER_CASES

    def index(case: ScatterCase, device: torch.device) -> torch.Tensor:
        size = _dim_size(case.x, case.dim)
        if distinct:
            return _distinct_index(case.index, case.dim, size, device)
        return _random_index(case.index, size, device)

    def samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
        return [
            Sample(
                (
                    make_tensor(c.x, dtype, device),
                    index(c, device),
                    make_tensor(c.src, dtype, device),
                ),
                ScatterAttrs(c.dim),
                c.note,
            )
            for c in cases
        ]

    return samples


# VJP rules: vjp(attrs, inputs, outputs, grads) -> one gradient per input, in prims; indices
# get None. Each is eager's derivative formula, the adjoint scattering with accumulation.


def _zeros(like: TensorType) -> Value:
    return prims.full(shape=like.shape, value=0, dtype=like.dtype, device=like.device)


def _src_grad(g: Value, index: Value, src: Value, dim: int) -> Value:
    """``g`` read back at the scattered positions; ``src`` elements past ``index``'s extent were
    never read, so they get zeros."""
    picked = prims.gather(g, index, dim=dim)
    if same_shape(picked.type.shape, src.type.shape):
        return picked
    zeros = (0,) * src.type.rank
    sizes = zip(src.type.shape, index.type.shape, strict=True)
    high = tuple(size - extent for size, extent in sizes)
    return prims.pad(picked, low=zeros, high=high, value=0)


def _gather_vjp(
    attrs: GatherAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents
) -> Grads:
    x, index = inputs
    (g,) = grads
    dim = attrs.dim % x.type.rank if x.type.rank else 0
    if x.type.rank and _picks_one(x.type, index.type, dim):
        return (_one_hot(x.type, index, g, dim), None)
    return (prims.scatter_add(_zeros(x.type), index, g, dim=attrs.dim), None)


def _picks_one(x: TensorType, index: TensorType, dim: int) -> bool:
    """Whether the gather picks one element along ``dim`` for every position of the other
    dims (``logp.gather(1, target[:, None])``: a loss's pick)."""
    if type(index.shape[dim]) is not int or index.shape[dim] != 1:
        return False
    others = tuple(size for d, size in enumerate(index.shape) if d != dim)
    return same_shape(others, tuple(size for d, size in enumerate(x.shape) if d != dim))


def _one_hot(x: TensorType, index: Value, g: Value, dim: int) -> Value:
    """The adjoint of a one-element pick as elementwise work: ``g`` where the position along
    ``dim`` is the picked one, else 0. A scatter into zeros would be a whole materialized
    tensor (GPT-2's loss: an fp32 [8192, 50257] buffer, 1.5 GiB); this fuses into the
    consumer (log_softmax's backward)."""
    every = tuple(range(x.rank))
    positions = prims.iota(
        length=x.shape[dim], start=0, step=1, dtype=index.type.dtype, device=x.device
    )
    positions = prims.broadcast(positions, shape=x.shape, dims=(dim,))
    picked = prims.eq(positions, prims.broadcast(index, shape=x.shape, dims=every))
    return prims.where(picked, prims.broadcast(g, shape=x.shape, dims=every), 0)


def _scatter_vjp(
    attrs: ScatterAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents
) -> Grads:
    """x: ``g`` with the overwritten positions zeroed; src: ``g`` at those positions."""
    _, index, src = inputs
    (g,) = grads
    cleared = prims.scatter(g, index, _zeros(index.type.with_(dtype=g.type.dtype)), dim=attrs.dim)
    return (cleared, None, _src_grad(g, index, src, attrs.dim))


def _scatter_add_vjp(
    attrs: ScatterAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents
) -> Grads:
    _, index, src = inputs
    (g,) = grads
    return (g, None, _src_grad(g, index, src, attrs.dim))


movement(
    Op.GATHER,
    GatherAttrs,
    _gather_meta,
    lambda attrs, x, index: torch.gather(x, attrs.dim, index),
    _gather_samples,
    "gather(x, index, dim): out[i][j] = x[index[i][j]][j] for dim 0 (torch.gather)",
    Tag.INDEXING,
    vjp=_gather_vjp,
)
movement(
    Op.SCATTER,
    ScatterAttrs,
    _scatter_meta(Op.SCATTER),
    _scatter_impl(torch.scatter),
    _scatter_samples(distinct=True),
    "scatter(x, index, src, dim): a copy of x with out[index[i][j]][j] = src[i][j] for dim 0",
    Tag.INDEXING,
    vjp=_scatter_vjp,
)
movement(
    Op.SCATTER_ADD,
    ScatterAttrs,
    _scatter_meta(Op.SCATTER_ADD),
    _scatter_impl(torch.scatter_add),
    _scatter_samples(distinct=False),
    "scatter_add(x, index, src, dim): a copy of x with out[index[i][j]][j] += src[i][j]",
    Tag.INDEXING,
    vjp=_scatter_add_vjp,
)


# ---------------------------------------------------------------------------------------------
# index, index_put


def indexed_shape(shape: Shape, dims: Sequence[int], index_shape: Shape) -> Shape:
    """The shape of ``x[..., i, ..., j, ...]``: the index shape replaces adjacent indexed dims in
    place, and goes first when they are apart (PyTorch's and NumPy's rule)."""
    if dims[-1] - dims[0] == len(dims) - 1:
        return (*shape[: dims[0]], *index_shape, *shape[dims[-1] + 1 :])
    return (*index_shape, *(size for dim, size in enumerate(shape) if dim not in dims))


def _index_meta_shape(
    op: Op, dims: tuple[int, ...], x: TensorType, indices: Sequence[object]
) -> Shape:
    """Check ``x`` and its index operands; return the shape of ``x`` indexed by them."""
    tensors = [_index_operand(op, index, f"index {n}") for n, index in enumerate(indices)]
    if not tensors or len(tensors) != len(dims):
        raise RuntimeError(f"{op.printed_name}: {len(tensors)} index tensors for dims {dims}")
    check_dims(op, dims, x.rank, increasing=True)
    same_device(op, (x, *tensors))
    for n, other in enumerate(tensors[1:], start=1):
        if shapes_differ(other.shape, tensors[0].shape):
            raise RuntimeError(
                f"{op.printed_name}: index {n} of shape {shape_text(other.shape)} differs from "
                f"index 0 of shape {shape_text(tensors[0].shape)} (prims do not broadcast)"
            )
    return indexed_shape(x.shape, dims, tensors[0].shape)


def _index_meta(attrs: IndexAttrs, x: TensorType, *indices: TensorType) -> TensorType:
    x = tensor_operand(Op.INDEX, x)
    return result(x, _index_meta_shape(Op.INDEX, attrs.dims, x, indices))


def _index_put_meta(
    attrs: IndexPutAttrs, x: TensorType, values: TensorType, *indices: TensorType
) -> TensorType:
    x = tensor_operand(Op.INDEX_PUT, x)
    values = tensor_operand(Op.INDEX_PUT, values, "values")
    _check_same_dtype(Op.INDEX_PUT, x, values, "values")
    expected = _index_meta_shape(Op.INDEX_PUT, attrs.dims, x, indices)
    if shapes_differ(values.shape, expected):
        raise RuntimeError(
            f"index_put: values of shape {shape_text(values.shape)} do not match the indexed "
            f"shape {shape_text(expected)}"
        )
    same_device(Op.INDEX_PUT, (x, values))
    return result(x, x.shape)


def _full_indices(
    dims: Sequence[int], indices: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """One entry per dim up to the last indexed one: the index tensor, or None (a full slice)."""
    placed: list[torch.Tensor | None] = [None] * (dims[-1] + 1)
    for dim, index in zip(dims, indices, strict=True):
        placed[dim] = index
    return placed


def _index_impl(attrs: IndexAttrs, x: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
    if not attrs.negative:
        for dim, index in zip(attrs.dims, indices, strict=True):
            if index.numel() and int(index.min()) < 0:
                raise IndexOutOfBounds.of(int(index.min()), x.shape[dim])
    key = tuple(slice(None) if i is None else i for i in _full_indices(attrs.dims, indices))
    return x[key]


def _index_put_impl(
    attrs: IndexPutAttrs, x: torch.Tensor, values: torch.Tensor, *indices: torch.Tensor
) -> torch.Tensor:
    if attrs.accumulate and _atomic_add_pays(attrs, x, indices):
        return _index_add(attrs.dims[0], x, values, indices[0])
    if attrs.in_range and indices[0].dtype == torch.int64:
        return x.index_copy(attrs.dims[0], indices[0], values)
    # aten.index_put takes None for a full slice, which torch.index_put does not.
    placed = _full_indices(attrs.dims, indices)
    return torch.ops.aten.index_put(x, placed, values, attrs.accumulate)


def index_put_in_place(
    attrs: IndexPutAttrs, x: torch.Tensor, values: torch.Tensor, *indices: torch.Tensor
) -> torch.Tensor:
    """``x[indices] = values`` (``+=``) into ``x`` itself, returning ``x``: a graph input the
    graph mutates or a temporary, which nothing else reads (``Scheduler._writes_in_place``)."""
    if attrs.accumulate and _atomic_add_pays(attrs, x, indices):
        return _index_add(attrs.dims[0], x, values, indices[0], in_place=True)
    if attrs.in_range and indices[0].dtype == torch.int64:  # (14 against 6 us a call, CPU)
        return x.index_copy_(attrs.dims[0], indices[0], values)
    placed = _full_indices(attrs.dims, indices)
    return torch.ops.aten.index_put_(x, placed, values, attrs.accumulate)


def _atomic_add_pays(attrs: IndexPutAttrs, x: torch.Tensor, indices: Sequence[Any]) -> bool:
    """Whether ``x[index] += values`` should run as ``index_add`` (atomic adds) instead of
    ``index_put``: on CUDA, one integer index, 32/64-bit floats, deterministic mode off.
    CUDA's ``index_put(accumulate=True)`` sorts the indices first; on BERT-base's embedding
    gradients (8192 indices into 30522 rows of 768) that took 1.8 ms against eager's
    ``embedding_dense_backward`` at about 0.1 ms."""
    return (
        x.is_cuda
        and len(indices) == 1
        and indices[0].dtype in (torch.int32, torch.int64)
        and x.dtype in (torch.float32, torch.float64)
        and not torch.are_deterministic_algorithms_enabled()
    )


def _index_add(
    dim: int, x: torch.Tensor, values: torch.Tensor, index: torch.Tensor, in_place: bool = False
) -> torch.Tensor:
    before, after = x.shape[:dim], x.shape[dim + 1 :]
    values = values.expand(*before, *index.shape, *after).reshape(*before, index.numel(), *after)
    index = torch.where(index < 0, index + x.shape[dim], index).reshape(-1)  # as index_put wraps
    return x.index_add_(dim, index, values) if in_place else x.index_add(dim, index, values)


@dataclass(frozen=True)
class IndexCase:
    """An index/index_put sample: x's shape, the indexed dims and the common index shape."""

    x: tuple[int, ...]
    dims: tuple[int, ...]
    index: tuple[int, ...]
    note: str = ""
    dtype: torch.dtype = torch.int64


# Each case has room for distinct index positions (index_put without accumulate needs them).
INDEX_CASES = (
    IndexCase((5, 6, 7), (0,), (4,), "leading dim"),
    IndexCase((5, 6, 7), (1,), (2, 3), "2-d index in the middle"),
    IndexCase((5, 6, 7), (0, 2), (2, 3), "dims apart: index shape goes first"),
    IndexCase((5, 6, 7), (1, 2), (4,), "adjacent dims: index shape in place"),
    IndexCase((4, 5, 6, 2), (1, 3), (3,), "dims apart, not leading"),
    IndexCase((5, 6, 7), (0, 1, 2), (3,), "every dim"),
    IndexCase((5, 6), (1,), (), "0-d index"),
    IndexCase((5, 6), (0,), (0,), "empty index"),
    IndexCase((0, 4), (1,), (3,), "0-size x"),
    IndexCase((1, 3), (0,), (1,), "size-1 dim"),
    IndexCase((5, 6, 7), (0, 2), (3,), "int32 indices", torch.int32),
)
DUPLICATE_INDEX_CASES = (
    IndexCase((3, 4), (0,), (8,), "duplicates"),
    IndexCase((2, 3, 4), (0, 2), (5, 3), "duplicate pairs, dims apart"),
)


def _wrap_some(index: torch.Tensor, size: int) -> torch.Tensor:
    """Shift about half the indices by ``-size``: the same positions, written negatively."""
    negative = torch.rand(index.shape, device=index.device) < 0.5
    return torch.where(negative, index - size, index)


def _index_tensors(case: IndexCase, distinct: bool, device: torch.device) -> list[torch.Tensor]:
    """One index tensor per dim of ``case``; ``distinct`` makes the indexed positions unique."""
    sizes = [case.x[dim] for dim in case.dims]
    count = math.prod(case.index)
    if distinct:
        flat = torch.randperm(math.prod(sizes), device=device)[:count]
        coordinates = torch.unravel_index(flat, sizes)
    else:
        coordinates = tuple(_random_index((count,), size, device) for size in sizes)
    return [
        _wrap_some(c, size).reshape(case.index).to(case.dtype)
        for c, size in zip(coordinates, sizes, strict=True)
    ]


def _index_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    return [
        Sample(
            (make_tensor(c.x, dtype, device), *_index_tensors(c, False, device)),
            IndexAttrs(c.dims),
            c.note,
        )
        for c in INDEX_CASES + DUPLICATE_INDEX_CASES
    ]


def _index_put_sample(
    case: IndexCase, accumulate: bool, dtype: torch.dtype, device: torch.device
) -> Sample:
    values = make_tensor(concrete(indexed_shape(case.x, case.dims, case.index)), dtype, device)
    indices = _index_tensors(case, not accumulate, device)
    note = f"{case.note}, accumulate" if accumulate else case.note
    return Sample(
        (make_tensor(case.x, dtype, device), values, *indices),
        IndexPutAttrs(case.dims, accumulate),
        note,
    )


def _index_put_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    plain = [_index_put_sample(c, False, dtype, device) for c in INDEX_CASES]
    summed = [
        _index_put_sample(c, True, dtype, device) for c in INDEX_CASES + DUPLICATE_INDEX_CASES
    ]
    return plain + summed


def _index_vjp(attrs: IndexAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents) -> Grads:
    """Zeros with the cotangent added at the indexed positions (duplicates accumulate)."""
    x, *indices = inputs
    (g,) = grads
    summed = prims.index_put(_zeros(x.type), g, *indices, dims=attrs.dims, accumulate=True)
    return (summed, *(None for _ in indices))


def _index_put_vjp(
    attrs: IndexPutAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents
) -> Grads:
    """x: ``g``, with the overwritten positions zeroed unless accumulating; values: ``g`` at
    the indexed positions."""
    _, values, *indices = inputs
    (g,) = grads
    kept = g
    if not attrs.accumulate:
        kept = prims.index_put(g, _zeros(values.type), *indices, dims=attrs.dims)
    picked = prims.index(g, *indices, dims=attrs.dims)
    return (kept, picked, *(None for _ in indices))


movement(
    Op.INDEX,
    IndexAttrs,
    _index_meta,
    _index_impl,
    _index_samples,
    "index(x, *indices, dims): x[..., i, ..., j, ...] with the index tensors at dims",
    Tag.INDEXING,
    vjp=_index_vjp,
)
movement(
    Op.INDEX_PUT,
    IndexPutAttrs,
    _index_put_meta,
    _index_put_impl,
    _index_put_samples,
    "index_put(x, values, *indices, dims, accumulate): x[indices] = values (or +=), out of place",
    Tag.INDEXING,
    vjp=_index_put_vjp,
)
