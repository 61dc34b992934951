"""Translations of indexing: ``x[key]``, ``x[key] = value`` and the indexing functions
(masked_fill, gather, scatter, index_select, index_put, index_add, take...).

``x[key]`` follows PyTorch's order: ints, slices, ``None`` and ``...`` apply first as basic
indexing (``select``/``slice``/``unsqueeze``), then the index tensors (and lists, and bool
scalars) go to one ``index`` prim, broadcast together, at the dims they index::

    x[0, :, idx]   ->  t0 = squeeze(slice(x, dim=0, start=0, stop=1), dims=(0,))
                       t1 = index(t0, idx, dims=(1,))                 # x: f32[5, 6, 7]

A bool mask tensor selects a data-dependent number of elements, which a static graph cannot
express: ``x[mask]`` raises :class:`~kiln.errors.TraceError`, while ``x[mask] = v`` (a shape-
preserving update) becomes a ``where``. ``x[key] = v`` writes through the element positions
that ``key`` selects, found by indexing an ``iota`` of ``x``'s shape with the same key, into
one ``index_put`` on the flattened ``x``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import TraceError
from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import ALL, scalar_for
from kiln.ops.translations.cases import T, case_calls, materialize
from kiln.ops.translations.common import broadcast_shapes, broadcast_to, constant, convert, full
from kiln.ops.translations.shape import reshape, shape_of, take_slice, unsqueeze_dim
from kiln.ops.translations.slicing import fill_scalar, select_index
from kiln.ops.translations.table import Call, translation

INDEX_DTYPES = (torch.int64, torch.int32)
MASK_DTYPES = (torch.bool, torch.uint8)

# ---------------------------------------------------------------------------------------------
# the index grammar


@dataclass(frozen=True)
class Mask:
    """A bool mask tensor among the index items: it consumes ``rank`` dims."""

    value: Value


Item = Any  # int, slice, None, Ellipsis, Value (int), Mask, or a tuple of constant Values


def _sequence_as_tuple(key: Sequence[Any]) -> bool:
    """PyTorch's legacy rule: a list holding slices, ``None``, ``...``, tensors or sequences
    indexes like a tuple (``x[[0, slice(None)]]``); else it is one index tensor."""
    return any(
        item is None or item is Ellipsis or isinstance(item, slice | Value | Sequence)
        for item in key
    )


def _constant_index(items: Any) -> Item:
    """A list (or nested tuple) of ints or bools as constant index tensors."""
    tensor = torch.tensor(items)
    if tensor.dtype == torch.bool:
        return tuple(constant(column) for column in tensor.nonzero().unbind(1))
    if tensor.numel() == 0:
        tensor = tensor.to(torch.int64)
    if tensor.dtype.is_floating_point:
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    return constant(tensor.to(torch.int64))


def _item(item: Any) -> Item:
    """One index item in canonical form; Python bools become constant one-element indices."""
    if item is None or item is Ellipsis or isinstance(item, slice):
        return item
    if isinstance(item, Value):
        if item.type.dtype in MASK_DTYPES:
            return Mask(item)
        if item.type.dtype not in INDEX_DTYPES:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        return item
    if isinstance(item, bool):
        return ("bool", item)
    if isinstance(item, list | tuple):
        return _constant_index(item)
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
    if item is None or item is Ellipsis or (isinstance(item, tuple) and item[0] == "bool"):
        return 0
    if isinstance(item, Mask):
        return item.value.type.rank
    if isinstance(item, tuple):  # a constant bool mask as one index per dim
        return len(item)
    return 1


def _check_count(items: Sequence[Item], rank: int) -> int:
    """The number of dims ``...`` stands for; IndexError for too many indices."""
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(_consumed(item) for item in items)
    if used > rank:
        raise IndexError(f"too many indices for tensor of dimension {rank}")
    return rank - used


# ---------------------------------------------------------------------------------------------
# applying a key


def _slice_bounds(item: slice, size: int) -> tuple[int, int, int]:
    for bound in (item.start, item.stop, item.step):
        if isinstance(bound, Value):
            raise TraceError(
                "slicing with tensor bounds needs the bounds' values, which symbolic tracing "
                "does not have; use Python ints"
            )
    if item.step is not None and operator.index(item.step) <= 0:
        raise ValueError("step must be greater than zero")
    start, stop, step = item.indices(size)
    return start, max(start, stop), step


def _bool_index(value: Value, dim: int, flag: bool) -> tuple[Value, Value]:
    """``x[True]``/``x[False]``: a new dim indexed by ``[0]`` or by nothing."""
    index = torch.zeros(1 if flag else 0, dtype=torch.int64)
    return unsqueeze_dim(value, dim), constant(index)


def _check_int(index: int, size: int, dim: int) -> None:
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {size}")


def _mask_error() -> TraceError:
    return TraceError(
        "x[mask] with a bool tensor mask selects a data-dependent number of elements, which "
        "a traced graph cannot express; use torch.where(mask, x, other) or "
        "x.masked_fill(mask, value) instead"
    )


def apply_basic(x: Value, items: Sequence[Item]) -> tuple[Value, list[tuple[int, Value]]]:
    """Apply ints, slices, ``None`` and ``...``; return the result and the advanced indices
    as ``(dim of the result, index tensor)`` pairs, in order."""
    ellipsis_dims = _check_count(items, x.type.rank)
    result, dim = x, 0
    advanced: list[tuple[int, Value]] = []
    for item in items:
        if item is None:
            result, dim = unsqueeze_dim(result, dim), dim + 1
        elif item is Ellipsis:
            dim += ellipsis_dims
        elif isinstance(item, int):
            _check_int(item, shape_of(result)[dim], dim)
            result = select_index(result, dim, item)
        elif isinstance(item, slice):
            result = take_slice(result, dim, *_slice_bounds(item, shape_of(result)[dim]))
            dim += 1
        elif isinstance(item, Mask):
            raise _mask_error()
        elif isinstance(item, tuple) and item[0] == "bool":
            result, index = _bool_index(result, dim, item[1])
            advanced.append((dim, index))
            dim += 1
        else:
            for index in item if isinstance(item, tuple) else (item,):
                advanced.append((dim, index))
                dim += 1
    return result, advanced


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
    result, advanced = apply_basic(x, items)
    return apply_advanced(result, advanced)


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
    return [
        Call(*materialize(((T((5, 6, 7)), key), {}), dtype, device), note=note)
        for key, note in keys
    ]


@translation(torch.Tensor.__getitem__, samples=_getitem_samples, dtypes=ALL, view=True)
def getitem(self: Value, key: Any) -> Value:
    return index_items(self, parse_key(key))


def positions(x: Value) -> Value:
    """The flat position of every element of ``x``, shaped like ``x`` (int64)."""
    count = int(x.type.numel())  # type: ignore[call-overload]
    flat = prims.iota(length=count, start=0, step=1, dtype=torch.int64, device=x.type.device)
    return reshape(flat, shape_of(x))


def _strip_leading_ones(value: Value, rank: int) -> Value:
    """Drop leading size-1 dims while ``value`` has more than ``rank`` dims (as copy_ does)."""
    shape = shape_of(value)
    drop = 0
    while len(shape) - drop > rank and shape[drop] == 1:
        drop += 1
    return reshape(value, shape[drop:]) if drop else value


def fitted(value: Value | bool | int | float, shape: Sequence[int], like: Value) -> Value:
    """``value`` as a tensor of ``like``'s dtype broadcast to ``shape``, as ``copy_`` does."""
    dtype, target = like.type.dtype, tuple(shape)
    if not isinstance(value, Value):
        return full(target, fill_scalar(value, dtype), dtype, like.type.device)
    value = _strip_leading_ones(convert(value, dtype), len(target))  # type: ignore[arg-type]
    source = shape_of(value)
    offset = len(target) - len(source)
    if offset < 0 or any(s not in (1, t) for s, t in zip(source, target[offset:], strict=True)):
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {list(source)} cannot be broadcast to "
            f"indexing result of shape {list(target)}"
        )
    return broadcast_to(value, target)


