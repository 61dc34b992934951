"""Registry rows of the movement prims: reshape, permute, broadcast, expand, slice, squeeze,
unsqueeze, cat, pad and flip.

Movement prims rearrange elements without computing on them, so they take every dtype. Like
the elementwise prims they are strict and canonical: dims are non-negative, shapes are explicit
(no ``-1``), slices are normalized, operands of ``cat`` share one dtype. Translations own
PyTorch's conveniences. Their meta raises what eager PyTorch raises for the same mistake:
``IndexError`` for a dim out of range, ``RuntimeError`` for sizes that do not fit, ``TypeError``
for dtypes, ``ValueError`` for a malformed attribute.

The size checks go through :func:`sizes_differ`, which only rejects sizes *known* to differ, so
a symbolic dim passes here and is left to a guard. The shared checks are public because
``kiln.ops.indexing`` uses them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.op import Op, OpDef, Sample, Tag, register
from kiln.ir.types import Dim, Scalar, Shape, TensorType
from kiln.ops import prims
from kiln.ops.attrs import (
    BroadcastAttrs,
    CatAttrs,
    ExpandAttrs,
    FlipAttrs,
    PadAttrs,
    PermuteAttrs,
    ReshapeAttrs,
    SliceAttrs,
    SqueezeAttrs,
    UnsqueezeAttrs,
)
from kiln.ops.sampling import ALL, make_tensor, scalar_for

# ---------------------------------------------------------------------------------------------
# checks shared with kiln.ops.indexing


def tensor_operand(op: Op, operand: object, what: str = "x") -> TensorType:
    """``operand`` as a tensor type, or a TypeError naming the op and the operand."""
    if not isinstance(operand, TensorType):
        raise TypeError(f"{op.printed_name}: {what} must be a tensor, got {operand!r}")
    return operand


def same_device(op: Op, tensors: Sequence[TensorType]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise RuntimeError(
            f"{op.printed_name}: operands on several devices {sorted(map(str, devices))}"
        )


def check_dim(op: Op, dim: int, rank: int, *, scalar_ok: bool = False) -> None:
    """A dim must be in ``[0, rank)``; ``scalar_ok`` lets dim 0 name a 0-d tensor, as in torch."""
    count = max(rank, 1) if scalar_ok else rank
    if count == 0:
        raise IndexError(f"{op.printed_name}: Dimension out of range (a 0-d tensor, dim {dim})")
    if not 0 <= dim < count:
        raise IndexError(
            f"{op.printed_name}: Dimension out of range (expected to be in range of "
            f"[0, {count - 1}], but got {dim})"
        )


def check_dims(op: Op, dims: Sequence[int], rank: int, *, increasing: bool = False) -> None:
    """Each dim in range and named once; ``increasing`` also demands sorted order."""
    for dim in dims:
        check_dim(op, dim, rank)
    if len(set(dims)) != len(dims):
        raise RuntimeError(f"{op.printed_name}: a dim appears more than once in {tuple(dims)}")
    if increasing and list(dims) != sorted(dims):
        raise RuntimeError(f"{op.printed_name}: dims {tuple(dims)} must be increasing")


def sizes_differ(a: Dim, b: Dim) -> bool:
    """Whether two sizes differ (for symbolic sizes: at the captured sizes, guarded)."""
    return bool(a != b)


def shapes_differ(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    return len(a) != len(b) or any(sizes_differ(x, y) for x, y in zip(a, b, strict=True))


def add_sizes(*sizes: Dim) -> Dim:
    """The sum of sizes; symbolic when any term is."""
    total: Dim = 0
    for size in sizes:
        total = total + size
    return total


def result(x: TensorType, shape: Sequence[Dim]) -> TensorType:
    """An output of ``x``'s dtype and device; the builder decides requires_grad."""
    return x.with_(shape=tuple(shape), requires_grad=False)


def shape_text(shape: Sequence[Dim]) -> str:
    return str(list(shape))


def concrete(shape: Shape) -> tuple[int, ...]:
    """The int sizes of an attribute shape, for an impl: tensors have no symbolic sizes."""
    sizes = tuple(size for size in shape if isinstance(size, int))
    if len(sizes) != len(shape):
        raise TypeError(f"shape {shape_text(shape)} is symbolic; specialize it before running")
    return sizes


# ---------------------------------------------------------------------------------------------
# row and sample factories

