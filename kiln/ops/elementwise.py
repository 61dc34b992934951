"""Registry rows of the elementwise prims: unary, binary, ``where`` and ``convert``.

Prims are strict, so translations (not prims) own PyTorch's conveniences: tensor operands must
have equal shapes, dtypes and devices (translations broadcast and promote first), and a Python
scalar operand takes the tensor's dtype. A unary float op on an integer tensor is a TypeError;
the translation converts first, as PyTorch's type promotion does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.op import Op, OpDef, Sample, Tag, register
from kiln.ir.types import Scalar, TensorType
from kiln.ops import prims
from kiln.ops.attrs import ConvertAttrs
from kiln.ops.sampling import ALL, BOOL, FLOATS, INTS, NUMERIC, make_tensor, scalar_for

SHAPES: tuple[tuple[int, ...], ...] = ((3, 5), (), (0, 4), (2, 1, 3))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dtype(op: Op, dtype: torch.dtype, allowed: frozenset[torch.dtype]) -> None:
    if dtype not in allowed and not (dtype == torch.float64 and allowed & FLOATS):
        kinds = sorted(_name(d) for d in allowed)
        raise NotImplementedError(  # eager: "... not implemented for 'Float'"
            f"{op.printed_name} not implemented for {_name(dtype)} (takes {', '.join(kinds)})"
        )


def _operand_tensor(operands: Sequence[TensorType | Scalar | None], op: Op) -> TensorType:
    """The common type of an elementwise op's tensor operands; scalars must fit it."""
    tensors = [o for o in operands if isinstance(o, TensorType)]
    if not tensors:
        raise TypeError(f"{op.printed_name} needs at least one tensor operand")
    first = tensors[0]
    for other in tensors[1:]:
        if other.shape != first.shape:
            raise RuntimeError(
                f"{op.printed_name}: operand shapes {list(first.shape)} and {list(other.shape)} "
                "differ (prims do not broadcast)"
            )
        if other.dtype != first.dtype:
            raise TypeError(
                f"{op.printed_name}: operand dtypes {_name(first.dtype)} and "
                f"{_name(other.dtype)} differ (prims do not promote)"
            )
        if other.device != first.device:
            raise RuntimeError(f"{op.printed_name}: operands on {first.device} and {other.device}")
    for operand in operands:
        if isinstance(operand, float) and not first.dtype.is_floating_point:
            raise TypeError(f"{op.printed_name}: float scalar with a {_name(first.dtype)} tensor")
        if operand is None or isinstance(operand, complex):
            raise TypeError(f"{op.printed_name}: unsupported operand {operand!r}")
    return first.with_(requires_grad=False)


