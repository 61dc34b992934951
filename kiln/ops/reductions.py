"""Registry rows of the reduction prims: ``sum``, ``prod``, ``amax``, ``amin`` over a set of
dims, and ``argmax``, ``argmin`` along one dim.

Prims are strict: reduced dims are removed (translations unsqueeze for ``keepdim``), dims are
valid, unique and non-negative, and the output keeps the input dtype (translations convert
first where PyTorch promotes, e.g. an int32 or bool ``torch.sum`` gives int64). ``dims=()``
reduces nothing, so ``sum(x, dims=())`` is a copy of ``x`` (in torch an empty dim list reduces
everything). A max or min over a dim of size 0 has no identity and is an error, as in torch::

    t1 = sum(t0, dims=(0, 2))  # f32[2, 3, 4] -> f32[3]
    t2 = argmax(t0, dim=1)     # f32[2, 3, 4] -> i64[2, 4]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.op import Op, OpDef, Sample, Tag, register
from kiln.ir.types import FLOATING, Shape, TensorType
from kiln.ops import prims
from kiln.ops.attrs import ArgReduceAttrs, ReduceAttrs
from kiln.ops.sampling import ALL, NUMERIC, make_tensor

# (shape, dims) of the samples; "empty" ones reduce a dim of size 0 (max and min reject those).
REDUCE_CASES: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((3, 5), (1,)),
    ((3, 5), (0,)),
    ((2, 3, 4), (1,)),
    ((2, 3, 4), (2, 0)),
    ((2, 3, 4), (0, 1, 2)),
    ((4, 1, 3), (1,)),
    ((2, 3), ()),
    ((), ()),
    ((0, 4), (1,)),
)
EMPTY_REDUCE_CASES = (((0, 4), (0,)), ((2, 0, 3), (1, 2)))
ARG_CASES: tuple[tuple[tuple[int, ...], int], ...] = (
    ((3, 5), 0),
    ((3, 5), 1),
    ((2, 3, 4), 1),
    ((2, 3, 4), 2),
    ((4, 1, 3), 1),
    ((1,), 0),
    ((0, 4), 1),
)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_operand(op: Op, x: object, dtypes: frozenset[torch.dtype]) -> TensorType:
    if not isinstance(x, TensorType):
        raise TypeError(f"{op.printed_name}: expected a tensor, got {x!r}")
    if x.dtype not in dtypes:
        kinds = ", ".join(sorted(_name(d) for d in dtypes))
        raise TypeError(f"{op.printed_name}: {_name(x.dtype)} is not supported (takes {kinds})")
    return x


def _check_dims(op: Op, x: TensorType, dims: tuple[int, ...], *, nonempty: bool) -> None:
    """Dims are in range, non-negative and unique; with ``nonempty``, none has size 0."""
    for dim in dims:
        if not isinstance(dim, int) or not 0 <= dim < x.rank:
            raise IndexError(
                f"{op.printed_name}: dim {dim!r} out of range for a {x.rank}-d tensor "
                f"(prim dims are in [0, {x.rank}))"
            )
        if nonempty and x.shape[dim] == 0:
            raise IndexError(
                f"{op.printed_name}: cannot reduce dim {dim} of size 0 (there is no identity)"
            )
    if len(set(dims)) != len(dims):
        raise RuntimeError(f"{op.printed_name}: dims {dims} name a dim more than once")


def _without(shape: Shape, dims: tuple[int, ...]) -> Shape:
    return tuple(size for index, size in enumerate(shape) if index not in dims)


def _prod(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``torch.prod`` over several dims in one accumulation: move them last, flatten them."""
    kept = [d for d in range(x.dim()) if d not in dims]
    flat_shape = [x.shape[d] for d in kept] + [math.prod(x.shape[d] for d in dims)]
    return x.permute(*kept, *dims).reshape(flat_shape).prod(-1, dtype=x.dtype)


# ---------------------------------------------------------------------------------------------
# sum, prod, amax, amin


def _reduce_samples(
    low: float | None, high: float | None, nonempty: bool
) -> Callable[[torch.dtype, torch.device], list[Sample]]:
    cases = REDUCE_CASES if nonempty else REDUCE_CASES + EMPTY_REDUCE_CASES

    def samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
        return [
            Sample((make_tensor(shape, dtype, device, low=low, high=high),), ReduceAttrs(dims))
            for shape, dims in cases
        ]

    return samples


def reduction(
    op: Op,
    fn: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor],
    dtypes: frozenset[torch.dtype],
    *,
    nonempty: bool = False,
    low: float | None = None,
    high: float | None = None,
    vjp: Callable[..., Any] | None = None,
) -> OpDef:
    """Register a reduction over ``attrs.dims`` computed by ``fn(x, dims)`` (dims non-empty)."""
    accepted = dtypes | FLOATING  # float64 too, like every prim that takes floats

    def meta(attrs: ReduceAttrs, x: TensorType) -> TensorType:
        x = _tensor_operand(op, x, accepted)
        _check_dims(op, x, attrs.dims, nonempty=nonempty)
        return x.with_(shape=_without(x.shape, attrs.dims), requires_grad=False)

    def impl(attrs: ReduceAttrs, x: torch.Tensor) -> torch.Tensor:
        return fn(x, attrs.dims) if attrs.dims else x.clone()

    return register(
        OpDef(
            op,
            meta=meta,
            impl=impl,
            attrs=ReduceAttrs,
            tags=frozenset({Tag.REDUCTION}),
            dtypes=dtypes,
            samples=_reduce_samples(low, high, nonempty),
            vjp=vjp,
            doc=f"{op.printed_name}(x, dims): reduce over dims (removed), same dtype",
        )
    )