# A sample case: operand shapes, attributes, note.
Case = tuple[tuple[tuple[int, ...], ...], Any, str]


def case_samples(cases: Sequence[Case]) -> Callable[[torch.dtype, torch.device], list[Sample]]:
    """Samples with fresh random operands of the dtype under test, one per case."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
        return [
            Sample(tuple(make_tensor(shape, dtype, device) for shape in shapes), attrs, note)
            for shapes, attrs, note in cases
        ]

    return samples


def movement(
    op: Op,
    attrs: type,
    meta: Callable[..., TensorType],
    impl: Callable[..., torch.Tensor],
    samples: Callable[[torch.dtype, torch.device], Sequence[Sample]],
    doc: str,
    tag: Tag = Tag.MOVEMENT,
    vjp: Callable[..., Any] | None = None,
) -> OpDef:
    """Register a movement or indexing prim that takes every dtype."""
    return register(
        OpDef(
            op,
            meta=meta,
            impl=impl,
            attrs=attrs,
            tags=frozenset({tag}),
            dtypes=ALL,
            samples=samples,
            vjp=vjp,
            doc=doc,
        )
    )


# VJP rules: vjp(attrs, inputs, outputs, grads) -> one gradient per input, in prims. Movement
# is linear, so each rule moves the cotangent back (and sums where elements were repeated).
# These ops have one output, so its cotangent is never None (vjp_of skips a node without any).
Grads = tuple[Value | None, ...]
Cotangents = Sequence[Value]


def input_gradient(rule: Callable[[Any, Value, Value], Value]) -> Callable[..., Grads]:
    """The VJP of a one-input, one-output op whose input gradient is ``rule(attrs, x, g)``::

    vjp=input_gradient(lambda attrs, x, g: prims.flip(g, dims=attrs.dims))
    """
    return lambda attrs, inputs, outputs, grads: (rule(attrs, inputs[0], grads[0]),)


def _unbroadcast(g: Value, x: TensorType, dims: Sequence[int]) -> Value:
    """The cotangent of ``x`` broadcast to ``g``'s shape, input dim i at output dim ``dims[i]``:
    ``g`` summed over the new dims and the size-1 dims that grew, in ``x``'s shape."""
    grown = tuple(
        i
        for i, (size, out) in enumerate(zip(x.shape, dims, strict=True))
        if size == 1 and g.type.shape[out] != 1
    )
    summed = {d for d in range(g.type.rank) if d not in dims} | {dims[i] for i in grown}
    if summed:
        g = prims.sum(g, dims=tuple(sorted(summed)))
    return prims.unsqueeze(g, dims=grown) if grown else g


# ---------------------------------------------------------------------------------------------
# reshape, permute, broadcast, expand


def _reshape_meta(attrs: ReshapeAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.RESHAPE, x)
    if any(size < 0 for size in attrs.shape):
        raise ValueError(f"reshape: sizes must be non-negative, got {shape_text(attrs.shape)}")
    old, new = x.numel(), result(x, attrs.shape).numel()
    if sizes_differ(old, new):
        raise RuntimeError(
            f"reshape: shape {shape_text(attrs.shape)} is invalid for input of size {old}"
        )
    return result(x, attrs.shape)


movement(
    Op.RESHAPE,
    ReshapeAttrs,
    _reshape_meta,
    lambda attrs, x: torch.reshape(x, concrete(attrs.shape)),
    case_samples(
        [
            (((3, 4),), ReshapeAttrs((2, 6)), ""),
            (((3, 4),), ReshapeAttrs((12,)), "flatten"),
            (((2, 1, 3),), ReshapeAttrs((3, 1, 2)), "size-1 dims"),
            (((),), ReshapeAttrs((1, 1)), "0-d to 2-d"),
            (((1,),), ReshapeAttrs(()), "to 0-d"),
            (((0, 4),), ReshapeAttrs((2, 0, 3)), "0-size"),
        ]
    ),
    "reshape(x, shape): the same elements in row-major order under a new shape",
    vjp=input_gradient(lambda attrs, x, g: prims.reshape(g, shape=x.type.shape)),
)


def _permute_meta(attrs: PermuteAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.PERMUTE, x)
    check_dims(Op.PERMUTE, attrs.dims, x.rank)
    if len(attrs.dims) != x.rank:
        raise RuntimeError(f"permute: {len(attrs.dims)} dims for a {x.rank}-d tensor")
    return result(x, [x.shape[d] for d in attrs.dims])