def _mask_position(items: Sequence[Item], rank: int) -> tuple[Mask, int]:
    """The one mask of a key made of full slices, ``...`` and a mask; the dim it starts at."""
    ellipsis_dims = _check_count(items, rank)
    masks = [item for item in items if isinstance(item, Mask)]
    full_slice = slice(None)
    others = [item for item in items if not isinstance(item, Mask)]
    if len(masks) != 1 or any(item is not Ellipsis and item != full_slice for item in others):
        raise TraceError(
            "x[key] = value with a bool mask mixed with other indices cannot be traced; "
            "use torch.where"
        )
    start = 0
    for item in items[: items.index(masks[0])]:
        start += ellipsis_dims if item is Ellipsis else 1
    return masks[0], start


def _masked_assign(self: Value, items: Sequence[Item], value: Any) -> Value:
    """``x[mask] = value`` as ``where``: each selected element takes the value, which must
    not depend on how many elements the mask selects."""
    mask, start = _mask_position(items, self.type.rank)
    shape, mask_shape = shape_of(self), shape_of(mask.value)
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
    if not isinstance(value, Value):
        return prims.where(condition, fill_scalar(value, self.type.dtype), self)
    # The selected elements form one dim of unknown length: the value must broadcast over it.
    selected = (*shape[:start], 1, *shape[stop:])
    try:
        fill = fitted(value, selected, self)
    except RuntimeError:
        raise TraceError(
            "x[mask] = values with one value per selected element depends on how many "
            "elements the mask selects, which cannot be traced; use torch.where"
        ) from None
    spread = reshape(fill, (*shape[:start], *(1,) * len(mask_shape), *shape[stop:]))
    return prims.where(condition, broadcast_to(spread, shape), self)


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
    ]
    return [
        Call(*materialize(((T((5, 6, 7)), key, item), {}), dtype, device), note=note)
        for key, item, note in cases
    ]


