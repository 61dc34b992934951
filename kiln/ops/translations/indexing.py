"""Translations of subscripts and masks: ``x[key]``, ``x[key] = value``, masked_fill and
masked_scatter (the indexing functions, gather to take, are in ``gathering``).

``x[key]`` follows PyTorch's order: ints, slices, ``None`` and ``...`` apply first as basic
indexing (``select``/``slice``/``unsqueeze``), then the index tensors (and lists, and bool
scalars) go to one ``index`` prim, broadcast together, at the dims they index::

    x[0, :, idx]   ->  t0 = squeeze(slice(x, dim=0, start=0, stop=1), dims=(0,))
                       t1 = index(t0, idx, dims=(1,))                 # x: f32[5, 6, 7]

``x[key] = v`` writes the element positions that ``key`` selects, found by indexing an
``iota`` of ``x``'s shape with the same key, with one ``index_put`` into the flattened ``x``.

A bool mask tensor selects a data-dependent number of elements, which a static graph cannot
express: ``x[mask]`` raises :class:`~kiln.errors.TraceError`. ``x[..., mask] = v`` keeps
the shape, so it becomes a ``where`` (v must not need one value per selected element)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import torch

from kiln.errors import TraceError
from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ir.types import Dim
from kiln.ops import prims
from kiln.ops.sampling import ALL, scalar_for
from kiln.ops.translations.cases import T, case_calls, materialize
from kiln.ops.translations.common import broadcast_shapes, broadcast_to, constant, convert, full
from kiln.ops.translations.shape import (
    numel_of,
    reshape,
    shape_of,
    slice_bound,
    take_slice,
    unsqueeze_dim,
)
from kiln.ops.translations.slicing import fill_scalar, select_index
from kiln.ops.translations.table import Call, translation

INDEX_DTYPES = (torch.int64, torch.int32)
MASK_DTYPES = (torch.bool, torch.uint8)

# ---------------------------------------------------------------------------------------------
# the index grammar


@dataclass(frozen=True)
class Mask:
    """A bool (or uint8) mask tensor: it consumes ``rank`` dims, selecting data-dependently."""

    value: Value


@dataclass(frozen=True)
class BoolScalar:
    """``x[True]``/``x[False]``: a new dim, indexed by ``[0]`` or by nothing (an advanced
    index, so it takes part in the placement of the other index tensors)."""

    flag: bool


@dataclass(frozen=True)
class Indices:
    """Index tensors consuming one dim each: a traced int tensor, a constant list, or the
    ``nonzero()`` columns of a constant bool list. ``extremes`` (the least and greatest value
    of each) lets constants be bounds-checked while tracing, as eager does."""

    values: tuple[Value, ...]
    extremes: tuple[tuple[int, int], ...] = ()


Item = int | Sym | slice | None | EllipsisType | Mask | BoolScalar | Indices


def _sequence_as_tuple(key: Sequence[Any]) -> bool:
    """PyTorch's legacy rule: a list holding slices, ``None``, ``...``, tensors or sequences
    indexes like a tuple (``x[[0, slice(None)]]``); else it is one index tensor."""
    return any(
        item is None or item is Ellipsis or isinstance(item, slice | Value | Sequence)
        for item in key
    )


def _constant_index(items: Any) -> Indices:
    """A list (or nested tuple) of ints or bools as constant index tensors."""
    tensor = torch.tensor(items)
    if tensor.numel() == 0:
        tensor = tensor.to(torch.int64)
    if tensor.dtype.is_floating_point:
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    columns = tensor.nonzero().unbind(1) if tensor.dtype == torch.bool else (tensor.long(),)
    extremes = tuple((int(c.min()), int(c.max())) if c.numel() else (0, -1) for c in columns)
    return Indices(tuple(constant(c) for c in columns), extremes)


def _item(item: Any) -> Item:
    """One index item in canonical form."""
    if item is None or item is Ellipsis or isinstance(item, slice):
        return item
    if isinstance(item, Value):
        if item.type.dtype in MASK_DTYPES:
            return Mask(item)
        if item.type.dtype not in INDEX_DTYPES:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return Indices((item,))
    if isinstance(item, bool):
        return BoolScalar(item)
    if isinstance(item, list | tuple):
        return _constant_index(item)
    if isinstance(item, Sym):
        return item
    try:
        return operator.index(item)
    except TypeError:
        raise IndexError(
            "only integers, slices (`:`), ellipsis (`...`), None and long or byte Variables are "
            f"valid indices (got {type(item).__name__})"
        ) from None


def parse_key(key: Any) -> list[Item]:
    """``key`` as a list of canonical items."""
    if isinstance(key, tuple) or (isinstance(key, list) and _sequence_as_tuple(key)):
        items = list(key)
    else:
        items = [key]
    return [_item(item) for item in items]


def _consumed(item: Item) -> int:
    """How many dims of the indexed tensor an item uses up."""
    if isinstance(item, Mask):
        return item.value.type.rank
    if isinstance(item, Indices):
        return len(item.values)
    return 0 if item is None or item is Ellipsis or isinstance(item, BoolScalar) else 1


def _ellipsis_dims(items: Sequence[Item], rank: int) -> int:
    """The number of dims the first ``...`` stands for (later ones stand for none, as in
    PyTorch); IndexError for too many indices."""
    used = sum(_consumed(item) for item in items)
    if used > rank:
        raise IndexError(f"too many indices for tensor of dimension {rank}")
    return rank - used


# ---------------------------------------------------------------------------------------------
# applying a key


def _slice_bounds(item: slice, size: Dim) -> tuple[Dim, Dim, int]:
    for bound in (item.start, item.stop, item.step):
        if isinstance(bound, Value):
            raise TraceError(
                "slicing with tensor bounds needs the bounds' values, which symbolic tracing "
                "does not have; use Python ints"
            )
    step = 1 if item.step is None else operator.index(item.step)
    if step <= 0:
        raise ValueError("step must be greater than zero")
    start = slice_bound(item.start, size, 0)
    return start, max(start, slice_bound(item.stop, size, size)), step


def _check_index(index: Dim, size: Dim, dim: int) -> None:
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {size}")


@dataclass
class Applied:
    """A key applied up to its advanced part: the basic-indexed value, and where (which dim
    of it) each index tensor and each mask goes."""

    value: Value
    indices: list[tuple[int, Value]]
    masks: list[tuple[int, Mask]]


def _apply_indices(applied: Applied, dim: int, item: Indices) -> int:
    shape = shape_of(applied.value)
    for offset, index in enumerate(item.values):
        for bound in item.extremes[offset] if item.extremes else ():
            _check_index(bound, shape[dim + offset], dim + offset)
        applied.indices.append((dim + offset, index))
    return dim + len(item.values)


def apply_basic(x: Value, items: Sequence[Item]) -> Applied:
    """Apply ints, slices, ``None`` and ``...``; place index tensors and masks."""
    ellipsis_dims = _ellipsis_dims(items, x.type.rank)
    applied, dim = Applied(x, [], []), 0
    for item in items:
        if item is None:
            applied.value, dim = unsqueeze_dim(applied.value, dim), dim + 1
        elif item is Ellipsis:
            dim, ellipsis_dims = dim + ellipsis_dims, 0
        elif isinstance(item, int | Sym):
            _check_index(item, shape_of(applied.value)[dim], dim)
            applied.value = select_index(applied.value, dim, item)
        elif isinstance(item, slice):
            bounds = _slice_bounds(item, shape_of(applied.value)[dim])
            applied.value, dim = take_slice(applied.value, dim, *bounds), dim + 1
        elif isinstance(item, Mask):
            applied.masks.append((dim, item))
            dim += item.value.type.rank
        elif isinstance(item, BoolScalar):
            index = constant(torch.zeros(1 if item.flag else 0, dtype=torch.int64))
            applied.value = unsqueeze_dim(applied.value, dim)
            applied.indices.append((dim, index))
            dim += 1
        else:
            dim = _apply_indices(applied, dim, item)
    return applied


def apply_advanced(x: Value, advanced: Sequence[tuple[int, Value]]) -> Value:
    """One ``index`` prim for the index tensors, broadcast to one shape."""
    if not advanced:
        return x
    try:
        shape = broadcast_shapes(*(index.type.shape for _, index in advanced))
    except RuntimeError:
        shapes = ", ".join(str(list(index.type.shape)) for _, index in advanced)
        raise IndexError(
            f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}"
        ) from None
    indices = [broadcast_to(index, shape) for _, index in advanced]
    return prims.index(x, *indices, dims=tuple(dim for dim, _ in advanced))


def index_items(x: Value, items: Sequence[Item]) -> Value:
    """``x[key]`` for the parsed items of a key without a bool tensor mask."""
    applied = apply_basic(x, items)
    if applied.masks:
        raise TraceError(
            "x[mask] with a bool tensor mask selects a data-dependent number of elements, "
            "which a traced graph cannot express; use torch.where(mask, x, other) or "
            "x.masked_fill(mask, value) instead"
        )
    return apply_advanced(applied.value, applied.indices)


# ---------------------------------------------------------------------------------------------
# x[key], x[key] = value


def distinct(count: int, size: int, device: torch.device) -> torch.Tensor:
    """``count`` distinct indices into a dim of ``size``, some written negatively: a
    non-accumulating write is defined only without repeated positions."""
    index = torch.randperm(size, device=device)[:count]
    return torch.where(torch.rand(count, device=device) < 0.5, index - size, index)


def _getitem_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def index(shape: tuple[int, ...], size: int, kind: torch.dtype = torch.int64) -> T:
        return T(shape, kind, low=-size, high=size)

    keys: list[tuple[Any, str]] = [
        (0, "int"),
        (-1, "negative int"),
        ((1, -2), "two ints"),
        (slice(1, 4), "slice"),
        (slice(None, None, 2), "step"),
        ((slice(-3, None), slice(None, -1, 3)), "negative bounds, step 3"),
        (slice(10, 20), "empty slice"),
        ((Ellipsis, 1), "ellipsis"),
        ((None, 0, Ellipsis, None), "None"),
        ((slice(None), index((4,), 6)), "index tensor"),
        (index((2, 3), 5), "2-d index tensor"),
        ((index((4,), 5), slice(None), index((4,), 7)), "indices apart"),
        ((slice(1, 3), index((2, 1), 6), index((3,), 7)), "adjacent indices broadcast"),
        ((0, slice(None), index((3,), 7)), "int among indices"),
        ((index((), 5), slice(2)), "0-d index"),
        ((index((3,), 5, torch.int32),), "int32 index"),
        ([0, 2, -1], "list"),
        (([0, 1], Ellipsis, [[1], [2]]), "lists broadcast"),
        ((Ellipsis, [True, False, True, True, False, False, True]), "constant bool list"),
        (True, "True"),
        ((False, 1), "False"),
        ((), "empty tuple"),
    ]
    return [Call(materialize((T((5, 6, 7)), key), dtype, device), note=note) for key, note in keys]


def _is_basic_key(self: Value, key: Any) -> bool:
    """Whether ``self[key]`` is a view in eager: only ints, slices, None and Ellipsis."""
    items = key if isinstance(key, tuple) else (key,)
    return all(
        item is None
        or item is Ellipsis
        or isinstance(item, slice)
        or (isinstance(item, int | Sym) and not isinstance(item, bool))
        for item in items
    )


@translation(torch.Tensor.__getitem__, samples=_getitem_samples, dtypes=ALL, view=_is_basic_key)
def getitem(self: Value, key: Any) -> Value:
    return index_items(self, parse_key(key))


def positions(x: Value) -> Value:
    """The flat position of every element of ``x``, shaped like ``x`` (int64)."""
    count = numel_of(x)
    flat = prims.iota(length=count, start=0, step=1, dtype=torch.int64, device=x.type.device)
    return reshape(flat, shape_of(x))


def _strip_leading_ones(value: Value, rank: int) -> Value:
    """Drop leading size-1 dims while ``value`` has more than ``rank`` dims (as copy_ does)."""
    shape = shape_of(value)
    drop = 0
    while len(shape) - drop > rank and shape[drop] == 1:
        drop += 1
    return reshape(value, shape[drop:]) if drop else value


def fitted(value: Value | bool | int | float, shape: Sequence[Dim], like: Value) -> Value:
    """``value`` as a tensor of ``like``'s dtype broadcast to ``shape``, as ``copy_`` does."""
    dtype, target = like.type.dtype, tuple(shape)
    if not isinstance(value, Value):
        return full(target, fill_scalar(value, dtype), dtype, like.type.device)
    converted = convert(value, dtype)
    value = _strip_leading_ones(converted, len(target))
    source = shape_of(value)
    offset = len(target) - len(source)
    if offset < 0 or any(s not in (1, t) for s, t in zip(source, target[offset:], strict=True)):
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {list(source)} cannot be broadcast to "
            f"indexing result of shape {list(target)}"
        )
    return broadcast_to(value, target)