def _permute_vjp(
    attrs: PermuteAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents
) -> Grads:
    (g,) = grads
    inverse = [0] * len(attrs.dims)
    for position, dim in enumerate(attrs.dims):
        inverse[dim] = position
    return (prims.permute(g, dims=tuple(inverse)),)


movement(
    Op.PERMUTE,
    PermuteAttrs,
    _permute_meta,
    lambda attrs, x: torch.permute(x, attrs.dims),
    case_samples(
        [
            (((2, 3, 4),), PermuteAttrs((2, 0, 1)), ""),
            (((3, 5),), PermuteAttrs((1, 0)), "transpose"),
            (((),), PermuteAttrs(()), "0-d"),
            (((0, 3),), PermuteAttrs((1, 0)), "0-size"),
            (((2, 1, 3),), PermuteAttrs((1, 2, 0)), "size-1 dim"),
        ]
    ),
    "permute(x, dims): output dim i is input dim dims[i]",
    vjp=_permute_vjp,
)


def _check_growth(op: Op, size: Dim, target: Dim, dim: int) -> None:
    """A size broadcasts to ``target`` when it equals it or is 1."""
    if sizes_differ(size, 1) and sizes_differ(size, target):
        raise RuntimeError(
            f"{op.printed_name}: size {size} of input dim {dim} cannot broadcast to {target}"
        )


def _broadcast_meta(attrs: BroadcastAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.BROADCAST, x)
    if len(attrs.dims) != x.rank:
        raise RuntimeError(f"broadcast: {len(attrs.dims)} dims for a {x.rank}-d tensor")
    check_dims(Op.BROADCAST, attrs.dims, len(attrs.shape), increasing=True)
    for dim, (size, out) in enumerate(zip(x.shape, attrs.dims, strict=True)):
        _check_growth(Op.BROADCAST, size, attrs.shape[out], dim)
    return result(x, attrs.shape)


def _broadcast_impl(attrs: BroadcastAttrs, x: torch.Tensor) -> torch.Tensor:
    view = [1] * len(attrs.shape)
    for size, out in zip(x.shape, attrs.dims, strict=True):
        view[out] = size
    return x.reshape(view).expand(concrete(attrs.shape))


movement(
    Op.BROADCAST,
    BroadcastAttrs,
    _broadcast_meta,
    _broadcast_impl,
    case_samples(
        [
            (((3,),), BroadcastAttrs((2, 3), (1,)), "new leading dim"),
            (((1, 4),), BroadcastAttrs((3, 2, 4), (0, 2)), "size 1 grows, new middle dim"),
            (((),), BroadcastAttrs((2, 3), ()), "0-d"),
            (((3, 1),), BroadcastAttrs((3, 0), (0, 1)), "size 1 to 0"),
            (((0,),), BroadcastAttrs((2, 0), (1,)), "0-size"),
        ]
    ),
    "broadcast(x, shape, dims): broadcast_in_dim; input dim i becomes output dim dims[i]",
    vjp=input_gradient(lambda attrs, x, g: _unbroadcast(g, x.type, attrs.dims)),
)


def _expand_meta(attrs: ExpandAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.EXPAND, x)
    if len(attrs.shape) != x.rank:
        raise RuntimeError(
            f"expand: shape {shape_text(attrs.shape)} has not the rank of the {x.rank}-d input"
        )
    for dim, (size, target) in enumerate(zip(x.shape, attrs.shape, strict=True)):
        _check_growth(Op.EXPAND, size, target, dim)
    return result(x, attrs.shape)


movement(
    Op.EXPAND,
    ExpandAttrs,
    _expand_meta,
    lambda attrs, x: x.expand(concrete(attrs.shape)),
    case_samples(
        [
            (((3, 1),), ExpandAttrs((3, 4)), ""),
            (((1, 1),), ExpandAttrs((2, 0)), "size 1 to 0"),
            (((),), ExpandAttrs(()), "0-d"),
            (((0, 1),), ExpandAttrs((0, 5)), "0-size"),
            (((2, 1, 3),), ExpandAttrs((2, 4, 3)), "middle dim"),
        ]
    ),
    "expand(x, shape): size-1 dims grow to shape (same rank)",
    vjp=input_gradient(lambda attrs, x, g: _unbroadcast(g, x.type, range(x.type.rank))),
)