def _as_tensor(value: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _tensors(operands: Sequence[Any]) -> list[torch.Tensor]:
    like = next(o for o in operands if isinstance(o, torch.Tensor))
    return [_as_tensor(o, like) for o in operands]


# ---------------------------------------------------------------------------------------------
# unary

# derivative(x, out, g) -> the gradient of x, in prims
UnaryDerivative = Callable[[Value, Value, Value], Value]
VjpResult = tuple[Value | None, ...]


def _unary_vjp(derivative: UnaryDerivative) -> Callable[..., VjpResult]:
    def vjp(attrs: Any, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
        (g,) = grads
        return (None if g is None else derivative(inputs[0], outputs[0], g),)

    return vjp


def _zeros_like(x: Value) -> Value:
    t = x.type
    return prims.full(shape=t.shape, value=0.0, dtype=t.dtype, device=t.device)


def _square(x: Value) -> Value:
    return prims.mul(x, x)


def _rsqrt_one_minus_square(x: Value) -> Value:
    """eager's ``(-x * x + 1).rsqrt()`` (asin, acos)."""
    return prims.rsqrt(prims.add(prims.mul(prims.neg(x), x), 1))


def _unary_samples(low: float | None, high: float | None) -> Callable[..., list[Sample]]:
    def samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
        return [Sample((make_tensor(s, dtype, device, low=low, high=high),)) for s in SHAPES]

    return samples


def unary(
    op: Op,
    fn: Callable[[torch.Tensor], torch.Tensor],
    dtypes: frozenset[torch.dtype],
    *,
    out_dtype: torch.dtype | None = None,
    low: float | None = None,
    high: float | None = None,
    tags: frozenset[Tag] = frozenset(),
    derivative: UnaryDerivative | None = None,
) -> OpDef:
    """Register a unary elementwise prim computed by ``fn``; ``derivative(x, out, g)`` gives
    the input's gradient from the input, the output and the output's cotangent."""

    def meta(attrs: None, x: TensorType) -> TensorType:
        if not isinstance(x, TensorType):
            raise TypeError(f"{op.printed_name} takes a tensor, got {x!r}")
        _check_dtype(op, x.dtype, dtypes)
        result = x.with_(requires_grad=False)
        return result.with_(dtype=out_dtype) if out_dtype is not None else result

    extra = {Tag.NONDIFFERENTIABLE} if out_dtype is not None else set()
    return register(
        OpDef(
            op,
            meta=meta,
            impl=lambda attrs, x: fn(x),
            tags=frozenset({Tag.ELEMENTWISE, Tag.UNARY, *extra}) | tags,
            dtypes=dtypes,
            samples=_unary_samples(low, high),
            vjp=None if derivative is None else _unary_vjp(derivative),
            doc=f"{op.printed_name}(x), elementwise",
        )
    )


NONDIFF = frozenset({Tag.NONDIFFERENTIABLE})
COSTLY = frozenset({Tag.TRANSCENDENTAL})
LN2 = 0.6931471805599453
TWO_OVER_SQRT_PI = 1.1283791670955126  # eager's 2.0 / sqrt(M_PI)
HALF_SQRT_PI = 0.886226925452758  # eager's 0.5 * sqrt(M_PI)

# Each derivative follows eager's derivatives.yaml term by term (same ops, same order), so
# bf16/fp16 round where eager's autograd rounds.
unary(Op.NEG, torch.neg, NUMERIC, derivative=lambda x, out, g: prims.neg(g))
unary(Op.ABS, torch.abs, NUMERIC, derivative=lambda x, out, g: prims.mul(g, prims.sign(x)))
unary(Op.EXP, torch.exp, FLOATS, tags=COSTLY, derivative=lambda x, out, g: prims.mul(g, out))
unary(Op.EXP2, torch.exp2, FLOATS, derivative=lambda x, out, g: prims.mul(prims.mul(g, out), LN2))
unary(Op.EXPM1, torch.expm1, FLOATS, derivative=lambda x, out, g: prims.mul(g, prims.add(out, 1)))
unary(
    Op.LOG,
    torch.log,
    FLOATS,
    low=0.1,
    high=5.0,
    tags=COSTLY,
    derivative=lambda x, out, g: prims.div(g, x),
)
unary(
    Op.LOG1P,
    torch.log1p,
    FLOATS,
    low=-0.9,
    high=5.0,
    derivative=lambda x, out, g: prims.div(g, prims.add(x, 1)),
)
unary(
    Op.LOG2,
    torch.log2,
    FLOATS,
    low=0.1,
    high=5.0,
    derivative=lambda x, out, g: prims.div(g, prims.mul(x, LN2)),
)
unary(
    Op.SQRT,
    torch.sqrt,
    FLOATS,
    low=0.1,
    high=5.0,
    derivative=lambda x, out, g: prims.div(g, prims.mul(out, 2)),
)
unary(
    Op.RSQRT,
    torch.rsqrt,
    FLOATS,
    low=0.1,
    high=5.0,
    derivative=lambda x, out, g: prims.mul(prims.mul(g, -0.5), prims.pow(out, 3)),
)
unary(
    Op.RECIPROCAL,
    torch.reciprocal,
    FLOATS,
    low=0.5,
    high=5.0,
    derivative=lambda x, out, g: prims.mul(prims.neg(g), _square(out)),
)
unary(
    Op.SIN, torch.sin, FLOATS, tags=COSTLY, derivative=lambda x, out, g: prims.mul(g, prims.cos(x))
)
unary(
    Op.COS,
    torch.cos,
    FLOATS,
    tags=COSTLY,
    derivative=lambda x, out, g: prims.mul(g, prims.neg(prims.sin(x))),
)
unary(
    Op.TAN,
    torch.tan,
    FLOATS,
    low=-1.2,
    high=1.2,
    derivative=lambda x, out, g: prims.mul(g, prims.add(prims.pow(out, 2), 1)),
)
unary(  # eager's tanh_backward
    Op.TANH,
    torch.tanh,
    FLOATS,
    tags=COSTLY,
    derivative=lambda x, out, g: prims.mul(g, prims.sub(1, _square(out))),
)
unary(
    Op.ASIN,
    torch.asin,
    FLOATS,
    low=-0.95,
    high=0.95,
    derivative=lambda x, out, g: prims.mul(g, _rsqrt_one_minus_square(x)),
)
unary(
    Op.ACOS,
    torch.acos,
    FLOATS,
    low=-0.95,
    high=0.95,
    derivative=lambda x, out, g: prims.mul(g, prims.neg(_rsqrt_one_minus_square(x))),
)
unary(
    Op.ATAN, torch.atan, FLOATS, derivative=lambda x, out, g: prims.div(g, prims.add(_square(x), 1))
)
unary(Op.SINH, torch.sinh, FLOATS, derivative=lambda x, out, g: prims.mul(g, prims.cosh(x)))
unary(Op.COSH, torch.cosh, FLOATS, derivative=lambda x, out, g: prims.mul(g, prims.sinh(x)))
unary(
    Op.ERF,
    torch.erf,
    FLOATS,
    tags=COSTLY,
    derivative=lambda x, out, g: prims.mul(
        prims.mul(prims.exp(prims.neg(prims.pow(x, 2))), TWO_OVER_SQRT_PI), g
    ),
)
unary(
    Op.ERFINV,
    torch.erfinv,
    FLOATS,
    low=-0.9,
    high=0.9,
    derivative=lambda x, out, g: prims.mul(
        prims.mul(prims.exp(prims.pow(out, 2)), HALF_SQRT_PI), g
    ),
)
unary(  # eager's sigmoid_backward: g * (1 - out) * out
    Op.SIGMOID,
    torch.sigmoid,
    FLOATS,
    derivative=lambda x, out, g: prims.mul(prims.mul(g, prims.sub(1, out)), out),
)
# Piecewise-constant: eager's gradient is zeros_like(grad), even where the step is.
unary(Op.FLOOR, torch.floor, NUMERIC, derivative=lambda x, out, g: _zeros_like(x))
unary(Op.CEIL, torch.ceil, NUMERIC, derivative=lambda x, out, g: _zeros_like(x))
unary(Op.ROUND, torch.round, NUMERIC, derivative=lambda x, out, g: _zeros_like(x))
unary(Op.TRUNC, torch.trunc, NUMERIC, derivative=lambda x, out, g: _zeros_like(x))
unary(Op.SIGN, torch.sign, NUMERIC | BOOL, derivative=lambda x, out, g: _zeros_like(x))
unary(Op.ISNAN, torch.isnan, ALL, out_dtype=torch.bool)
unary(Op.ISINF, torch.isinf, ALL, out_dtype=torch.bool)
unary(Op.LOGICAL_NOT, torch.logical_not, ALL, out_dtype=torch.bool)
unary(Op.BITWISE_NOT, torch.bitwise_not, INTS | BOOL)


# ---------------------------------------------------------------------------------------------
# binary


def _binary_samples(
    low: float | None, high: float | None, nonzero_rhs: bool
) -> Callable[..., list[Sample]]:
    def samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
        def rhs(shape: tuple[int, ...]) -> torch.Tensor:
            return make_tensor(shape, dtype, device, low=low, high=high, nonzero=nonzero_rhs)

        lhs_low = 0.1 if low is not None and low >= 0 and dtype.is_floating_point else None
        cases = [Sample((make_tensor(s, dtype, device, low=lhs_low), rhs(s))) for s in SHAPES]
        scalar = scalar_for(dtype)
        if low is not None and isinstance(scalar, int | float) and not isinstance(scalar, bool):
            scalar = type(scalar)(max(scalar, low if low > 0 else scalar))
        cases.append(
            Sample((make_tensor((4, 3), dtype, device, low=lhs_low), scalar), note="scalar rhs")
        )
        cases.append(Sample((scalar, rhs((4, 3))), note="scalar lhs"))
        return cases

    return samples


def binary(
    op: Op,
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dtypes: frozenset[torch.dtype],
    *,
    out_dtype: torch.dtype | None = None,
    low: float | None = None,
    high: float | None = None,
    nonzero_rhs: bool = False,
    tags: frozenset[Tag] = frozenset(),
    vjp: Callable[..., Any] | None = None,
) -> OpDef:
    """Register a binary elementwise prim computed by ``fn``."""

    def meta(attrs: None, x: TensorType | Scalar, y: TensorType | Scalar) -> TensorType:
        result = _operand_tensor((x, y), op)
        _check_dtype(op, result.dtype, dtypes)
        return result.with_(dtype=out_dtype) if out_dtype is not None else result

    extra = {Tag.NONDIFFERENTIABLE} if out_dtype is not None else set()
    return register(
        OpDef(
            op,
            meta=meta,
            impl=lambda attrs, x, y: fn(*_tensors((x, y))),
            tags=frozenset({Tag.ELEMENTWISE, Tag.BINARY, *extra}) | tags,
            dtypes=dtypes,
            samples=_binary_samples(low, high, nonzero_rhs),
            vjp=vjp,
            doc=f"{op.printed_name}(x, y), elementwise on equal shapes",
        )
    )


COMPARE = frozenset({Tag.COMPARISON})


# Binary VJP rules. An operand that is a Python scalar gets None (never a gradient), and a rule
# skips the prims that only it would need.


def _traced(operand: Any) -> bool:
    return isinstance(operand, Value)


def _add_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    (g,) = grads
    return (g, g)


def _sub_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    (g,) = grads
    return (g, prims.neg(g) if _traced(inputs[1]) else None)


def _mul_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    x, y = inputs
    (g,) = grads
    return (
        prims.mul(g, y) if _traced(x) else None,
        prims.mul(g, x) if _traced(y) else None,
    )


def _div_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    """eager: ``grad / other`` and ``-grad * ((self / other) / other)``."""
    x, y = inputs
    (g,) = grads
    return (
        prims.div(g, y) if _traced(x) else None,
        prims.mul(prims.neg(g), prims.div(prims.div(x, y), y)) if _traced(y) else None,
    )


def _floor_div_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    """A rounding division is piecewise constant: eager gives zeros to both operands."""
    return tuple(_zeros_like(item) if _traced(item) else None for item in inputs)


def _rounded_remainder_vjp(quotient: Callable[[Any, Any], Value]) -> Callable[..., VjpResult]:
    """``x - y * quotient(x, y)`` (remainder: floor, fmod: trunc): eager gives ``grad`` and
    ``-grad * quotient(x, y)``."""

    def vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
        x, y = inputs
        (g,) = grads
        return (g, prims.mul(prims.neg(g), quotient(x, y)) if _traced(y) else None)

    return vjp


def _in_dtype(value: Any, dtype: torch.dtype) -> float:
    """A Python scalar operand as the prims see it: rounded to the tensor's dtype."""
    return float(torch.tensor(value, dtype=dtype).item())


def _pow_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    """eager's pow_backward_self / pow_backward_exponent: base ``x`` gets ``0`` where the
    exponent is 0, else ``g * (y * x ** (y - 1))``; exponent ``y`` gets ``0`` where ``x == 0``
    and ``y >= 0``, else ``g * (out * log(x))``."""
    x, y = inputs
    (out,) = outputs
    (g,) = grads
    dtype = out.type.dtype
    base_grad = exponent_grad = None
    if _traced(x) and _traced(y):
        base_grad = prims.where(
            prims.eq(y, 0), 0.0, prims.mul(g, prims.mul(y, prims.pow(x, prims.sub(y, 1))))
        )
        at_zero = prims.logical_and(prims.eq(x, 0), prims.ge(y, 0))
        exponent_grad = prims.mul(g, prims.where(at_zero, 0.0, prims.mul(out, prims.log(x))))
    elif _traced(x):  # a scalar exponent: eager's pow_backward
        power = _in_dtype(y, dtype)
        if power == 0:
            base_grad = _zeros_like(x)
        else:
            base_grad = prims.mul(g, prims.mul(prims.pow(x, power - 1), power))
    else:  # a scalar base
        base = _in_dtype(x, dtype)
        weighted = prims.mul(out, float(torch.tensor(base, dtype=dtype).log().item()))
        if base == 0:  # log(0) = -inf: only negative exponents keep out * log(x)
            weighted = prims.where(prims.ge(y, 0), 0.0, weighted)
        exponent_grad = prims.mul(g, weighted)
    return (base_grad, exponent_grad)


def _extremum_vjp(loses: Op) -> Callable[..., VjpResult]:
    """maximum/minimum: the operand that ``loses`` (``x < y`` for maximum) gets 0, and a tie
    splits the cotangent 0.5/0.5, as eager does."""

    def vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
        x, y = inputs
        (g,) = grads
        shared = prims.where(prims.eq(x, y), prims.div(g, 2), g)
        return (
            prims.where(prims.call(loses, x, y), 0.0, shared) if _traced(x) else None,
            prims.where(prims.call(loses, y, x), 0.0, shared) if _traced(y) else None,
        )

    return vjp


def _atan2_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    """eager's atan2_backward: ``g * y * r`` and ``g * -x * r`` with ``r = 1 / (x*x + y*y)``."""
    x, y = inputs
    (g,) = grads
    squares = [prims.mul(v, v) if _traced(v) else v * v for v in (x, y)]
    total = prims.add(*squares)
    # At x = y = 0 eager's formula is 0 / 0; its kernel gives 0 (both numerators are 0).
    recip = prims.reciprocal(prims.where(prims.eq(total, 0), 1, total))
    return (
        prims.mul(prims.mul(g, y), recip) if _traced(x) else None,
        prims.mul(prims.mul(g, prims.neg(x) if _traced(x) else -x), recip) if _traced(y) else None,
    )


binary(Op.ADD, torch.add, ALL, vjp=_add_vjp)
binary(Op.SUB, torch.sub, NUMERIC, vjp=_sub_vjp)
binary(Op.MUL, torch.mul, ALL, vjp=_mul_vjp)
binary(Op.DIV, torch.div, FLOATS, nonzero_rhs=True, vjp=_div_vjp)
binary(
    Op.FLOOR_DIV,
    lambda x, y: torch.div(x, y, rounding_mode="floor"),
    NUMERIC,
    nonzero_rhs=True,
    vjp=_floor_div_vjp,
)
binary(
    Op.REMAINDER,
    torch.remainder,
    NUMERIC,
    nonzero_rhs=True,
    vjp=_rounded_remainder_vjp(lambda x, y: prims.floor_div(x, y)),
)
binary(  # eager's rounding_mode="trunc" for floats is trunc(x / y)
    Op.FMOD,
    torch.fmod,
    NUMERIC,
    nonzero_rhs=True,
    vjp=_rounded_remainder_vjp(lambda x, y: prims.trunc(prims.div(x, y))),
)
binary(Op.POW, torch.pow, NUMERIC, low=0.0, high=3.0, tags=COSTLY, vjp=_pow_vjp)
binary(Op.MAXIMUM, torch.maximum, ALL, vjp=_extremum_vjp(Op.LT))
binary(Op.MINIMUM, torch.minimum, ALL, vjp=_extremum_vjp(Op.GT))
binary(Op.ATAN2, torch.atan2, FLOATS, vjp=_atan2_vjp)
binary(Op.EQ, torch.eq, ALL, out_dtype=torch.bool, tags=COMPARE)
binary(Op.NE, torch.ne, ALL, out_dtype=torch.bool, tags=COMPARE)
binary(Op.LT, torch.lt, ALL, out_dtype=torch.bool, tags=COMPARE)
binary(Op.LE, torch.le, ALL, out_dtype=torch.bool, tags=COMPARE)
binary(Op.GT, torch.gt, ALL, out_dtype=torch.bool, tags=COMPARE)
binary(Op.GE, torch.ge, ALL, out_dtype=torch.bool, tags=COMPARE)
binary(Op.LOGICAL_AND, torch.logical_and, ALL, out_dtype=torch.bool)
binary(Op.LOGICAL_OR, torch.logical_or, ALL, out_dtype=torch.bool)
binary(Op.LOGICAL_XOR, torch.logical_xor, ALL, out_dtype=torch.bool)
binary(Op.BITWISE_AND, torch.bitwise_and, INTS | BOOL)
binary(Op.BITWISE_OR, torch.bitwise_or, INTS | BOOL)
binary(Op.BITWISE_XOR, torch.bitwise_xor, INTS | BOOL)
binary(Op.SHIFT_LEFT, torch.bitwise_left_shift, INTS, low=0, high=5)
binary(Op.SHIFT_RIGHT, torch.bitwise_right_shift, INTS, low=0, high=5)


# ---------------------------------------------------------------------------------------------
# where and convert


def _where_meta(
    attrs: None, cond: TensorType, x: TensorType | Scalar, y: TensorType | Scalar
) -> TensorType:
    if not isinstance(cond, TensorType) or cond.dtype != torch.bool:
        raise TypeError("where: the condition must be a bool tensor")
    result = _operand_tensor((x, y), Op.WHERE)
    if result.shape != cond.shape:
        raise RuntimeError(
            f"where: condition shape {list(cond.shape)} differs from {list(result.shape)}"
        )
    return result


def _where_impl(attrs: None, cond: torch.Tensor, x: Any, y: Any) -> torch.Tensor:
    like = x if isinstance(x, torch.Tensor) else y
    return torch.where(cond, _as_tensor(x, like), _as_tensor(y, like))


def _where_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    cases = [
        Sample(
            (
                make_tensor(s, torch.bool, device),
                make_tensor(s, dtype, device),
                make_tensor(s, dtype, device),
            )
        )
        for s in SHAPES
    ]
    cases.append(
        Sample(
            (
                make_tensor((3, 4), torch.bool, device),
                make_tensor((3, 4), dtype, device),
                scalar_for(dtype),
            ),
            note="scalar y",
        )
    )
    return cases


def _where_vjp(attrs: None, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    """eager: ``where(cond, grad, 0)`` and ``where(cond, 0, grad)``; the mask gets none."""
    cond, x, y = inputs
    (g,) = grads
    return (
        None,
        prims.where(cond, g, 0.0) if _traced(x) else None,
        prims.where(cond, 0.0, g) if _traced(y) else None,
    )


register(
    OpDef(
        Op.WHERE,
        meta=_where_meta,
        impl=_where_impl,
        tags=frozenset({Tag.ELEMENTWISE}),
        dtypes=ALL,
        samples=_where_samples,
        vjp=_where_vjp,
        doc="where(cond, x, y): x where cond else y",
    )
)


def _convert_meta(attrs: ConvertAttrs, x: TensorType) -> TensorType:
    return x.with_(dtype=attrs.dtype, requires_grad=False)


def _convert_vjp(attrs: ConvertAttrs, inputs: Any, outputs: Any, grads: Any) -> VjpResult:
    """The cotangent converted back to the input's dtype; none through an integer or bool
    output (eager's output is not differentiable then)."""
    (x,) = inputs
    (g,) = grads
    if g is None or not attrs.dtype.is_floating_point or not x.type.dtype.is_floating_point:
        return (None,)
    return (g if g.type.dtype == x.type.dtype else prims.convert(g, dtype=x.type.dtype),)


def _convert_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    targets = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool)
    return [Sample((make_tensor((3, 5), dtype, device),), ConvertAttrs(t)) for t in targets]


register(
    OpDef(
        Op.CONVERT,
        meta=_convert_meta,
        impl=lambda attrs, x: x.to(attrs.dtype, copy=True),  # a node's result never aliases
        attrs=ConvertAttrs,
        tags=frozenset({Tag.ELEMENTWISE, Tag.UNARY}),
        dtypes=ALL,
        samples=_convert_samples,
        vjp=_convert_vjp,
        doc="convert(x, dtype): elementwise type conversion (PyTorch's .to(dtype) semantics)",
    )
)
