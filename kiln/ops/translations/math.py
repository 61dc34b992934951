"""Elementwise math in prims: unary functions, arithmetic, comparisons, logical and bitwise ops,
with their Tensor methods, Python operators (reflected ones too) and in-place forms.

Prims neither promote nor broadcast, so every op goes through ``common.elementwise`` first, and
ops that always compute in floating point (``div``, ``exp``...) convert integers first::

    x / 2              # x: i64[3]
    t1 = convert(x, dtype=torch.float32)
    t2 = div(t1, 2.0)

The keys are the callables that reach ``__torch_function__``: ``x + y`` arrives as
``torch.Tensor.add``, ``2 - x`` as ``torch.Tensor.__rsub__``, ``x ** 2`` as
``torch.Tensor.__pow__`` and ``x += y`` as ``torch.Tensor.add_``. Matrix products (``@``) live
with the linear-algebra translations.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import ALL, BOOL, FLOATS, INTS, NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.elementwise_cases import (
    KwargsFn,
    Span,
    binary_calls,
    inplace_calls,
    unary_calls,
)
from kiln.ops.translations.table import FallbackToExtern, translation

Operand = common.Operand
Prim = Callable[..., Any]
REDUCED = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# shared helpers (also used by the activation and ternary translations)


def no_out(out: Any) -> None:
    """``out=`` writes into a caller's tensor: leave such calls to PyTorch."""
    if out is not None:
        raise FallbackToExtern


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager kernels compute a float16/bfloat16 op in (float32), rounding once."""
    return torch.float32 if dtype in REDUCED else dtype


def apply(prim: Prim, *operands: Operand, int_to_float: bool = False) -> Value:
    """``prim`` on operands promoted and broadcast as eager elementwise ops do."""
    converted, _ = common.elementwise(*operands, int_to_float=int_to_float)
    return prim(*converted)


def scale(value: Operand, factor: bool | int | float) -> Operand:
    """``value * factor``, folded in Python for a scalar ``value``."""
    if isinstance(value, Value):
        return prims.mul(value, common.convert(factor, value.type.dtype))
    return value * factor


def keys(names: Sequence[str], owners: Sequence[Any] = (torch, torch.Tensor)) -> tuple[Any, ...]:
    """The callables named ``names`` on ``owners`` that exist, each once (aliases share objects)."""
    found: list[Any] = []
    for name in names:
        for owner in owners:
            fn = getattr(owner, name, None)
            if fn is not None and not any(fn is seen for seen in found):
                found.append(fn)
    return tuple(found)


def methods(names: Sequence[str]) -> tuple[Any, ...]:
    return keys(names, (torch.Tensor,))


# ---------------------------------------------------------------------------------------------
# unary


def _unary(name: str, prim: Prim, *, floating: bool) -> Callable[..., Value]:
    def translate(input: Value, *, out: Any = None) -> Value:
        no_out(out)
        (x,) = common.autocast(name, input)
        if floating:
            x = common.convert(x, common.float_dtype(x.type.dtype))
        return prim(x)

    translate.__name__ = translate.__qualname__ = name
    return translate


def _log10(x: Value) -> Value:
    wide = common.convert(x, opmath_dtype(x.type.dtype))
    result = prims.mul(prims.log(wide), 1 / 2.302585092994046)
    return common.convert(result, x.type.dtype)


def _isfinite(x: Value) -> Value:
    return prims.logical_not(prims.logical_or(prims.isnan(x), prims.isinf(x)))


def _positive(x: Value) -> Value:
    if x.type.dtype == torch.bool:
        raise TypeError("The `+` operator, on a bool tensor is not supported.")
    return x


def _square(x: Value) -> Value:
    """``pow(x, 2)``: a bool tensor squares to int64, as PyTorch's promotion with ``2`` says."""
    y = common.convert(x, common.result_dtype(x, 2))
    return prims.mul(y, y)


def _frac(x: Value) -> Value:
    return prims.sub(x, prims.trunc(x))


def register_unary(
    fn: Callable[..., Value],
    names: Sequence[str],
    dtypes: frozenset[torch.dtype],
    *,
    span: Span = Span(),
    inplace_dtypes: frozenset[torch.dtype] | None = None,
    extra: Sequence[Any] = (),
    kwargs: KwargsFn | None = None,
) -> None:
    """Register ``fn`` for ``torch.<name>``/``Tensor.<name>`` and the in-place ``<name>_``."""
    samples = unary_calls(span, kwargs)
    translation(*keys(names), *extra, samples=samples, dtypes=dtypes)(fn)
    inplace = keys([f"{name}_" for name in names])
    if inplace:
        in_dtypes = dtypes if inplace_dtypes is None else inplace_dtypes
        translation(*inplace, samples=samples, dtypes=in_dtypes, inplace=True)(fn)