# ---------------------------------------------------------------------------------------------
# slice, squeeze, unsqueeze


def _slice_meta(attrs: SliceAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.SLICE, x)
    check_dim(Op.SLICE, attrs.dim, x.rank)
    size = x.shape[attrs.dim]
    if attrs.step < 1 or not 0 <= attrs.start <= attrs.stop <= size:
        raise ValueError(
            f"slice: {attrs.start!r}:{attrs.stop!r}:{attrs.step} of a dim of size {size!r} is "
            "not normalized (needs 0 <= start <= stop <= size and step >= 1)"
        )
    shape = list(x.shape)
    shape[attrs.dim] = (attrs.stop - attrs.start + attrs.step - 1) // attrs.step
    return result(x, shape)


def _slice_impl(attrs: SliceAttrs, x: torch.Tensor) -> torch.Tensor:
    return x[(slice(None),) * attrs.dim + (slice(attrs.start, attrs.stop, attrs.step),)]


def _slice_vjp(attrs: SliceAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents) -> Grads:
    """Zeros with the cotangent at the sliced positions: one pad places it, ``step - 1`` zeros
    between neighbours (its lowering divides the index: no gather)."""
    (x,) = inputs
    (g,) = grads
    dim, step, rank = attrs.dim, attrs.step, x.type.rank
    size, count = x.type.shape[dim], g.type.shape[dim]
    interior = tuple(step - 1 if d == dim else 0 for d in range(rank)) if step > 1 else ()
    low = tuple(attrs.start if d == dim else 0 for d in range(rank))
    high = tuple(
        size - attrs.start - spread(count, step - 1) if d == dim else 0 for d in range(rank)
    )
    return (prims.pad(g, low=low, high=high, value=0, interior=interior),)


movement(
    Op.SLICE,
    SliceAttrs,
    _slice_meta,
    _slice_impl,
    case_samples(
        [
            (((6, 4),), SliceAttrs(0, 1, 5, 2), "step 2"),
            (((6, 4),), SliceAttrs(1, 0, 4, 3), "step 3, last dim"),
            (((6, 4),), SliceAttrs(0, 2, 2), "empty"),
            (((5,),), SliceAttrs(0, 1, 5, 7), "step past the end"),
            (((5,),), SliceAttrs(0, 0, 5), "whole dim"),
            (((0, 3),), SliceAttrs(0, 0, 0), "0-size"),
            (((2, 1, 3),), SliceAttrs(1, 0, 1), "size-1 dim"),
        ]
    ),
    "slice(x, dim, start, stop, step): x[..., start:stop:step, ...] along dim",
    vjp=_slice_vjp,
)


def _squeeze_meta(attrs: SqueezeAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.SQUEEZE, x)
    check_dims(Op.SQUEEZE, attrs.dims, x.rank)
    for dim in attrs.dims:
        if sizes_differ(x.shape[dim], 1):
            raise RuntimeError(f"squeeze: dim {dim} has size {x.shape[dim]}, not 1")
    return result(x, [size for dim, size in enumerate(x.shape) if dim not in attrs.dims])


movement(
    Op.SQUEEZE,
    SqueezeAttrs,
    _squeeze_meta,
    lambda attrs, x: torch.squeeze(x, attrs.dims),
    case_samples(
        [
            (((1, 3, 1),), SqueezeAttrs((0, 2)), ""),
            (((1,),), SqueezeAttrs((0,)), "to 0-d"),
            (((2, 1, 3),), SqueezeAttrs((1,)), "middle dim"),
            (((0, 1),), SqueezeAttrs((1,)), "0-size"),
            (((3, 4),), SqueezeAttrs(()), "no dims"),
        ]
    ),
    "squeeze(x, dims): remove dims, each of size 1",
    vjp=input_gradient(
        lambda attrs, x, g: prims.unsqueeze(g, dims=tuple(sorted(attrs.dims))) if attrs.dims else g
    ),
)


def _unsqueeze_meta(attrs: UnsqueezeAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.UNSQUEEZE, x)
    rank = x.rank + len(attrs.dims)
    check_dims(Op.UNSQUEEZE, attrs.dims, rank, increasing=True)
    sizes = iter(x.shape)
    return result(x, [1 if dim in attrs.dims else next(sizes) for dim in range(rank)])


def _unsqueeze_impl(attrs: UnsqueezeAttrs, x: torch.Tensor) -> torch.Tensor:
    for dim in attrs.dims:  # increasing, so each position is already final
        x = x.unsqueeze(dim)
    return x


