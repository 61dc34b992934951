"""Elementwise ops of three operands in prims: ``clamp``/``clip`` (and ``clamp_min``/
``clamp_max``), ``where``, ``lerp``, ``addcmul`` and ``addcdiv``, with methods and in-place forms.

All three operands promote and broadcast together, as in eager::

    torch.clamp(x, min=lo)     # x: f32[3, 4], lo: f32[4]
    t1 = broadcast(lo, shape=(3, 4), dims=(1,))
    t2 = maximum(x, t1)

The one-argument ``torch.where(cond)`` is ``nonzero``: its shape depends on data, so it stays a
PyTorch call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import ALL, FLOATS, NUMERIC, make_tensor
from kiln.ops.translations import common
from kiln.ops.translations.math import keys, methods, no_out, opmath_dtype
from kiln.ops.translations.table import Call, CallFn, FallbackToExtern, translation

Operand = common.Operand
Scalar = bool | int | float


# ---------------------------------------------------------------------------------------------
# clamp


def _outside(x: Value, bound: Operand, *, lower: bool) -> Value:
    """Where ``x`` is past ``bound`` (below a lower one, above an upper one), or the bound is
    NaN (a NaN bound makes eager's clamp NaN). A NaN in ``x`` is never past a bound: it
    propagates."""
    past = prims.lt(x, bound) if lower else prims.gt(x, bound)
    if isinstance(bound, Value) and bound.type.dtype.is_floating_point:
        past = prims.logical_or(past, prims.isnan(bound))
    elif isinstance(bound, float) and bound != bound:
        return prims.logical_or(past, True)
    assert isinstance(past, Value)
    return past


def clamp(
    input: Value, min: Operand | None = None, max: Operand | None = None, *, out: Any = None
) -> Value:
    """``minimum(maximum(x, min), max)``: NaN in ``x`` propagates, and ``min > max`` gives max."""
    no_out(out)
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    bounds = [bound for bound in (min, max) if bound is not None]
    (x, *converted), _ = common.elementwise(input, *bounds)
    assert isinstance(x, Value)
    lower = converted.pop(0) if min is not None else None
    upper = converted.pop(0) if max is not None else None
    # where, not maximum/minimum: eager's clamp passes the gradient at the bounds to x.
    if x.type.requires_grad and x.type.dtype.is_floating_point:
        # NaN stays NaN, but eager's clamp passes no gradient to it ((x >= min) & (x <= max)
        # is false): the NaN comes from a constant here, not from x.
        x = prims.where(prims.isnan(x), math.nan, x)
    if lower is not None:
        x = prims.where(_outside(x, lower, lower=True), lower, x)
    if upper is not None:
        x = prims.where(_outside(x, upper, lower=False), upper, x)
    return x


def clamp_min(input: Value, min: Operand, *, out: Any = None) -> Value:
    return clamp(input, min, None, out=out)


def clamp_max(input: Value, max: Operand, *, out: Any = None) -> Value:
    return clamp(input, None, max, out=out)


def _bound(dtype: torch.dtype, value: float) -> Scalar:
    return value if dtype.is_floating_point else int(value * 4)


def _clamp_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    lo, hi = _bound(dtype, -0.5), _bound(dtype, 0.75)
    return [
        Call((x(), lo, hi), note="scalars"),
        Call((x(),), {"min": lo}, note="min only"),
        Call((x(),), {"max": hi}, note="max only"),
        Call((x(), hi, lo), note="min > max"),
        Call((x(), x((4,)), x((3, 1))), note="tensor bounds"),
        Call((x((0, 4)), x((4,))), note="0-size"),
        Call((x(()), lo, hi), note="0-d"),
        Call((x((2, 3)), 0.5), note="float bound")
        if not dtype.is_floating_point
        else Call((x(), 0)),
    ]


def _one_bound_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((3, 4), dtype, device)
    return [Call((x, _bound(dtype, 0.25))), Call((x, make_tensor((4,), dtype, device)))]


def _inplace_clamp_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [call for call in _clamp_calls(dtype, device) if call.note != "float bound"]


translation(*keys(["clamp", "clip"]), samples=_clamp_calls, dtypes=NUMERIC)(clamp)
translation(*keys(["clamp_", "clip_"]), samples=_inplace_clamp_calls, dtypes=NUMERIC, inplace=True)(
    clamp
)
translation(*keys(["clamp_min"]), samples=_one_bound_calls, dtypes=NUMERIC)(clamp_min)
translation(*keys(["clamp_max"]), samples=_one_bound_calls, dtypes=NUMERIC)(clamp_max)
translation(*keys(["clamp_min_"]), samples=_one_bound_calls, dtypes=NUMERIC, inplace=True)(
    clamp_min
)
translation(*keys(["clamp_max_"]), samples=_one_bound_calls, dtypes=NUMERIC, inplace=True)(
    clamp_max
)


# ---------------------------------------------------------------------------------------------
# where


def where(
    condition: Value, input: Operand | None = None, other: Operand | None = None, *, out: Any = None
) -> Value:
    """``torch.where(cond, x, y)`` with scalars and broadcasting on all three."""
    if input is None and other is None:
        raise FallbackToExtern  # torch.where(cond) is nonzero: data-dependent shape
    no_out(out)
    if input is None or other is None:
        raise TypeError("where() missing a required argument: 'input' or 'other'")
    if condition.type.dtype != torch.bool:
        raise RuntimeError(
            f"where expected condition to be a boolean tensor, but got a tensor with dtype "
            f"{str(condition.type.dtype).removeprefix('torch.').capitalize()}"
        )
    dtype = common.result_dtype(input, other)
    x, y = common.convert(input, dtype), common.convert(other, dtype)
    shapes = [o.type.shape for o in (condition, x, y) if isinstance(o, Value)]
    shape = common.broadcast_shapes(*shapes)
    if not isinstance(x, Value) and not isinstance(y, Value):
        x = common.full(shape, x, dtype, condition.type.device)
    cond, x, y = (
        common.broadcast_to(o, shape) if isinstance(o, Value) else o for o in (condition, x, y)
    )
    return prims.where(cond, x, y)


def tensor_where(self: Value, condition: Value, other: Operand) -> Value:
    """``x.where(cond, y)`` is ``torch.where(cond, x, y)``."""
    return where(condition, self, other)


def _where_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def cond(shape: tuple[int, ...]) -> torch.Tensor:
        return make_tensor(shape, torch.bool, device)

    def x(shape: tuple[int, ...]) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    scalar = 2.5 if dtype.is_floating_point else (True if dtype == torch.bool else 7)
    other = torch.int32 if dtype != torch.int32 else torch.float16
    return [
        Call((cond((3, 4)), x((3, 4)), x((3, 4)))),
        Call((cond((3, 1)), x((4,)), x((2, 1, 1))), note="broadcast"),
        Call((cond((3, 4)), x((3, 4)), scalar), note="scalar other"),
        Call((cond((4,)), scalar, x((3, 4))), note="scalar input"),
        Call((cond((0, 4)), x((0, 4)), x((4,))), note="0-size"),
        Call((cond(()), x(()), x(())), note="0-d"),
        Call((cond((3, 4)), x((3, 4)), make_tensor((4,), other, device)), note=f"with {other}"),
        # Two scalars: the dtype comes from them (float32 for 1.5, int64 for ints, bool).
        Call((cond((3, 4)), 1.5, 0), note="scalars"),
        Call((cond((2, 3)), 1, -2), note="int scalars"),
        Call((cond((2,)), True, False), note="bool scalars"),
    ]


def _tensor_where_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [
        Call((c.args[1], c.args[0], c.args[2]), note=c.note)
        for c in _where_calls(dtype, device)[:3]
    ]


translation(torch.where, samples=_where_calls, dtypes=ALL)(where)
translation(torch.Tensor.where, samples=_tensor_where_calls, dtypes=ALL)(tensor_where)


# ---------------------------------------------------------------------------------------------
# lerp, addcmul, addcdiv: eager computes float16/bfloat16 in float32 and rounds once


def _in_opmath(*operands: Operand) -> tuple[list[Operand], torch.dtype]:
    """Operands promoted, broadcast and widened to the compute dtype; and the result dtype."""
    converted, dtype = common.elementwise(*operands)
    wide = opmath_dtype(dtype)
    return [common.convert(o, wide) for o in converted], dtype


def lerp(input: Value, end: Value, weight: Operand, *, out: Any = None) -> Value:
    """``input + weight * (end - input)``, or from the ``end`` side when ``|weight| >= 0.5``
    (eager's formula, exact at both ends)."""
    no_out(out)
    if end.type.dtype != input.type.dtype:
        raise RuntimeError(
            f"expected dtype {input.type.dtype} for `end` but got dtype {end.type.dtype}"
        )
    (start, stop, w), dtype = _in_opmath(input, end, weight)
    difference = prims.sub(stop, start)
    if not isinstance(w, Value):
        if abs(w) < 0.5:
            result = prims.add(start, prims.mul(difference, w))
        else:
            result = prims.sub(stop, prims.mul(difference, 1 - w))
        return common.convert(result, dtype)
    small = prims.lt(prims.abs(w), 0.5)
    from_start = prims.add(start, prims.mul(w, difference))
    from_end = prims.sub(stop, prims.mul(difference, prims.sub(1.0, w)))
    return common.convert(prims.where(small, from_start, from_end), dtype)


def _check_value(value: Scalar, dtype: torch.dtype, op: str) -> None:
    if isinstance(value, float) and not dtype.is_floating_point:
        raise RuntimeError(
            f"{op}: for integral input tensors, argument value must not be a floating point number."
        )


def addcmul(
    input: Value, tensor1: Value, tensor2: Value, *, value: Scalar = 1, out: Any = None
) -> Value:
    """``input + value * tensor1 * tensor2``."""
    no_out(out)
    input, tensor1, tensor2 = common.autocast("addcmul", input, tensor1, tensor2)
    (x, a, b), dtype = _in_opmath(input, tensor1, tensor2)
    _check_value(value, dtype, "addcmul")
    product = prims.mul(_times(a, value), b)
    return common.convert(prims.add(x, product), dtype)


def addcdiv(
    input: Value, tensor1: Value, tensor2: Value, *, value: Scalar = 1, out: Any = None
) -> Value:
    """``input + value * tensor1 / tensor2``."""
    no_out(out)
    input, tensor1, tensor2 = common.autocast("addcdiv", input, tensor1, tensor2)
    (x, a, b), dtype = _in_opmath(input, tensor1, tensor2)
    if not dtype.is_floating_point:
        raise RuntimeError(
            "Integer division with addcdiv is no longer supported, and in a future release "
            "addcdiv will perform a true division of tensor1 and tensor2. Use "
            "(input + value * torch.div(tensor1, tensor2, rounding_mode='trunc')) instead."
        )
    quotient = prims.div(_times(a, value), b)
    return common.convert(prims.add(x, quotient), dtype)


def _times(value: Operand, factor: Scalar) -> Operand:
    if factor == 1 and not isinstance(factor, bool):
        return value
    assert isinstance(value, Value)
    return prims.mul(value, common.convert(factor, value.type.dtype))


def _lerp_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(shape: tuple[int, ...]) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    weight = make_tensor((3, 4), dtype, device, low=-0.5, high=1.5)
    return [
        Call((x((3, 4)), x((3, 4)), 0.3), note="small weight"),
        Call((x((3, 4)), x((3, 4)), 0.8), note="large weight"),
        Call((x((3, 4)), x((4,)), weight), note="tensor weight"),
        Call((x((0, 4)), x((0, 4)), 0.5), note="0-size"),
        Call((x(()), x(()), 1.0), note="0-d"),
    ]


def _addc_calls(divide: bool) -> CallFn:
    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        def x(shape: tuple[int, ...], **span: Any) -> torch.Tensor:
            return make_tensor(shape, dtype, device, **span)

        divisor: dict[str, Any] = {"low": 0.5, "high": 3.0} if divide else {}
        value = 0.5 if dtype.is_floating_point else 2
        return [
            Call((x((3, 4)), x((3, 4)), x((3, 4), **divisor))),
            Call((x((3, 4)), x((4,)), x((3, 1), **divisor)), {"value": value}, note="broadcast"),
            Call((x((0, 4)), x((4,)), x((0, 4), **divisor)), note="0-size"),
            Call((x(()), x(()), x((), **divisor)), {"value": -1}, note="0-d"),
        ]

    return samples


def _inplace(calls: CallFn, skip: Sequence[str] = ("broadcast",)) -> CallFn:
    """Samples whose first argument already has the broadcast shape."""

    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        return [call for call in calls(dtype, device) if call.note not in skip]

    return samples


translation(*keys(["lerp"]), samples=_lerp_calls, dtypes=FLOATS)(lerp)
translation(*methods(["lerp_"]), samples=_lerp_calls, dtypes=FLOATS, inplace=True)(lerp)
translation(*keys(["addcmul"]), samples=_addc_calls(False), dtypes=NUMERIC)(addcmul)
translation(*keys(["addcdiv"]), samples=_addc_calls(True), dtypes=FLOATS)(addcdiv)
translation(
    *methods(["addcmul_"]), samples=_inplace(_addc_calls(False)), dtypes=NUMERIC, inplace=True
)(addcmul)
translation(
    *methods(["addcdiv_"]), samples=_inplace(_addc_calls(True)), dtypes=FLOATS, inplace=True
)(addcdiv)