def _masked_update(self: Value, applied: Applied, value: Any) -> Value:
    """The new values at the positions ``applied.value`` for ``x[..., mask, ...] = value``:
    the value where the mask holds, the current element elsewhere. The value must not depend
    on how many elements the mask selects."""
    if applied.indices or len(applied.masks) > 1:
        raise TraceError(
            "x[key] = value with a bool mask and other index tensors cannot be traced; "
            "use torch.where"
        )
    (start, mask), region = applied.masks[0], applied.value
    shape, mask_shape = shape_of(region), shape_of(mask.value)
    stop = start + len(mask_shape)
    for offset, size in enumerate(mask_shape):
        if shape[start + offset] != size:
            raise IndexError(
                f"The shape of the mask {list(mask_shape)} at index {offset} does not match the "
                f"shape of the indexed tensor {list(shape)} at index {start + offset}"
            )
    condition = as_bool(mask.value)
    if mask_shape != shape:
        condition = prims.broadcast(condition, shape=shape, dims=tuple(range(start, stop)))
    current = self if region.type.shape == self.type.shape else _elements(self, region)
    if not isinstance(value, Value):
        return prims.where(condition, fill_scalar(value, self.type.dtype), current)
    # The selected elements form one dim of unknown length: the value must broadcast over it.
    try:
        fill = fitted(value, (*shape[:start], 1, *shape[stop:]), self)
    except RuntimeError:
        raise TraceError(
            "x[mask] = values with one value per selected element depends on how many "
            "elements the mask selects, which cannot be traced; use torch.where"
        ) from None
    spread = reshape(fill, (*shape[:start], *(1,) * len(mask_shape), *shape[stop:]))
    return prims.where(condition, broadcast_to(spread, shape), current)


