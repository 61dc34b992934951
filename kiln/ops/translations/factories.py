"""Factories of the ``torch`` namespace: ``zeros``, ``ones``, ``empty``, ``full``, ``arange``,
``eye``, ``tensor``.

With Python sizes they need no translation: they run while tracing and become constants. The
tracer routes them here when a size is symbolic (``torch.ones(t, t)`` for a sequence of length
``t``) or an argument is traced (``torch.full((2, 3), x.max())``), and the result keeps the
symbolic size::

    torch.arange(x.size(1))        # x: f32[4, s0]
    t0 = iota(length=s0, start=0, step=1, dtype=torch.int64, device=device(type='cpu'))
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ops import prims
from kiln.ops.sampling import ALL, NUMERIC, make_tensor
from kiln.ops.translations import common
from kiln.ops.translations.creation import device_of, filled, sizes, unsupported
from kiln.ops.translations.table import Call, FallbackToExtern, translation

Number = bool | int | float | Sym


def _options(options: dict[str, Any], op: str) -> tuple[torch.dtype | None, torch.device]:
    unsupported(options, op)
    if options.get("requires_grad"):
        raise FallbackToExtern  # a new autograd leaf: eager must make it
    return options.get("dtype"), device_of(options.get("device"), torch.get_default_device())


def _filled_factory(value: int, op: str) -> Any:
    def translate(*size: Any, **options: Any) -> Value:
        dtype, device = _options(options, op)
        shape = sizes(options.pop("size", None) or size, op)
        return filled(shape, value, dtype or torch.get_default_dtype(), device)

    translate.__name__ = translate.__qualname__ = op
    return translate


def _fill_dtype(value: Number | Value) -> torch.dtype:
    """The dtype ``torch.full`` infers from its fill value (a 0-d tensor is read as a Python
    number, whatever its own dtype)."""
    if isinstance(value, Value):
        if value.type.dtype == torch.bool:
            return torch.bool
        return torch.get_default_dtype() if value.type.dtype.is_floating_point else torch.int64
    if isinstance(value, bool):
        return torch.bool
    return torch.int64 if isinstance(value, int | Sym) else torch.get_default_dtype()


def _full_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    value = make_tensor((), dtype, device)
    return [Call(((2, 3), value)), Call(((4,), value), {"dtype": dtype}, note="dtype")]


@translation(torch.full, samples=_full_calls, dtypes=ALL)
def full(size: Any, fill_value: Number | Value, **options: Any) -> Value:
    dtype, device = _options(options, "full")
    if isinstance(fill_value, Value):
        if fill_value.type.rank:
            raise RuntimeError("full: fill_value must be a 0-d tensor or a number")
        kind = fill_value.type
        if kind.device != device or kind.dtype.is_complex or kind.requires_grad:
            raise FallbackToExtern  # eager reads the number out of the tensor (no gradient)
    return filled(sizes((size,), "full"), fill_value, dtype or _fill_dtype(fill_value), device)


def _minus(a: Number, b: Number) -> Number:
    """``a - b``; with a float operand a float, as ``Sym.__sub__`` computes it."""
    if isinstance(a, float) or isinstance(b, float):
        return float(a) - float(b)
    return a - b


def _length(start: Number, end: Number, step: Number) -> Any:
    """The number of values of ``arange(start, end, step)``: a formula of ints and symbolic
    sizes, else eager's ``ceil((end - start) / step)`` (a float bound specializes a symbolic
    one, guarded)."""
    if step == 0:
        raise RuntimeError("arange: step must be nonzero")
    if (_minus(end, start) < 0) if step > 0 else (_minus(start, end) < 0):
        raise RuntimeError("arange: upper bound and larger bound inconsistent with step sign")
    if isinstance(start, int | Sym) and isinstance(end, int | Sym) and isinstance(step, int | Sym):
        stride = abs(step)
        return (abs(end - start) + stride - 1) // stride
    return math.ceil((float(end) - float(start)) / float(step))


def _arange_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [Call((5,), {"dtype": dtype}), Call((1, 9, 3), {"dtype": dtype}, note="step")]


@translation(torch.arange, samples=_arange_calls, dtypes=NUMERIC)
def arange(*bounds: Number, **options: Any) -> Value:
    """``arange(end)``, ``arange(start, end)`` or ``arange(start, end, step)``: an iota."""
    dtype, device = _options(options, "arange")
    bounds = (*bounds, *(options.pop(name) for name in ("start", "end", "step") if name in options))
    if any(isinstance(bound, Value) for bound in bounds):
        raise FallbackToExtern  # bounds held by tensors
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (*bounds, 1)[:3]
    integral = all(isinstance(v, int | Sym) for v in (start, end, step))
    dtype = dtype or (torch.int64 if integral else torch.get_default_dtype())
    if not integral and not dtype.is_floating_point:
        raise FallbackToExtern  # float bounds, integer values: eager's rounding
    return prims.iota(
        length=_length(start, end, step), start=start, step=step, dtype=dtype, device=device
    )


def _size_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [Call((2, 3), {"dtype": dtype}), Call(((4,),), {"dtype": dtype}, note="sequence")]


# empty's values are unspecified (zeros here): the test compares its type only.
for _name, _value in (("zeros", 0), ("ones", 1), ("empty", 0)):
    translation(getattr(torch, _name), samples=_size_calls, dtypes=ALL, random=_name == "empty")(
        _filled_factory(_value, _name)
    )


def _eye_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [Call((3, 4), {"dtype": dtype})]


@translation(torch.eye, samples=_eye_calls, dtypes=ALL)
def eye(n: Number, m: Number | None = None, **options: Any) -> Value:
    """Ones where the row index equals the column index: two iotas compared."""
    dtype, device = _options(options, "eye")
    shape = sizes((n, n if m is None else m), "eye")
    rows, columns = (
        prims.iota(length=size, start=0, step=1, dtype=torch.int64, device=device) for size in shape
    )
    diagonal = prims.eq(
        prims.broadcast(rows, shape=shape, dims=(0,)),
        prims.broadcast(columns, shape=shape, dims=(1,)),
    )
    return common.convert(diagonal, dtype or torch.get_default_dtype())


def _tensor_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [Call(([1, 2],), {"dtype": dtype})]


@translation(torch.tensor, samples=_tensor_calls, dtypes=ALL)
def tensor(data: Any, **options: Any) -> torch.Tensor:
    """``torch.tensor(n)`` of a symbolic size: the size specializes (guarded) and the result is
    a constant, as for an int. It is data, and its uses often need its value as a Python number
    (``x[: 512 - span]`` reads ``span.__index__()``), which a graph value would break at."""
    if options.get("requires_grad") or any(
        isinstance(leaf, Value) for leaf in pytree.tree_leaves(data)
    ):
        raise FallbackToExtern  # a copy of a traced tensor, or a new autograd leaf
    values = pytree.tree_map(lambda leaf: int(leaf) if isinstance(leaf, Sym) else leaf, data)
    dtype, device = _options(options, "tensor")
    return torch.tensor(values, dtype=dtype, device=device)
