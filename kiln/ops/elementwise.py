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

from kiln.ir.op import Op, OpDef, Sample, Tag, register
from kiln.ir.types import Scalar, TensorType
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
) -> OpDef:
    """Register a unary elementwise prim computed by ``fn``."""

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
            doc=f"{op.printed_name}(x), elementwise",
        )
    )


NONDIFF = frozenset({Tag.NONDIFFERENTIABLE})

unary(Op.NEG, torch.neg, NUMERIC)
unary(Op.ABS, torch.abs, NUMERIC)
unary(Op.EXP, torch.exp, FLOATS)
unary(Op.EXP2, torch.exp2, FLOATS)
unary(Op.EXPM1, torch.expm1, FLOATS)
unary(Op.LOG, torch.log, FLOATS, low=0.1, high=5.0)
unary(Op.LOG1P, torch.log1p, FLOATS, low=-0.9, high=5.0)
unary(Op.LOG2, torch.log2, FLOATS, low=0.1, high=5.0)
unary(Op.SQRT, torch.sqrt, FLOATS, low=0.1, high=5.0)
unary(Op.RSQRT, torch.rsqrt, FLOATS, low=0.1, high=5.0)
unary(Op.RECIPROCAL, torch.reciprocal, FLOATS, low=0.5, high=5.0)
unary(Op.SIN, torch.sin, FLOATS)
unary(Op.COS, torch.cos, FLOATS)
unary(Op.TAN, torch.tan, FLOATS, low=-1.2, high=1.2)
unary(Op.TANH, torch.tanh, FLOATS)
unary(Op.ASIN, torch.asin, FLOATS, low=-0.95, high=0.95)
unary(Op.ACOS, torch.acos, FLOATS, low=-0.95, high=0.95)
unary(Op.ATAN, torch.atan, FLOATS)
unary(Op.SINH, torch.sinh, FLOATS)
unary(Op.COSH, torch.cosh, FLOATS)
unary(Op.ERF, torch.erf, FLOATS)
unary(Op.ERFINV, torch.erfinv, FLOATS, low=-0.9, high=0.9)
unary(Op.SIGMOID, torch.sigmoid, FLOATS)
unary(Op.FLOOR, torch.floor, NUMERIC)
unary(Op.CEIL, torch.ceil, NUMERIC)
unary(Op.ROUND, torch.round, NUMERIC)
unary(Op.TRUNC, torch.trunc, NUMERIC)
unary(Op.SIGN, torch.sign, NUMERIC | BOOL)
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
            doc=f"{op.printed_name}(x, y), elementwise on equal shapes",
        )
    )


COMPARE = frozenset({Tag.COMPARISON})

binary(Op.ADD, torch.add, ALL)
binary(Op.SUB, torch.sub, NUMERIC)
binary(Op.MUL, torch.mul, ALL)
binary(Op.DIV, torch.div, FLOATS, nonzero_rhs=True)
binary(Op.FLOOR_DIV, lambda x, y: torch.div(x, y, rounding_mode="floor"), NUMERIC, nonzero_rhs=True)
binary(Op.REMAINDER, torch.remainder, NUMERIC, nonzero_rhs=True)
binary(Op.FMOD, torch.fmod, NUMERIC, nonzero_rhs=True)
binary(Op.POW, torch.pow, NUMERIC, low=0.0, high=3.0)
binary(Op.MAXIMUM, torch.maximum, ALL)
binary(Op.MINIMUM, torch.minimum, ALL)
binary(Op.ATAN2, torch.atan2, FLOATS)
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


register(
    OpDef(
        Op.WHERE,
        meta=_where_meta,
        impl=_where_impl,
        tags=frozenset({Tag.ELEMENTWISE}),
        dtypes=ALL,
        samples=_where_samples,
        doc="where(cond, x, y): x where cond else y",
    )
)


def _convert_meta(attrs: ConvertAttrs, x: TensorType) -> TensorType:
    return x.with_(dtype=attrs.dtype, requires_grad=False)


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
        doc="convert(x, dtype): elementwise type conversion (PyTorch's .to(dtype) semantics)",
    )
)