def _elements(x: Value, where: Value) -> Value:
    """The elements of ``x`` at the flat positions ``where`` (shaped like ``where``)."""
    return prims.index(reshape(x, (numel_of(x),)), where, dims=(0,))


def as_bool(mask: Value) -> Value:
    return mask if mask.type.dtype == torch.bool else prims.ne(mask, 0)


def _setitem_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    value = scalar_for(dtype)
    cases: list[tuple[Any, Any, str]] = [
        (0, value, "int, scalar"),
        ((slice(1, 4), slice(None, None, 2)), T((3, 1, 7)), "slices, broadcast value"),
        ((Ellipsis, -1), T((1, 5, 6), torch.int64), "leading 1 dims, int64 value"),
        (slice(None), T(()), "whole tensor"),
        (([0, 3], slice(None), [1, -1]), T((2, 6)), "lists apart"),
        ((slice(None), distinct(3, 6, device)), T((5, 3, 7)), "index tensor"),
        ((None, 2, slice(0, 6, 4)), T((2, 7)), "None, int, slice"),
        (T((5, 6, 7), torch.bool), value, "mask, scalar"),
        (T((5, 6), torch.bool), T((7,)), "leading mask, row value"),
        ((Ellipsis, T((7,), torch.bool)), T(()), "trailing mask, 0-d value"),
        ((1, slice(2, 5), T((7,), torch.bool)), T((1,)), "mask after int and slice"),
    ]
    return [
        Call(materialize((T((5, 6, 7)), key, item), dtype, device), note=note)
        for key, item, note in cases
    ]