POSITIVE = Span(low=0.1, high=5.0)
_FLOAT_UNARY: tuple[tuple[Sequence[str], Prim, Span, tuple[Any, ...]], ...] = (
    (("exp",), prims.exp, Span(), ()),
    (("exp2",), prims.exp2, Span(), (torch.special.exp2,)),
    (("expm1",), prims.expm1, Span(), (torch.special.expm1,)),
    (("log",), prims.log, POSITIVE, ()),
    (("log1p",), prims.log1p, Span(low=-0.9, high=5.0), (torch.special.log1p,)),
    (("log2",), prims.log2, POSITIVE, ()),
    (("log10",), _log10, POSITIVE, ()),
    (("sqrt",), prims.sqrt, POSITIVE, ()),
    (("rsqrt",), prims.rsqrt, POSITIVE, ()),
    (("reciprocal",), prims.reciprocal, Span(low=0.5, high=5.0), ()),
    (("sin",), prims.sin, Span(), ()),
    (("cos",), prims.cos, Span(), ()),
    (("tan",), prims.tan, Span(low=-1.2, high=1.2), ()),
    (("tanh",), prims.tanh, Span(), ()),
    (("asin", "arcsin"), prims.asin, Span(low=-0.95, high=0.95), ()),
    (("acos", "arccos"), prims.acos, Span(low=-0.95, high=0.95), ()),
    (("atan", "arctan"), prims.atan, Span(), ()),
    (("sinh",), prims.sinh, Span(), ()),
    (("cosh",), prims.cosh, Span(), ()),
    (("erf",), prims.erf, Span(), (torch.special.erf,)),
    (("erfinv",), prims.erfinv, Span(low=-0.9, high=0.9), (torch.special.erfinv,)),
    (("sigmoid",), prims.sigmoid, Span(), (torch.special.expit,)),
)
for _names, _prim, _span, _extra in _FLOAT_UNARY:
    # Integer inputs compute in the default float dtype, which they cannot be written back to.
    register_unary(
        _unary(_names[0], _prim, floating=True), _names, NUMERIC | BOOL, span=_span,
        inplace_dtypes=FLOATS, extra=_extra,
    )

_SAME_DTYPE_UNARY: tuple[tuple[Sequence[str], Prim, frozenset[torch.dtype]], ...] = (
    (("neg", "negative"), prims.neg, NUMERIC),
    (("abs", "absolute"), prims.abs, NUMERIC),
    (("floor",), prims.floor, NUMERIC),
    (("ceil",), prims.ceil, NUMERIC),
    (("trunc", "fix"), prims.trunc, NUMERIC),
    (("sign", "sgn"), prims.sign, NUMERIC | BOOL),
    (("isnan",), prims.isnan, ALL),
    (("isinf",), prims.isinf, ALL),
    (("isfinite",), _isfinite, ALL),
    (("logical_not",), prims.logical_not, ALL),
    (("bitwise_not",), prims.bitwise_not, INTS | BOOL),
    (("positive",), _positive, NUMERIC),
    (("frac",), _frac, FLOATS),
)
for _names, _prim, _dtypes in _SAME_DTYPE_UNARY:
    register_unary(_unary(_names[0], _prim, floating=False), _names, _dtypes)
register_unary(_unary("square", _square, floating=False), ["square"], ALL, inplace_dtypes=NUMERIC)
translation(*methods(["__invert__"]), samples=unary_calls(), dtypes=INTS | BOOL)(
    _unary("invert", prims.bitwise_not, floating=False)
)


def round(input: Value, *, decimals: int = 0, out: Any = None) -> Value:  # noqa: A001
    """``torch.round``; with ``decimals``, eager scales by 10**decimals in float32 (opmath)."""
    no_out(out)
    if decimals == 0:
        return prims.round(input)
    dtype = input.type.dtype
    if not dtype.is_floating_point:
        raise NotImplementedError(f'"round_cpu" not implemented for {dtype} with decimals')
    x = common.convert(input, opmath_dtype(dtype))
    ten = float(10 ** abs(decimals))
    if decimals > 0:
        rounded = prims.div(prims.round(prims.mul(x, ten)), ten)
    else:
        rounded = prims.mul(prims.round(prims.div(x, ten)), ten)
    return common.convert(rounded, dtype)


