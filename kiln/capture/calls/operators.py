"""Operators on instances of Python classes: their dunder methods are inlined.

``a * 3``, ``a < b``, ``-a``, ``if a:``, ``x in a`` and ``operator.mul(a, 3)`` on an object
whose class implements the operation in Python run that method through capture, like any
other call, so what it reads is guarded. Run natively, the result of the first call was baked
into the code: a silent stale result once the object changed. Python's own rules are kept:
the reflected method (``__rmul__``) when the left one is missing or says ``NotImplemented``,
the right operand first when its class is a subclass overriding it, ``__iadd__`` falling back
to ``__add__``, ``!=`` from ``__eq__``, and ``==`` by identity when neither side answers.

Operations on tensors, proxies, symbolic sizes and builtin values keep running natively (they
are what capture models); only a Python-level dunder of a user class is inlined.
"""

from __future__ import annotations

import operator
import types
from typing import Any

import torch

from kiln.capture.calls import registry
from kiln.capture.calls.native import native, python_dunder
from kiln.capture.core.frame import Frame
from kiln.ir.symbolic import Sym

NATIVE = object()  # "no Python dunder to inline: compute natively"

BINARY: dict[Any, tuple[str, str]] = {
    operator.add: ("__add__", "__radd__"),
    operator.sub: ("__sub__", "__rsub__"),
    operator.mul: ("__mul__", "__rmul__"),
    operator.truediv: ("__truediv__", "__rtruediv__"),
    operator.floordiv: ("__floordiv__", "__rfloordiv__"),
    operator.mod: ("__mod__", "__rmod__"),
    operator.pow: ("__pow__", "__rpow__"),
    operator.matmul: ("__matmul__", "__rmatmul__"),
    operator.and_: ("__and__", "__rand__"),
    operator.or_: ("__or__", "__ror__"),
    operator.xor: ("__xor__", "__rxor__"),
    operator.lshift: ("__lshift__", "__rlshift__"),
    operator.rshift: ("__rshift__", "__rrshift__"),
    divmod: ("__divmod__", "__rdivmod__"),
    operator.lt: ("__lt__", "__gt__"),
    operator.le: ("__le__", "__ge__"),
    operator.gt: ("__gt__", "__lt__"),
    operator.ge: ("__ge__", "__le__"),
    operator.eq: ("__eq__", "__eq__"),
    operator.ne: ("__ne__", "__ne__"),
}
# In-place operator -> (its dunder, the binary operator it falls back to).
INPLACE: dict[Any, tuple[str, Any]] = {
    getattr(operator, f"i{name.rstrip('_')}"): (f"__i{name.rstrip('_')}__", getattr(operator, name))
    for name in (*("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"),
                 *("and_", "or_", "xor", "lshift", "rshift"))
}  # fmt: skip
UNARY: dict[Any, str] = {
    operator.neg: "__neg__",
    operator.pos: "__pos__",
    operator.invert: "__invert__",
    operator.abs: "__abs__",
}


def plain(value: Any) -> bool:
    """Values whose operators capture computes natively (tensors, sizes, builtin values)."""
    return isinstance(value, torch.Tensor | Sym) or not type(value).__flags__ & _HEAP_TYPE


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def operate(frame: Frame, fn: Any, *operands: Any) -> Any:
    """``fn(*operands)``, a Python dunder of a user class inlined (see the module docstring)."""
    if all(plain(value) for value in operands):
        return fn(*operands)
    if fn in UNARY:
        method = python_dunder(operands[0], UNARY[fn])
        return fn(*operands) if method is None else _inline(frame, method, operands[0])
    if fn in INPLACE:
        name, binary = INPLACE[fn]
        method = python_dunder(operands[0], name)
        if method is not None:
            result = _inline(frame, method, *operands)
            if result is not NotImplemented:
                return result
        elif hasattr(type(operands[0]), name):  # a native in-place method (a list's +=)
            return fn(*operands)
        return operate(frame, binary, *operands)
    if fn in BINARY and len(operands) == 2:
        result = _binary(frame, fn, *operands)
        return fn(*operands) if result is NATIVE else result
    return fn(*operands)


def _binary(frame: Frame, fn: Any, left: Any, right: Any) -> Any:
    forward, reflected = BINARY[fn]
    if python_dunder(left, forward) is None and python_dunder(right, reflected) is None:
        if fn is operator.ne and python_dunder(left, "__eq__") is not None:
            equal = _binary(frame, operator.eq, left, right)
            return equal if equal is NotImplemented else not equal
        return NATIVE
    attempts = [(left, forward, right)]
    if type(right) is not type(left):
        attempts.append((right, reflected, left))
        if issubclass(type(right), type(left)) and _overrides(type(right), type(left), reflected):
            attempts.reverse()
    for obj, name, other in attempts:
        method = getattr(type(obj), name, None)
        if method is None:
            continue
        if name == "__ne__" and method is object.__ne__ and python_dunder(obj, "__eq__"):
            equal = _inline(frame, python_dunder(obj, "__eq__"), obj, other)
            result = equal if equal is NotImplemented else not equal
        elif isinstance(method, types.FunctionType) and python_dunder(obj, name) is method:
            result = _inline(frame, method, obj, other)
        else:
            result = method(obj, other)
        if result is not NotImplemented:
            return result
    if fn in (operator.eq, operator.ne):
        return (left is right) == (fn is operator.eq)
    raise TypeError(
        f"unsupported operand type(s) for {fn.__name__}: "
        f"'{type(left).__name__}' and '{type(right).__name__}'"
    )


def _overrides(sub: type, base: type, name: str) -> bool:
    return getattr(sub, name, None) is not getattr(base, name, None)


def _inline(frame: Frame, method: Any, *args: Any) -> Any:
    return registry.call_function(frame, method, args, {})


def truth(frame: Frame, value: Any) -> bool:
    """``bool(value)`` with a Python ``__bool__`` (or ``__len__``) of a user class inlined."""
    if plain(value):
        return bool(value)
    method = python_dunder(value, "__bool__")
    if method is not None:
        return bool(_inline(frame, method, value))
    method = python_dunder(value, "__len__")
    return bool(value) if method is None else _inline(frame, method, value) != 0


def contains(frame: Frame, container: Any, item: Any) -> bool:
    """``item in container`` with a Python ``__contains__`` inlined."""
    method = None if plain(container) else python_dunder(container, "__contains__")
    return item in container if method is None else bool(_inline(frame, method, container, item))


def _operator_model(fn: Any) -> registry.Model:
    def model(frame: Frame, *args: Any) -> Any:
        if all(plain(value) for value in args):
            return native(frame, fn, args, {})  # (containers from outside: their items' proxies)
        return operate(frame, fn, *args)

    return model


for _fn in (*BINARY, *INPLACE, *UNARY):
    registry.MODELS[_fn] = _operator_model(_fn)