@translation(torch.Tensor.__setitem__, samples=_setitem_samples, dtypes=ALL, inplace=True)
def setitem(self: Value, key: Any, value: Any) -> Value:
    everywhere = positions(self)
    applied = apply_basic(everywhere, parse_key(key))
    if applied.masks:
        chosen, new = applied.value, _masked_update(self, applied, value)
    else:
        chosen = apply_advanced(applied.value, applied.indices)
        new = fitted(value, shape_of(chosen), self)
    if chosen is everywhere:
        return new
    count = numel_of(chosen)
    flat = reshape(self, (numel_of(self),))
    updated = prims.index_put(
        flat, reshape(new, (count,)), reshape(chosen, (count,)), dims=(0,), accumulate=False
    )
    return reshape(updated, shape_of(self))


# ---------------------------------------------------------------------------------------------
# masked_fill, masked_scatter


def _check_mask(mask: Value, op: str) -> None:
    if mask.type.dtype != torch.bool:
        raise RuntimeError(
            f"{op} only supports boolean masks, but got mask with dtype {mask.type.dtype}"
        )


def _masked_fill_samples(dtype: torch.dtype, device: torch.device) -> Sequence[Call]:
    return case_calls(
        ((T((3, 4)), T((3, 4), torch.bool), scalar_for(dtype)), {}, "scalar"),
        ((T((3, 4)), T((4,), torch.bool), T(())), {}, "broadcast mask, 0-d value"),
        ((T((2, 3)), T((2, 3), torch.bool), T((), torch.float32)), {}, "float value"),
        ((T((3, 4)), T((3, 4), torch.bool)), {"value": 1}, "value kwarg"),
    )(dtype, device)


