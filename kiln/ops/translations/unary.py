"""Unary elementwise math in prims: ``exp``, ``log``, ``sqrt``, trigonometry, ``erf``,
``sigmoid``, rounding (``round`` with ``decimals`` too), ``sign``, ``isnan``/``isinf``/
``isfinite``, ``logical_not``/``bitwise_not`` (``~x``), ``abs``/``neg`` (``-x``), ``square``,
``frac``; with their Tensor methods, ``torch.special`` aliases and in-place forms.

Ops that compute in floating point take integers in the default float dtype, as eager does::

    torch.exp(x)           # x: i64[3]
    t1 = convert(x, dtype=torch.float32)
    t2 = exp(t1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import ALL, BOOL, FLOATS, INTS, NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.elementwise_cases import ANYWHERE, KwargsFn, Span, unary_calls
from kiln.ops.translations.math import Prim, keys, methods, no_out, opmath_dtype
from kiln.ops.translations.table import translation


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
    span: Span = ANYWHERE,
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
    (("exp",), prims.exp, ANYWHERE, ()),
    (("exp2",), prims.exp2, ANYWHERE, (torch.special.exp2,)),
    (("expm1",), prims.expm1, ANYWHERE, (torch.special.expm1,)),
    (("log",), prims.log, POSITIVE, ()),
    (("log1p",), prims.log1p, Span(low=-0.9, high=5.0), (torch.special.log1p,)),
    (("log2",), prims.log2, POSITIVE, ()),
    (("log10",), _log10, POSITIVE, ()),
    (("sqrt",), prims.sqrt, POSITIVE, ()),
    (("rsqrt",), prims.rsqrt, POSITIVE, ()),
    (("reciprocal",), prims.reciprocal, Span(low=0.5, high=5.0), ()),
    (("sin",), prims.sin, ANYWHERE, ()),
    (("cos",), prims.cos, ANYWHERE, ()),
    (("tan",), prims.tan, Span(low=-1.2, high=1.2), ()),
    (("tanh",), prims.tanh, ANYWHERE, ()),
    (("asin", "arcsin"), prims.asin, Span(low=-0.95, high=0.95), ()),
    (("acos", "arccos"), prims.acos, Span(low=-0.95, high=0.95), ()),
    (("atan", "arctan"), prims.atan, ANYWHERE, ()),
    (("sinh",), prims.sinh, ANYWHERE, ()),
    (("cosh",), prims.cosh, ANYWHERE, ()),
    (("erf",), prims.erf, ANYWHERE, (torch.special.erf,)),
    (("erfinv",), prims.erfinv, Span(low=-0.9, high=0.9), (torch.special.erfinv,)),
    (("sigmoid",), prims.sigmoid, ANYWHERE, (torch.special.expit,)),
)
for _names, _prim, _span, _extra in _FLOAT_UNARY:
    # Integer inputs compute in the default float dtype, which they cannot be written back to.
    register_unary(
        _unary(_names[0], _prim, floating=True),
        _names,
        NUMERIC | BOOL,
        span=_span,
        inplace_dtypes=FLOATS,
        extra=_extra,
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


def round(input: Value, *, decimals: int = 0, out: Any = None) -> Value:
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