def _round_kwargs(dtype: torch.dtype) -> list[dict[str, Any]]:
    return [{"decimals": 1}, {"decimals": -1}] if dtype.is_floating_point else []


register_unary(round, ["round"], NUMERIC, kwargs=_round_kwargs)
translation(torch.special.round, samples=unary_calls(kwargs=_round_kwargs), dtypes=FLOATS)(round)


# ---------------------------------------------------------------------------------------------
# binary registration: functions, operators, reflected operators, in-place forms


def operator(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A Python operator: an operand that is neither a tensor nor a number gives NotImplemented,
    so Python tries the other operand (``x == None`` is False, as in eager)."""

    def translate(self: Value, other: Any) -> Any:
        if isinstance(other, numbers.Number) and not isinstance(other, bool | int | float):
            other = other.item() if hasattr(other, "item") else other
        if not isinstance(other, Value | bool | int | float):
            return NotImplemented
        return fn(self, other)

    translate.__name__ = translate.__qualname__ = f"operator_{fn.__name__}"
    return translate


def reflected(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``other <op> self``: the reflected operator ``Tensor.__r<op>__(self, other)``."""

    def translate(self: Value, other: Any) -> Any:
        if not isinstance(other, Value | bool | int | float):
            return NotImplemented
        return fn(other, self)

    translate.__name__ = translate.__qualname__ = f"reflected_{fn.__name__}"
    return translate


def register_binary(
    fn: Callable[..., Value],
    names: Sequence[str],
    dtypes: frozenset[torch.dtype],
    *,
    operators: Sequence[str] = (),
    reflections: Sequence[str] = (),
    inplace_operators: Sequence[str] = (),
    inplace_dtypes: frozenset[torch.dtype] | None = None,
    lhs: Span = Span(),
    rhs: Span = Span(),
    scalar: bool = True,
    kwargs: KwargsFn | None = None,
) -> None:
    """Register a binary op under its functions/methods (with keyword samples), its operators,
    reflected operators, in-place methods ``<name>_`` and in-place operators (``__iadd__``)."""
    float_scalar = scalar and bool(dtypes & FLOATS)
    plain = binary_calls(lhs, rhs, scalar=scalar, float_scalar=float_scalar, partners=dtypes)
    translation(
        *keys(names),
        samples=binary_calls(
            lhs, rhs, scalar=scalar, float_scalar=float_scalar, partners=dtypes, kwargs=kwargs
        ),
        dtypes=dtypes,
    )(fn)
    if operators:
        translation(*methods(operators), samples=plain, dtypes=dtypes)(operator(fn))
    if reflections:
        swapped = binary_calls(rhs, lhs, float_scalar=float_scalar, partners=dtypes)
        translation(*methods(reflections), samples=swapped, dtypes=dtypes)(reflected(fn))
    in_dtypes = dtypes if inplace_dtypes is None else inplace_dtypes
    inplace = methods([f"{name}_" for name in names])
    if inplace:
        samples = inplace_calls(rhs, scalar=scalar, kwargs=kwargs)
        translation(*inplace, samples=samples, dtypes=in_dtypes, inplace=True)(fn)
    if inplace_operators:
        samples = inplace_calls(rhs, scalar=scalar)
        translation(*methods(inplace_operators), samples=samples, dtypes=in_dtypes, inplace=True)(
            operator(fn)
        )


# ---------------------------------------------------------------------------------------------
# arithmetic


def _check_alpha(alpha: bool | int | float, dtype: torch.dtype) -> None:
    if isinstance(alpha, bool) and dtype != torch.bool:
        raise RuntimeError("Boolean alpha only supported for Boolean results.")
    if isinstance(alpha, float) and not dtype.is_floating_point:
        raise RuntimeError(
            "For integral input tensors, argument alpha must not be a floating point number."
        )


def scaled(prim: Prim, input: Operand, other: Operand, alpha: bool | int | float) -> Value:
    """``prim(input, alpha * other)`` (add and sub), in float32 for float16/bfloat16."""
    (x, y), dtype = common.elementwise(input, other)
    _check_alpha(alpha, dtype)
    if alpha is True or (alpha == 1 and not isinstance(alpha, bool)):
        return prim(x, y)
    wide = opmath_dtype(dtype)
    result = prim(common.convert(x, wide), scale(common.convert(y, wide), alpha))
    return common.convert(result, dtype)


def add(input: Operand, other: Operand, *, alpha: bool | int | float = 1, out: Any = None) -> Value:
    no_out(out)
    return scaled(prims.add, input, other, alpha)


def sub(input: Operand, other: Operand, *, alpha: bool | int | float = 1, out: Any = None) -> Value:
    no_out(out)
    if common.result_dtype(input, other) == torch.bool:
        raise RuntimeError(
            "Subtraction, the `-` operator, with two bool tensors is not supported. "
            "Use the `^` or `logical_xor()` operator instead."
        )
    return scaled(prims.sub, input, other, alpha)


def rsub(input: Operand, other: Operand, *, alpha: bool | int | float = 1, out: Any = None) -> Value:
    """``torch.rsub``: ``other - alpha * input``."""
    return sub(other, input, alpha=alpha, out=out)


def mul(input: Operand, other: Operand, *, out: Any = None) -> Value:
    no_out(out)
    return apply(prims.mul, input, other)


def _negative(value: Operand) -> Value | bool:
    return prims.lt(value, 0) if isinstance(value, Value) else bool(value < 0)


def _xor(p: Value | bool, q: Value | bool) -> Value | bool:
    """Logical xor where either side may be a known Python bool."""
    if isinstance(p, bool) and isinstance(q, bool):
        return p != q
    if isinstance(p, bool):
        p, q = q, p
    assert isinstance(p, Value)
    if isinstance(q, bool):
        return prims.logical_not(p) if q else p
    return prims.logical_xor(p, q)


def _trunc_div(input: Operand, other: Operand) -> Value:
    (x, y), dtype = common.elementwise(input, other)
    if dtype.is_floating_point:
        return prims.trunc(prims.div(x, y))
    # Integers: floor division, plus one where the remainder is nonzero and the signs differ.
    signs_differ = _xor(_negative(x), _negative(y))
    quotient = prims.floor_div(x, y)
    if signs_differ is False:
        return quotient
    inexact = prims.ne(prims.fmod(x, y), 0)
    if isinstance(signs_differ, Value):
        inexact = prims.logical_and(inexact, signs_differ)
    return prims.add(quotient, prims.convert(inexact, dtype=dtype))


def div(
    input: Operand, other: Operand, *, rounding_mode: str | None = None, out: Any = None
) -> Value:
    no_out(out)
    if rounding_mode is None:
        return apply(prims.div, input, other, int_to_float=True)
    if rounding_mode == "floor":
        return apply(prims.floor_div, input, other)
    if rounding_mode == "trunc":
        return _trunc_div(input, other)
    raise RuntimeError(
        "div expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
        f"'{rounding_mode}'"
    )


def true_divide(input: Operand, other: Operand, *, out: Any = None) -> Value:
    return div(input, other, out=out)


def rdiv(input: Operand, other: Operand) -> Value:
    """``other / input`` from ``Tensor.__rdiv__`` (fp32 under CUDA autocast, as eager)."""
    input, other = common.autocast("rdiv", input, other)
    return div(input, other)


def floor_divide(input: Operand, other: Operand, *, out: Any = None) -> Value:
    return div(input, other, rounding_mode="floor", out=out)


def remainder(input: Operand, other: Operand, *, out: Any = None) -> Value:
    no_out(out)
    return apply(prims.remainder, input, other)


def fmod(input: Operand, other: Operand, *, out: Any = None) -> Value:
    no_out(out)
    return apply(prims.fmod, input, other)


def pow(input: Operand, exponent: Operand, *, out: Any = None) -> Value:  # noqa: A001
    no_out(out)
    input, exponent = common.autocast("pow", input, exponent)
    (base, power), dtype = common.elementwise(input, exponent)
    if isinstance(power, int) and not isinstance(power, bool) and power < 0:
        if not dtype.is_floating_point:
            raise RuntimeError("Integers to negative integer powers are not allowed.")
    return prims.pow(base, power)


def _binary(name: str, prim: Prim, *, int_to_float: bool = False) -> Callable[..., Value]:
    def translate(input: Operand, other: Operand, *, out: Any = None) -> Value:
        no_out(out)
        operands = common.autocast(name, input, other)
        return apply(prim, *operands, int_to_float=int_to_float)

    translate.__name__ = translate.__qualname__ = name
    return translate


def _alpha(dtype: torch.dtype) -> list[dict[str, Any]]:
    if dtype == torch.bool:
        return [{"alpha": True}]
    return [{"alpha": 0.5 if dtype.is_floating_point else 2}]


def _rounding(dtype: torch.dtype) -> list[dict[str, Any]]:
    if dtype == torch.bool:
        return []
    return [{"rounding_mode": "trunc"}, {"rounding_mode": "floor"}, {"rounding_mode": None}]


DIVISOR = Span(nonzero=True)
register_binary(
    add, ["add"], ALL, operators=["__add__"], reflections=["__radd__"],
    inplace_operators=["__iadd__"], kwargs=_alpha,
)
register_binary(
    sub, ["sub", "subtract"], NUMERIC, operators=["__sub__"], reflections=["__rsub__"],
    inplace_operators=["__isub__"], kwargs=_alpha,
)
translation(torch.rsub, samples=binary_calls(kwargs=_alpha, partners=NUMERIC), dtypes=NUMERIC)(rsub)
register_binary(
    mul, ["mul", "multiply"], ALL, operators=["__mul__"], reflections=["__rmul__"],
    inplace_operators=["__imul__"],
)
register_binary(
    div, ["div", "divide"], ALL, operators=["__truediv__", "__div__"],
    inplace_operators=["__itruediv__"], inplace_dtypes=FLOATS, rhs=DIVISOR, kwargs=_rounding,
)
register_binary(true_divide, ["true_divide"], ALL, inplace_dtypes=FLOATS, rhs=DIVISOR)
translation(
    *methods(["__rdiv__", "__rtruediv__"]),
    samples=binary_calls(DIVISOR, partners=ALL, float_scalar=True),
    dtypes=ALL,
)(reflected(rdiv))
register_binary(
    floor_divide, ["floor_divide"], NUMERIC, operators=["__floordiv__"],
    reflections=["__rfloordiv__"], inplace_operators=["__ifloordiv__"], rhs=DIVISOR,
)
register_binary(
    remainder, ["remainder"], NUMERIC, operators=["__mod__"], reflections=["__rmod__"],
    inplace_operators=["__imod__"], rhs=DIVISOR,
)
register_binary(fmod, ["fmod"], NUMERIC, rhs=DIVISOR)
register_binary(
    pow, ["pow"], NUMERIC, operators=["__pow__"], reflections=["__rpow__"],
    inplace_operators=["__ipow__"], rhs=Span(low=0, high=3),
)
register_binary(
    _binary("atan2", prims.atan2, int_to_float=True), ["atan2", "arctan2"], NUMERIC,
    inplace_dtypes=FLOATS, scalar=False,
)
for _name, _prim in (("maximum", prims.maximum), ("minimum", prims.minimum)):
    register_binary(_binary(_name, _prim), [_name], ALL, scalar=False)


# ---------------------------------------------------------------------------------------------
# comparisons, logical and bitwise ops

_COMPARISONS = (
    ("eq", prims.eq, ()),
    ("ne", prims.ne, ("not_equal",)),
    ("lt", prims.lt, ("less",)),
    ("le", prims.le, ("less_equal",)),
    ("gt", prims.gt, ("greater",)),
    ("ge", prims.ge, ("greater_equal",)),
)
for _name, _prim, _aliases in _COMPARISONS:
    register_binary(
        _binary(_name, _prim), [_name, *_aliases], ALL, operators=[f"__{_name}__"]
    )

for _name, _prim in (
    ("logical_and", prims.logical_and),
    ("logical_or", prims.logical_or),
    ("logical_xor", prims.logical_xor),
):
    register_binary(_binary(_name, _prim), [_name], ALL, scalar=False)

for _name, _prim, _dunder in (
    ("bitwise_and", prims.bitwise_and, "and"),
    ("bitwise_or", prims.bitwise_or, "or"),
    ("bitwise_xor", prims.bitwise_xor, "xor"),
):
    register_binary(
        _binary(_name, _prim), [_name], INTS | BOOL, operators=[f"__{_dunder}__"],
        reflections=[f"__r{_dunder}__"], inplace_operators=[f"__i{_dunder}__"],
    )

for _name, _prim, _dunder in (
    ("bitwise_left_shift", prims.shift_left, "lshift"),
    ("bitwise_right_shift", prims.shift_right, "rshift"),
):
    register_binary(
        _binary(_name, _prim), [_name], INTS, operators=[f"__{_dunder}__"],
        reflections=[f"__r{_dunder}__"], inplace_operators=[f"__i{_dunder}__"],
        rhs=Span(low=0, high=5),
    )
