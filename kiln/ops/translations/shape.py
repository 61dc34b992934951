"""Translations of the shape views: view/reshape/flatten, permute/transpose, expand/repeat,
squeeze/unsqueeze, movedim.

Each resolves PyTorch's conveniences (varargs or tuple shapes, ``-1`` sizes, negative dims,
no-op calls) and emits at most one or two movement prims::

    x.view(-1, 4)         ->  reshape(x, shape=(3, 4))                  # x: f32[2, 6]
    x.expand(2, -1, 3)    ->  broadcast(x, shape=(2, 4, 3), dims=(1, 2)) # x: f32[4, 1]
    x.transpose(0, -1)    ->  permute(x, dims=(2, 1, 0))

The graph is functional, so a translation returns a new value; keys registered with
``view=True`` make the frontend treat the result as a view of the first argument, so in-place
updates of one write through to the other, as in eager. ``reshape`` and ``flatten`` copy in
eager only for non-contiguous inputs; they count as views here. The shared helpers at the top
(``shape_of``, ``reshape``, ``take_slice``, ``tensor_calls``) serve the sibling modules too.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym, statically
from kiln.ir.types import Dim, same_shape, same_size
from kiln.ops import prims
from kiln.ops.sampling import ALL
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.common import broadcast_to, normalize_dim, normalize_dims
from kiln.ops.translations.table import CallFn, FallbackToExtern, lookup, translation

# ---------------------------------------------------------------------------------------------
# helpers shared by the movement translations


def shape_of(value: Value) -> tuple[Dim, ...]:
    """The shape of ``value`` (symbolic sizes included: see :mod:`kiln.ir.symbolic`)."""
    return tuple(value.type.shape)


def numel_of(value: Value) -> Dim:
    return math.prod(shape_of(value))


def property_getter(name: str) -> Callable[..., Any]:
    """The callable a property read ``x.name`` reaches ``__torch_function__`` as."""
    getter: Callable[..., Any] = getattr(torch.Tensor, name).__get__
    return getter


def shape_args(args: Sequence[Any]) -> tuple[Dim, ...]:
    """A shape given as varargs (``view(2, 3)``) or as one sequence (``view((2, 3))``)."""
    if len(args) == 1 and isinstance(args[0], Sequence):
        args = args[0]
    return tuple(size if isinstance(size, Sym) else operator.index(size) for size in args)


def infer_shape(shape: Sequence[Dim], numel: Dim) -> tuple[Dim, ...]:
    """``shape`` with its one ``-1`` inferred from ``numel``; RuntimeError as in eager."""
    if sum(size == -1 for size in shape) > 1:
        raise RuntimeError("only one dimension can be inferred")
    for size in shape:
        if size < -1:
            raise RuntimeError(f"invalid shape dimension {size}")
    known = math.prod(size for size in shape if size != -1)
    result = tuple(shape)
    if -1 in shape:
        if known == 0:
            raise RuntimeError(
                f"cannot reshape tensor of {numel} elements into shape {list(shape)} because "
                "the unspecified dimension size -1 can be any value and is ambiguous"
            )
        result = tuple(numel // known if size == -1 else size for size in shape)
    if math.prod(result) != numel:
        raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}")
    return result


def reshape(value: Value, shape: Sequence[Dim]) -> Value:
    """``value`` under ``shape`` (same number of elements); no node when nothing changes."""
    if same_shape(value.type.shape, tuple(shape)):
        return value
    return prims.reshape(value, shape=tuple(shape))


def reorder(value: Value, dims: Sequence[int]) -> Value:
    if tuple(dims) == tuple(range(len(dims))):
        return value
    return prims.permute(value, dims=tuple(dims))


def slice_bound(bound: Any, size: Dim, default: Dim) -> Dim:
    """A slice bound in ``[0, size]``, counted from the end when negative, as
    ``slice.indices`` computes it (which needs an int size); ``default`` for ``None``."""
    if bound is None:
        return default
    if not isinstance(bound, Sym):
        bound = operator.index(bound)
    if bound < 0:
        bound = bound + size
        return 0 if bound < 0 else bound
    return size if bound >= size else bound


def piece_count(total: Dim, size: Dim) -> int:
    """``ceil(total / size)``, the number of pieces of ``size`` that cover ``total`` (a Python
    int: a symbolic count specializes, guarded, as the number of results depends on it)."""
    return int((total + size - 1) // size)


def take_slice(value: Value, dim: int, start: Dim, stop: Dim, step: Dim = 1) -> Value:
    """``value[..., start:stop:step, ...]`` along ``dim`` (normalized bounds)."""
    size = shape_of(value)[dim]
    stop = max(start, min(stop, size))
    # (the no-op test asks nothing of symbolic sizes: a guard here would only save a node)
    whole = same_size(start, 0) and same_size(stop, size)
    if whole and (step == 1 or statically(size - 2, "<") is True):
        return value
    return prims.slice(value, dim=dim, start=start, stop=stop, step=step)


def squeeze_dims(value: Value, dims: Sequence[int]) -> Value:
    return prims.squeeze(value, dims=tuple(dims)) if dims else value


def unsqueeze_dim(value: Value, dim: int) -> Value:
    return prims.unsqueeze(value, dims=(dim,))


def case(shape: tuple[int, ...], *args: Any, note: str = "", **kwargs: Any) -> Case:
    """A sample case calling the translated function on a random tensor of ``shape``."""
    return ((T(shape), *args), kwargs, note)


def tensor_calls(cases: Sequence[Case]) -> CallFn:
    return case_calls(*cases)


# ---------------------------------------------------------------------------------------------
# view, reshape, flatten, unflatten


_RESHAPE_CASES = [
    case((2, 6), (-1, 4), note="tuple with -1"),
    case((1,), (), note="to 0-d"),
    case((2, 1, 3), torch.Size((3, 2)), note="torch.Size"),
]


@translation(torch.reshape, samples=tensor_calls(_RESHAPE_CASES), dtypes=ALL, view=True)
@translation(
    torch.Tensor.view,
    torch.Tensor.reshape,
    samples=tensor_calls(
        [
            case((2, 6), 3, 4),
            case((2, 6), (-1, 4), note="tuple with -1"),
            case((2, 3, 4), -1, note="flatten"),
            case((), 1, 1, note="0-d to 2-d"),
            case((1,), (), note="to 0-d"),
            case((0, 4), -1, 2, note="0-size"),
            case((2, 1, 3), torch.Size((3, 2)), note="torch.Size"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def view(self: Value, *shape: Any, dtype: torch.dtype | None = None) -> Value:
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        dtype = shape[0]
    if dtype is not None:
        if dtype == self.type.dtype:
            return self
        raise FallbackToExtern  # reinterpreting bits has no prim
    return reshape(self, infer_shape(shape_args(shape), math.prod(shape_of(self))))


@translation(
    torch.Tensor.view_as,
    torch.Tensor.reshape_as,
    samples=case_calls(
        ((T((2, 6)), T((3, 4))), {}, ""),
        ((T((3,)), T((1, 3), torch.int64)), {}, "other dtype"),
    ),
    dtypes=ALL,
    view=True,
)
def view_as(self: Value, other: Value) -> Value:
    return view(self, shape_of(other))


@translation(
    torch.Tensor.flatten,
    torch.flatten,
    samples=tensor_calls(
        [
            case((2, 3, 4)),
            case((2, 3, 4), 1),
            case((2, 3, 4, 5), start_dim=1, end_dim=-2, note="kwargs"),
            case((), note="0-d"),
            case((3, 0, 2), 0, 1, note="0-size"),
            case((2, 3), 1, 1, note="one dim"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def flatten(input: Value, start_dim: int = 0, end_dim: int = -1) -> Value:
    shape = shape_of(input)
    if not shape:
        return reshape(input, (1,))
    start = normalize_dim(start_dim, len(shape), "flatten")
    end = normalize_dim(end_dim, len(shape), "flatten")
    if start > end:
        raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
    merged = math.prod(shape[start : end + 1])
    return reshape(input, (*shape[:start], merged, *shape[end + 1 :]))


@translation(
    torch.Tensor.unflatten,
    torch.unflatten,
    samples=tensor_calls(
        [
            case((2, 12), 1, (3, 4)),
            case((2, 12), -1, (2, -1, 3), note="-1 and negative dim"),
            case((6,), 0, [6], note="one size"),
            case((0, 4), 0, (0, 5), note="0-size"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def unflatten(input: Value, dim: int, sizes: Sequence[int]) -> Value:
    shape = shape_of(input)
    dim = normalize_dim(dim, len(shape), "unflatten")
    requested = shape_args((sizes,))
    if not requested:
        raise RuntimeError("unflatten: sizes must be non-empty")
    try:
        split = infer_shape(requested, shape[dim])
    except RuntimeError:
        raise RuntimeError(
            f"unflatten: Provided sizes {list(requested)} don't multiply up to the size of dim "
            f"{dim} ({shape[dim]}) in the input tensor"
        ) from None
    return reshape(input, (*shape[:dim], *split, *shape[dim + 1 :]))


# ---------------------------------------------------------------------------------------------
# permute, transpose, t, T, mT, movedim, contiguous


_PERMUTE_CASES = [
    case((2, 3, 4), (-1, 0, 1), note="tuple, negative dim"),
    case((), (), note="0-d"),
    case((0, 3), [1, 0], note="0-size"),
]


@translation(torch.permute, samples=tensor_calls(_PERMUTE_CASES), dtypes=ALL, view=True)
@translation(
    torch.Tensor.permute,
    samples=tensor_calls([*_PERMUTE_CASES, case((2, 3, 4), 2, 0, 1, note="varargs")]),
    dtypes=ALL,
    view=True,
)
def permute(input: Value, *dims: Any) -> Value:
    rank = input.type.rank
    # (dims are positions, not sizes: shape_args only flattens the varargs)
    order = [normalize_dim(cast(int, d), rank, "permute") for d in shape_args(dims)]
    if len(order) != rank:
        raise RuntimeError(
            f"permute(sparse_coo): number of dimensions in the tensor input does not match the "
            f"length of the desired ordering of dimensions i.e. input.dim() = {rank} is not "
            f"equal to len(dims) = {len(order)}"
        )
    if len(set(order)) != rank:
        raise RuntimeError("permute(): duplicate dims are not allowed.")
    return reorder(input, order)


def swap(value: Value, dim0: int, dim1: int, op: str = "transpose") -> Value:
    """``value`` with two dims exchanged (negative dims allowed)."""
    rank = value.type.rank
    first, second = normalize_dim(dim0, rank, op), normalize_dim(dim1, rank, op)
    order = list(range(rank))
    if rank:
        order[first], order[second] = second, first
    return reorder(value, order)


@translation(
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.swapaxes,
    torch.swapaxes,
    torch.Tensor.swapdims,
    torch.swapdims,
    samples=tensor_calls(
        [
            case((2, 3, 4), 0, 2),
            case((2, 3, 4), -1, 1, note="negative dim"),
            case((3, 4), 1, 1, note="same dim"),
            case((), 0, -1, note="0-d"),
            case((0, 3), 0, 1, note="0-size"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def transpose(input: Value, dim0: int, dim1: int) -> Value:
    return swap(input, dim0, dim1)


_MATRIX_CASES = [case((3, 4)), case((), note="0-d"), case((0, 2), note="0-size")]


@translation(
    torch.Tensor.t,
    torch.t,
    samples=tensor_calls([*_MATRIX_CASES, case((3,), note="1-d")]),
    dtypes=ALL,
    view=True,
)
def t(input: Value) -> Value:
    if input.type.rank > 2:
        raise RuntimeError(
            f"t() expects a tensor with <= 2 dimensions, but self is {input.type.rank}D"
        )
    return swap(input, 0, -1)


@translation(
    property_getter("T"),
    samples=tensor_calls([*_MATRIX_CASES, case((3,), note="1-d"), case((2, 3, 4), note="3-d")]),
    dtypes=ALL,
    view=True,
)
def reversed_dims(input: Value) -> Value:
    return reorder(input, tuple(reversed(range(input.type.rank))))


@translation(
    property_getter("mT"),
    property_getter("mH"),
    torch.Tensor.adjoint,
    torch.adjoint,
    samples=tensor_calls([case((3, 4)), case((2, 3, 4), note="batch"), case((2, 0, 3))]),
    dtypes=ALL,
    view=True,
)
def matrix_transpose(input: Value) -> Value:
    if input.type.rank < 2:
        raise RuntimeError(
            "tensor.mT is only supported on matrices or batches of matrices. "
            f"Got {input.type.rank}-D tensor."
        )
    return swap(input, -2, -1)


@translation(
    property_getter("H"),
    samples=tensor_calls(_MATRIX_CASES),
    dtypes=ALL,
    view=True,
)
def conjugate_transpose(input: Value) -> Value:
    # Kiln's dtypes are real, so the conjugate is the identity.
    if input.type.rank not in (0, 2):
        raise RuntimeError(
            f"tensor.H is only supported on matrices (2-D tensors). Got {input.type.rank}-D tensor."
        )
    return swap(input, 0, -1)


def _dim_list(dims: int | Sequence[int], rank: int) -> list[int]:
    items = [dims] if isinstance(dims, int) else list(dims)
    return [normalize_dim(d, rank, "movedim") for d in items]


@translation(
    torch.Tensor.movedim,
    torch.movedim,
    torch.Tensor.moveaxis,
    torch.moveaxis,
    samples=tensor_calls(
        [
            case((2, 3, 4), 0, -1),
            case((2, 3, 4, 5), (0, 1), (3, 0), note="tuples"),
            case((2, 3), 1, 1, note="no move"),
            case((), 0, 0, note="0-d"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def movedim(input: Value, source: int | Sequence[int], destination: int | Sequence[int]) -> Value:
    rank = input.type.rank
    sources, targets = _dim_list(source, rank), _dim_list(destination, rank)
    if len(sources) != len(targets):
        raise RuntimeError(
            f"movedim: Invalid source or destination dims: source ({sources} dims) should "
            f"contain the same number of dims as destination ({targets} dims)"
        )
    if len(set(sources)) != len(sources) or len(set(targets)) != len(targets):
        raise RuntimeError("movedim: repeated dim in source or destination")
    order: list[int | None] = [None] * max(rank, 1)
    for src, dst in zip(sources, targets, strict=True):
        order[dst] = src
    rest = iter(d for d in range(rank) if d not in sources)
    return reorder(input, [next(rest) if d is None else d for d in order][:rank])


def _register_contiguous() -> None:
    """``contiguous`` is the identity on a functional graph; another module may translate it."""
    if lookup(torch.Tensor.contiguous) is not None:
        return
    translation(
        torch.Tensor.contiguous,
        samples=tensor_calls([case((2, 3)), case((2, 3), memory_format=torch.contiguous_format)]),
        dtypes=ALL,
        view=True,
    )(contiguous)


def contiguous(self: Value, memory_format: torch.memory_format | None = None) -> Value:
    return self


_register_contiguous()


# ---------------------------------------------------------------------------------------------
# expand, broadcast_to, repeat, tile


def expanded_shape(shape: Sequence[Dim], requested: Sequence[Dim]) -> tuple[Dim, ...]:
    """The target of ``expand``: ``-1`` keeps a size, new dims lead; RuntimeError as in eager."""
    if len(requested) < len(shape):
        raise RuntimeError(
            f"expand: the number of sizes provided ({len(requested)}) must be greater or equal "
            f"to the number of dimensions in the tensor ({len(shape)})"
        )
    offset = len(requested) - len(shape)
    result = []
    for dim, size in enumerate(requested):
        old = shape[dim - offset] if dim >= offset else None
        if size == -1 and old is None:
            raise RuntimeError(
                f"The expanded size of the tensor (-1) isn't allowed in a leading, non-existing "
                f"dimension {dim}"
            )
        target = old if size == -1 else size
        if old is not None and old not in (1, target):
            raise RuntimeError(
                f"The expanded size of the tensor ({target}) must match the existing size "
                f"({old}) at non-singleton dimension {dim}.  Target sizes: {list(requested)}.  "
                f"Tensor sizes: {list(shape)}"
            )
        result.append(target)
    return tuple(result)  # type: ignore[arg-type]


_EXPAND_CASES = [
    case((4, 1), (2, -1, 3), note="tuple, new dim, -1"),
    case((), (2, 3), note="0-d"),
    case((1, 1), (2, 0), note="size 1 to 0"),
    case((2, 3), (-1, -1), note="no-op"),
]


@translation(
    torch.Tensor.broadcast_to,
    torch.broadcast_to,
    samples=tensor_calls(_EXPAND_CASES),
    dtypes=ALL,
    view=True,
)
@translation(
    torch.Tensor.expand,
    samples=tensor_calls([*_EXPAND_CASES, case((3, 1), 3, 4, note="varargs")]),
    dtypes=ALL,
    view=True,
)
def expand(self: Value, *size: Any, implicit: bool = False) -> Value:
    return broadcast_to(self, expanded_shape(shape_of(self), shape_args(size)))


@translation(
    torch.Tensor.expand_as,
    samples=case_calls(((T((3, 1)), T((2, 3, 4), torch.int64)), {}, "")),
    dtypes=ALL,
    view=True,
)
def expand_as(self: Value, other: Value) -> Value:
    return expand(self, shape_of(other))


def repeated(value: Value, repeats: Sequence[Dim]) -> Value:
    """``value`` repeated ``repeats[i]`` times along dim i (leading repeats add dims)."""
    if any(r < 0 for r in repeats):
        raise RuntimeError(f"Trying to create tensor with negative dimension: {list(repeats)}")
    shape = shape_of(value)
    if len(repeats) < len(shape):
        raise RuntimeError(
            "Number of dimensions of repeat dims can not be smaller than number of dimensions "
            "of tensor"
        )
    shape = (1,) * (len(repeats) - len(shape)) + shape
    # Interleave (r0, s0, r1, s1, ...) by broadcasting, then merge each pair.
    interleaved = tuple(n for pair in zip(repeats, shape, strict=True) for n in pair)
    odd = tuple(range(1, len(interleaved), 2))
    spread = prims.broadcast(reshape(value, shape), shape=interleaved, dims=odd)
    return reshape(spread, [r * s for r, s in zip(repeats, shape, strict=True)])


@translation(
    torch.Tensor.repeat,
    samples=tensor_calls(
        [
            case((2, 3), 2, 1),
            case((2, 3), (2, 1, 3), note="tuple, new dim"),
            case((), 3, note="0-d"),
            case((2, 3), 0, 2, note="zero repeats"),
        ]
    ),
    dtypes=ALL,
)
def repeat(self: Value, *repeats: Any) -> Value:
    return repeated(self, shape_args(repeats))


@translation(
    torch.Tensor.tile,
    torch.tile,
    samples=tensor_calls(
        [case((2, 3), (2,)), case((2, 3), (2, 1, 2), note="new dim"), case((), (3,), note="0-d")]
    ),
    dtypes=ALL,
)
def tile(input: Value, *dims: Any) -> Value:
    repeats = shape_args(dims)
    ones: tuple[Dim, ...] = (1,) * (input.type.rank - len(repeats))
    return repeated(input, ones + repeats)


# ---------------------------------------------------------------------------------------------
# squeeze, unsqueeze


@translation(
    torch.Tensor.squeeze,
    torch.squeeze,
    samples=tensor_calls(
        [
            case((1, 3, 1)),
            case((1, 3, 1), -1, note="one dim"),
            case((1, 3, 1), 1, note="not size 1: no-op"),
            case((1, 3, 1), (0, 1, 2), note="tuple"),
            case((), 0, note="0-d"),
            case((1, 0), note="0-size"),
        ]
    ),
    dtypes=ALL,
    view=True,
)
def squeeze(input: Value, dim: int | Sequence[int] | None = None) -> Value:
    shape = shape_of(input)
    dims = normalize_dims(dim, len(shape), "squeeze")
    return squeeze_dims(input, [d for d in dims if d < len(shape) and shape[d] == 1])


@translation(
    torch.Tensor.unsqueeze,
    torch.unsqueeze,
    samples=tensor_calls(
        [case((3, 4), 0), case((3, 4), -1, note="last"), case((), 0, note="0-d"), case((0,), 1)]
    ),
    dtypes=ALL,
    view=True,
)
def unsqueeze(input: Value, dim: int) -> Value:
    return unsqueeze_dim(input, normalize_dim(dim, input.type.rank + 1, "unsqueeze"))