@translation(torch.Tensor.__setitem__, samples=_setitem_samples, dtypes=ALL, inplace=True)
def setitem(self: Value, key: Any, value: Any) -> Value:
    items = parse_key(key)
    if any(isinstance(item, Mask) for item in items):
        return _masked_assign(self, items, value)
    everywhere = positions(self)
    chosen = index_items(everywhere, items)
    if chosen is everywhere:
        return fitted(value, shape_of(self), self)
    count = int(chosen.type.numel())  # type: ignore[call-overload]
    values = fitted(value, shape_of(chosen), self)
    flat = reshape(self, (int(self.type.numel()),))  # type: ignore[call-overload]
    updated = prims.index_put(
        flat, reshape(values, (count,)), reshape(chosen, (count,)), dims=(0,), accumulate=False
    )
    return reshape(updated, shape_of(self))


# ---------------------------------------------------------------------------------------------
# masked_fill, masked_scatter


def _check_mask(mask: Value, op: str) -> None:
    if mask.type.dtype != torch.bool:
        raise RuntimeError(
            f"{op} only supports boolean masks, but got mask with dtype {mask.type.dtype}"
        )


def _masked_fill_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
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
    count, available = int(base.type.numel()), int(source.type.numel())  # type: ignore[call-overload]
    if available == 0:
        return base  # a valid call selects nothing
    order = prims.cumsum(prims.convert(reshape(condition, (count,)), dtype=torch.int64), dim=0)
    picks = prims.maximum(prims.sub(order, 1), 0)
    taken = prims.index(reshape(source, (available,)), picks, dims=(0,))
    return prims.where(condition, reshape(taken, shape), base)