movement(
    Op.UNSQUEEZE,
    UnsqueezeAttrs,
    _unsqueeze_meta,
    _unsqueeze_impl,
    case_samples(
        [
            (((3, 4),), UnsqueezeAttrs((0,)), ""),
            (((3, 4),), UnsqueezeAttrs((0, 3)), "first and last"),
            (((),), UnsqueezeAttrs((0, 1)), "0-d"),
            (((0, 2),), UnsqueezeAttrs((1,)), "0-size"),
            (((2, 1),), UnsqueezeAttrs((2,)), "after a size-1 dim"),
        ]
    ),
    "unsqueeze(x, dims): insert size-1 dims at dims (positions in the output)",
    vjp=input_gradient(lambda attrs, x, g: prims.squeeze(g, dims=attrs.dims) if attrs.dims else g),
)


# ---------------------------------------------------------------------------------------------
# cat, pad, flip


def _cat_meta(attrs: CatAttrs, *operands: TensorType) -> TensorType:
    if not operands:
        raise ValueError("cat: expected a non-empty list of tensors")
    tensors = [tensor_operand(Op.CAT, o, f"operand {i}") for i, o in enumerate(operands)]
    first = tensors[0]
    if first.rank == 0:
        raise RuntimeError("cat: zero-dimensional tensors cannot be concatenated")
    check_dim(Op.CAT, attrs.dim, first.rank)
    same_device(Op.CAT, tensors)
    for index, other in enumerate(tensors[1:], start=1):
        if other.dtype != first.dtype:
            raise TypeError(
                f"cat: operand {index} is {other.dtype}, operand 0 is {first.dtype} "
                "(prims do not promote)"
            )
        outside = [s for d, s in enumerate(other.shape) if d != attrs.dim]
        if other.rank != first.rank or shapes_differ(
            outside, [s for d, s in enumerate(first.shape) if d != attrs.dim]
        ):
            raise RuntimeError(
                f"cat: operand {index} of shape {shape_text(other.shape)} does not fit operand "
                f"0 of shape {shape_text(first.shape)} outside dim {attrs.dim}"
            )
    shape = list(first.shape)
    shape[attrs.dim] = add_sizes(*(t.shape[attrs.dim] for t in tensors))
    return result(first, shape)


def _cat_vjp(attrs: CatAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents) -> Grads:
    """Each operand's part of the cotangent, sliced out along ``dim``."""
    (g,) = grads
    if len(inputs) == 1:
        return (g,)
    parts: list[Value | None] = []
    start = 0
    for x in inputs:
        stop = start + x.type.shape[attrs.dim]
        parts.append(prims.slice(g, dim=attrs.dim, start=start, stop=stop))
        start = stop
    return tuple(parts)


movement(
    Op.CAT,
    CatAttrs,
    _cat_meta,
    lambda attrs, *xs: torch.cat(xs, attrs.dim),
    case_samples(
        [
            (((2, 3), (4, 3)), CatAttrs(0), ""),
            (((2, 3), (2, 0), (2, 5)), CatAttrs(1), "three, one 0-size"),
            (((3,),), CatAttrs(0), "one operand"),
            (((0, 2), (0, 2)), CatAttrs(0), "all 0-size"),
            (((1, 2, 3), (1, 4, 3)), CatAttrs(1), "size-1 dims"),
        ]
    ),
    "cat(*xs, dim): concatenate along dim; shapes agree elsewhere",
    vjp=_cat_vjp,
)


def _check_pad_value(value: Scalar, dtype: torch.dtype) -> None:
    if isinstance(value, float) and not dtype.is_floating_point:
        raise TypeError(f"pad: float value {value} for a {dtype} tensor")
    if not isinstance(value, bool | int | float):
        raise TypeError(f"pad: value must be a Python scalar, got {value!r}")