@translation(torch.Tensor.masked_fill_, samples=_masked_fill_samples, dtypes=ALL, inplace=True)
@translation(torch.Tensor.masked_fill, torch.masked_fill, samples=_masked_fill_samples, dtypes=ALL)
def masked_fill(input: Value, mask: Value, value: Value | bool | int | float) -> Value:
    _check_mask(mask, "masked_fill_")
    if isinstance(value, Value) and value.type.rank != 0:
        raise RuntimeError(
            "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
            f"{value.type.rank} dimension(s)."
        )
    shape = broadcast_shapes(input.type.shape, mask.type.shape)
    condition = broadcast_to(mask, shape)
    fill = (
        fitted(value, shape, input)
        if isinstance(value, Value)
        else fill_scalar(value, input.type.dtype)
    )
    return prims.where(condition, fill, broadcast_to(input, shape))


@translation(
    torch.Tensor.masked_scatter_,
    samples=case_calls(((T((3, 4)), T((3, 4), torch.bool), T((12,))), {}, "")),
    dtypes=ALL,
    inplace=True,
)
@translation(
    torch.Tensor.masked_scatter,
    torch.masked_scatter,
    samples=case_calls(
        ((T((3, 4)), T((3, 4), torch.bool), T((3, 5))), {}, ""),
        ((T((3, 4)), T((4,), torch.bool), T((20,))), {}, "broadcast mask, long source"),
        ((T((0, 4)), T((0, 4), torch.bool), T((0,))), {}, "0-size"),
    ),
    dtypes=ALL,
)
def masked_scatter(input: Value, mask: Value, source: Value) -> Value:
    """Selected elements take the source's elements in order: element i of the flattened
    result takes source element ``cumsum(mask)[i] - 1``."""
    _check_mask(mask, "masked_scatter_")
    if source.type.dtype != input.type.dtype:
        raise RuntimeError(
            "masked_scatter_: expected self and source to have same dtypes but got "
            f"{input.type.dtype} and {source.type.dtype}"
        )
    shape = broadcast_shapes(input.type.shape, mask.type.shape)
    condition, base = broadcast_to(mask, shape), broadcast_to(input, shape)
    count, available = numel_of(base), numel_of(source)
    if available == 0:
        return base  # a valid call selects nothing
    order = prims.cumsum(prims.convert(reshape(condition, (count,)), dtype=torch.int64), dim=0)
    picks = prims.maximum(prims.sub(order, 1), 0)
    taken = prims.index(reshape(source, (available,)), picks, dims=(0,))
    return prims.where(condition, reshape(taken, shape), base)