# ---------------------------------------------------------------------------------------------
# VJP rules: vjp(attrs, inputs, outputs, grads) -> one gradient per input, in prims. With
# ``dims=()`` a reduction is a copy, so its cotangent passes through. One output, so its
# cotangent is never None (vjp_of skips a node without any).
Grads = tuple[Value | None, ...]
Cotangents = Sequence[Value]


def _restore(reduced: Value, x: Value, dims: tuple[int, ...]) -> Value:
    """``reduced`` (``x`` reduced over ``dims``) broadcast back to ``x``'s shape."""
    kept = tuple(dim for dim in range(x.type.rank) if dim not in dims)
    return prims.broadcast(reduced, shape=x.type.shape, dims=kept)


def _count(mask: Value, dims: tuple[int, ...]) -> Value:
    """How many elements of ``mask`` are set over ``dims``, in int64 as eager counts."""
    return prims.sum(prims.convert(mask, dtype=torch.int64), dims=dims)


def _sum_vjp(attrs: ReduceAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents) -> Grads:
    (x,) = inputs
    (g,) = grads
    return (_restore(g, x, attrs.dims) if attrs.dims else g,)


def _prod_vjp(attrs: ReduceAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents) -> Grads:
    """Eager's prod_backward: ``g * result / x`` in a slice without zeros; with one zero, the
    product of the others at the zero and 0 elsewhere; with more, 0. Decided per slice here
    (eager switches the whole tensor to a zero-safe cumprod formula, equal up to rounding)."""
    (x,) = inputs
    (result,) = outputs
    (g,) = grads
    if not attrs.dims:
        return (g,)
    dims = attrs.dims
    zero = prims.eq(x, 0)
    zeros = _count(zero, dims)
    others = _restore(prims.prod(prims.where(zero, 1, x), dims=dims), x, dims)
    lone_zero = prims.logical_and(zero, _restore(prims.eq(zeros, 1), x, dims))
    with_zero = prims.where(lone_zero, others, 0)
    no_zero = _restore(prims.eq(zeros, 0), x, dims)
    derivative = prims.where(no_zero, prims.div(_restore(result, x, dims), x), with_zero)
    return (prims.mul(_restore(g, x, dims), derivative),)


def _extreme_vjp(
    attrs: ReduceAttrs, inputs: Sequence[Any], outputs: Any, grads: Cotangents
) -> Grads:
    """amax/amin: the cotangent split evenly among the elements equal to the extreme, as
    eager's ``(g / mask.sum(dims)) * mask`` (a slice of NaNs gets NaN, as in eager)."""
    (x,) = inputs
    (result,) = outputs
    (g,) = grads
    if not attrs.dims:
        return (g,)
    dims, dtype = attrs.dims, x.type.dtype
    chosen = prims.eq(x, _restore(result, x, dims))
    # Eager promotes the int64 count to g's dtype where it divides.
    count = prims.convert(_count(chosen, dims), dtype=dtype)
    share = _restore(prims.div(g, count), x, dims)
    return (prims.mul(share, prims.convert(chosen, dtype=dtype)),)


reduction(Op.SUM, lambda x, dims: torch.sum(x, dims, dtype=x.dtype), NUMERIC, vjp=_sum_vjp)
reduction(Op.PROD, _prod, NUMERIC, low=-2.0, high=3.0, vjp=_prod_vjp)
reduction(Op.AMAX, torch.amax, ALL, nonempty=True, vjp=_extreme_vjp)
reduction(Op.AMIN, torch.amin, ALL, nonempty=True, vjp=_extreme_vjp)


# ---------------------------------------------------------------------------------------------
# argmax, argmin


def _arg_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    return [
        Sample((make_tensor(shape, dtype, device),), ArgReduceAttrs(dim))
        for shape, dim in ARG_CASES
    ]


def arg_reduction(op: Op, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> OpDef:
    """Register an int64 index-of-extreme prim along ``attrs.dim`` computed by ``fn(x, dim)``."""

    def meta(attrs: ArgReduceAttrs, x: TensorType) -> TensorType:
        x = _tensor_operand(op, x, NUMERIC | FLOATING)
        _check_dims(op, x, (attrs.dim,), nonempty=True)
        return x.with_(
            shape=_without(x.shape, (attrs.dim,)), dtype=torch.int64, requires_grad=False
        )

    return register(
        OpDef(
            op,
            meta=meta,
            impl=lambda attrs, x: fn(x, attrs.dim),
            attrs=ArgReduceAttrs,
            tags=frozenset({Tag.REDUCTION, Tag.NONDIFFERENTIABLE}),
            dtypes=NUMERIC,
            samples=_arg_samples,
            doc=f"{op.printed_name}(x, dim): int64 index of the first extreme along dim (removed)",
        )
    )


arg_reduction(Op.ARGMAX, torch.argmax)
arg_reduction(Op.ARGMIN, torch.argmin)