def _pad_meta(attrs: PadAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.PAD, x)
    interior = attrs.interior or (0,) * x.rank
    if len(attrs.low) != x.rank or len(attrs.high) != x.rank or len(interior) != x.rank:
        raise RuntimeError(
            f"pad: low {attrs.low}, high {attrs.high} and interior {attrs.interior} need one "
            f"entry per dim of the {x.rank}-d input"
        )
    if any(amount < 0 for amount in interior):
        raise RuntimeError(f"pad: interior {attrs.interior} must not be negative")
    _check_pad_value(attrs.value, x.dtype)
    shape = [
        add_sizes(lo, spread(s, k), hi)
        for lo, s, k, hi in zip(attrs.low, x.shape, interior, attrs.high, strict=True)
    ]
    for dim, size in enumerate(shape):
        if size < 0:
            raise RuntimeError(f"pad: dim {dim} of size {x.shape[dim]} crops to {size} elements")
    return result(x, shape)


def spread(size: Dim, interior: int) -> Dim:
    """The size of a dim of ``size`` elements with ``interior`` more between neighbours."""
    if interior == 0:
        return size
    if isinstance(size, int):
        return size + max(size - 1, 0) * interior
    return size * (interior + 1) - interior  # (a symbolic size is at least 1)


def _pad_impl(attrs: PadAttrs, x: torch.Tensor) -> torch.Tensor:
    if any(attrs.interior):
        shape = [spread(s, k) for s, k in zip(x.shape, attrs.interior, strict=True)]
        spaced = x.new_full(concrete(tuple(shape)), attrs.value)
        spaced[tuple(slice(None, None, k + 1) for k in attrs.interior)] = x
        x = spaced
    # F.pad takes (low, high) pairs starting from the last dim.
    pairs = [(lo, hi) for lo, hi in zip(attrs.low, attrs.high, strict=True)]
    flat = list(concrete(tuple(amount for pair in reversed(pairs) for amount in pair)))
    return F.pad(x, flat, mode="constant", value=attrs.value)


PAD_CASES: tuple[
    tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], str], ...
] = (
    ((3, 4), (1, 0), (2, 1), (), ""),
    ((3, 4), (-1, 1), (0, -2), (), "negative pads crop"),
    ((3, 4), (0, -2), (0, -2), (), "crop to 0-size"),
    ((), (), (), (), "0-d"),
    ((0, 4), (1, 0), (1, 0), (), "0-size grows"),
    ((2, 1, 3), (0, 2, 0), (0, 0, 1), (), "size-1 dim"),
    ((3, 4), (1, 0), (0, 2), (1, 2), "interior"),
    ((3, 4), (-1, 2), (0, -1), (2, 0), "interior, cropped"),
    ((0, 1, 2), (1, 0, 0), (0, 1, 0), (3, 3, 1), "interior of 0- and 1-size dims"),
)


def _pad_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    value = scalar_for(dtype)
    return [
        Sample((make_tensor(shape, dtype, device),), PadAttrs(low, high, value, inner), note)
        for shape, low, high, inner, note in PAD_CASES
    ]


def _unpad(attrs: PadAttrs, x: Value, g: Value) -> Value:
    """The opposite pad: padding crops the cotangent, cropping pads it with zeros; interior
    elements are stepped over."""
    low = tuple(-amount for amount in attrs.low)
    high = tuple(-amount for amount in attrs.high)
    g = prims.pad(g, low=low, high=high, value=0)
    for dim, amount in enumerate(attrs.interior):
        if amount:
            g = prims.slice(g, dim=dim, start=0, stop=g.type.shape[dim], step=amount + 1)
    return g


movement(
    Op.PAD,
    PadAttrs,
    _pad_meta,
    _pad_impl,
    _pad_samples,
    "pad(x, low, high, value): constant padding per dim; negative amounts crop",
    vjp=input_gradient(_unpad),
)


def _flip_meta(attrs: FlipAttrs, x: TensorType) -> TensorType:
    x = tensor_operand(Op.FLIP, x)
    check_dims(Op.FLIP, attrs.dims, x.rank)
    return result(x, x.shape)


movement(
    Op.FLIP,
    FlipAttrs,
    _flip_meta,
    lambda attrs, x: torch.flip(x, attrs.dims),
    case_samples(
        [
            (((3, 4),), FlipAttrs((0,)), ""),
            (((3, 4),), FlipAttrs((1, 0)), "both dims"),
            (((),), FlipAttrs(()), "0-d"),
            (((0, 3),), FlipAttrs((1,)), "0-size"),
            (((2, 1, 3),), FlipAttrs((1, 2)), "size-1 dim"),
        ]
    ),
    "flip(x, dims): reverse the order of elements along dims",
    vjp=input_gradient(lambda attrs, x, g: prims.flip(g, dims=attrs.dims) if attrs.dims else g),
)
