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
from kiln.ir.symbolic import Sym
from kiln.ops import prims
from kiln.ops.sampling import ALL, BOOL, FLOATS, INTS, NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.elementwise_cases import (
    ANYWHERE,
    KwargsFn,
    Span,
    binary_calls,
    inplace_calls,
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


def scale(value: Operand, factor: bool | int | float | Sym) -> Operand:
    """``value * factor``, folded in Python for a scalar ``value``."""
    if isinstance(value, Value):
        return prims.mul(value, common.convert(factor, value.type.dtype))
    if isinstance(value, float) or isinstance(factor, float):
        return float(value) * float(factor)  # (what a symbolic size times a float gives)
    return value * factor


def round_scalar(value: Operand, dtype: torch.dtype) -> Operand:
    """A Python float rounded to ``dtype`` (eager casts scalar operands to the tensor's dtype)."""
    if isinstance(value, float) and dtype in REDUCED:
        return float(torch.tensor(value, dtype=dtype))
    return value


def _is_cpu_scalar(value: Operand) -> bool:
    """A Python scalar or a 0-d tensor: eager's reduced-precision kernels read it in float32."""
    return not isinstance(value, Value) or value.type.rank == 0


def opmath_binary(
    prim: Prim, input: Operand, other: Operand, *, int_to_float: bool = False
) -> Value:
    """``prim`` as eager's float16/bfloat16 ``mul``/``div`` kernels compute it: in float32, on
    ``input`` rounded to the dtype and on ``other`` at its own precision when it is a Python
    scalar or 0-d tensor, rounded once. Other dtypes: plain :func:`apply`."""
    dtype = common.result_dtype(input, other)
    dtype = common.float_dtype(dtype) if int_to_float else dtype
    if dtype not in REDUCED:
        return apply(prim, input, other, int_to_float=int_to_float)
    wide = torch.float32
    first = common.convert(common.convert(round_scalar(input, dtype), dtype), wide)
    second = other if _is_cpu_scalar(other) else common.convert(other, dtype)
    a, b = common.broadcast(first, common.convert(second, wide))
    return common.convert(prim(a, b), dtype)


def reciprocal_of(x: Value) -> Value:
    return prims.reciprocal(common.convert(x, common.float_dtype(x.type.dtype)))


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
    lhs: Span = ANYWHERE,
    rhs: Span = ANYWHERE,
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
    """``prim(input, alpha * other)`` (add and sub); for float16/bfloat16 eager rounds a scalar
    ``other`` and ``alpha`` to the dtype and computes in float32."""
    (x, y), dtype = common.elementwise(input, other)
    _check_alpha(alpha, dtype)
    if alpha is True or (alpha == 1 and not isinstance(alpha, bool)):
        return prim(x, y)
    wide = opmath_dtype(dtype)
    y = common.convert(round_scalar(y, dtype), wide)
    factor = round_scalar(alpha, dtype)
    assert not isinstance(factor, Value)
    result = prim(common.convert(x, wide), scale(y, factor))
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


def rsub(
    input: Operand, other: Operand, *, alpha: bool | int | float = 1, out: Any = None
) -> Value:
    """``torch.rsub``: ``other - alpha * input``."""
    return sub(other, input, alpha=alpha, out=out)


def mul(input: Operand, other: Operand, *, out: Any = None) -> Value:
    no_out(out)
    return opmath_binary(prims.mul, input, other)


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
        if dtype in REDUCED and (not isinstance(other, Value) or other.type.numel() == 1):
            # Eager's kernel reads a one-element divisor as a float32 scalar.
            return opmath_binary(lambda a, b: prims.trunc(prims.div(a, b)), input, other)
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
        return opmath_binary(prims.div, input, other, int_to_float=True)
    if rounding_mode == "floor":
        return opmath_binary(prims.floor_div, input, other)
    if rounding_mode == "trunc":
        return _trunc_div(input, other)
    raise RuntimeError(
        "div expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
        f"'{rounding_mode}'"
    )


def true_divide(input: Operand, other: Operand, *, out: Any = None) -> Value:
    return div(input, other, out=out)


def rdiv(self: Value, other: Operand) -> Operand:
    """``Tensor.__rdiv__(self, other)``, ``other / self``: eager computes
    ``self.reciprocal() * other`` (in float32 under CUDA autocast)."""
    if not isinstance(other, Value | bool | int | float):
        return NotImplemented
    self, other = common.autocast("rdiv", self, other)
    return mul(reciprocal_of(self), other)


def _requires_grad(operand: Operand) -> bool:
    return isinstance(operand, Value) and operand.type.requires_grad


def floor_divide(input: Operand, other: Operand, *, out: Any = None) -> Value:
    if _requires_grad(input) or _requires_grad(other):
        # Eager's floor_divide has no derivative (``div(rounding_mode="floor")`` does): its
        # backward must raise, as PyTorch's own call will.
        raise FallbackToExtern
    return div(input, other, rounding_mode="floor", out=out)


def remainder(input: Operand, other: Operand, *, out: Any = None) -> Value:
    no_out(out)
    if _requires_grad(other):
        raise FallbackToExtern  # eager's remainder has no derivative for ``other``
    return apply(prims.remainder, input, other)


def fmod(input: Operand, other: Operand, *, out: Any = None) -> Value:
    no_out(out)
    return apply(prims.fmod, input, other)


def pow(input: Operand, exponent: Operand, *, out: Any = None) -> Value:
    no_out(out)
    input, exponent = common.autocast("pow", input, exponent)
    (base, power), dtype = common.elementwise(input, exponent)
    negative = isinstance(power, int) and not isinstance(power, bool) and power < 0
    if negative and not dtype.is_floating_point:
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
    add,
    ["add"],
    ALL,
    operators=["__add__"],
    reflections=["__radd__"],
    inplace_operators=["__iadd__"],
    kwargs=_alpha,
)
register_binary(
    sub,
    ["sub", "subtract"],
    NUMERIC,
    operators=["__sub__"],
    reflections=["__rsub__"],
    inplace_operators=["__isub__"],
    kwargs=_alpha,
)
translation(torch.rsub, samples=binary_calls(kwargs=_alpha, partners=NUMERIC), dtypes=NUMERIC)(rsub)
register_binary(
    mul,
    ["mul", "multiply"],
    ALL,
    operators=["__mul__"],
    reflections=["__rmul__"],
    inplace_operators=["__imul__"],
)
register_binary(
    div,
    ["div", "divide"],
    ALL,
    operators=["__truediv__", "__div__"],
    inplace_operators=["__itruediv__"],
    inplace_dtypes=FLOATS,
    rhs=DIVISOR,
    kwargs=_rounding,
)
register_binary(true_divide, ["true_divide"], ALL, inplace_dtypes=FLOATS, rhs=DIVISOR)
translation(
    *methods(["__rdiv__", "__rtruediv__"]),
    samples=binary_calls(DIVISOR, partners=ALL, float_scalar=True),
    dtypes=ALL,
)(rdiv)
register_binary(
    floor_divide,
    ["floor_divide"],
    NUMERIC,
    operators=["__floordiv__"],
    reflections=["__rfloordiv__"],
    inplace_operators=["__ifloordiv__"],
    rhs=DIVISOR,
)
register_binary(
    remainder,
    ["remainder"],
    NUMERIC,
    operators=["__mod__"],
    reflections=["__rmod__"],
    inplace_operators=["__imod__"],
    rhs=DIVISOR,
)
register_binary(fmod, ["fmod"], NUMERIC, rhs=DIVISOR)
register_binary(
    pow,
    ["pow"],
    NUMERIC,
    operators=["__pow__"],
    reflections=["__rpow__"],
    inplace_operators=["__ipow__"],
    rhs=Span(low=0, high=3),
)
register_binary(
    _binary("atan2", prims.atan2, int_to_float=True),
    ["atan2", "arctan2"],
    NUMERIC,
    inplace_dtypes=FLOATS,
    scalar=False,
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
    register_binary(_binary(_name, _prim), [_name, *_aliases], ALL, operators=[f"__{_name}__"])

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
        _binary(_name, _prim),
        [_name],
        INTS | BOOL,
        operators=[f"__{_dunder}__"],
        reflections=[f"__r{_dunder}__"],
        inplace_operators=[f"__i{_dunder}__"],
    )

for _name, _prim, _dunder in (
    ("bitwise_left_shift", prims.shift_left, "lshift"),
    ("bitwise_right_shift", prims.shift_right, "rshift"),
):
    register_binary(
        _binary(_name, _prim),
        [_name],
        INTS,
        operators=[f"__{_dunder}__"],
        reflections=[f"__r{_dunder}__"],
        inplace_operators=[f"__i{_dunder}__"],
        rhs=Span(low=0, high=5),
    )
