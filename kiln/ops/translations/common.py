"""Eager PyTorch's conveniences, expressed in prims: promotion, broadcasting, dims, autocast.

Prims are strict (equal shapes, equal dtypes); these helpers are how translations reproduce
what eager PyTorch does implicitly, so every translation gets them right the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from kiln.ir.builder import require_builder
from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ir.types import Shape, hint_shape, same_shape, same_size
from kiln.ops import prims

Operand = Value | bool | int | float | Sym


def normalize_dim(dim: int, rank: int, op: str = "op") -> int:
    """``dim`` in ``[0, rank)``, wrapping negatives; IndexError like PyTorch otherwise."""
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        raise IndexError(
            f"{op}: Dimension out of range (expected to be in range of [{-bound}, {bound - 1}],"
            f" but got {dim})"
        )
    return dim % bound


def normalize_dims(dims: int | Sequence[int] | None, rank: int, op: str = "op") -> tuple[int, ...]:
    """Sorted unique non-negative dims; ``None`` means all dims."""
    if dims is None:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({normalize_dim(d, rank, op) for d in dims}))


def _meta(operand: Any) -> Any:
    if isinstance(operand, Value):  # (only the rank and dtype matter: sizes at their hints)
        return torch.empty(hint_shape(operand.type.shape), dtype=operand.type.dtype, device="meta")
    if isinstance(operand, Sym):
        return operand.hint  # (an int, whatever its value)
    return operand


def result_dtype(*operands: Any) -> torch.dtype:
    """PyTorch's result type of an elementwise op on ``operands`` (Values and Python scalars)."""
    metas = [_meta(o) for o in operands if o is not None]
    dtype = torch.result_type(metas[0], metas[1]) if len(metas) > 1 else _dtype_of(metas[0])
    for extra in metas[2:]:
        dtype = torch.promote_types(dtype, torch.result_type(torch.empty((), dtype=dtype), extra))
    return dtype


def _dtype_of(meta: Any) -> torch.dtype:
    if isinstance(meta, torch.Tensor):
        return meta.dtype
    return torch.result_type(torch.empty((), dtype=torch.bool), meta)


def float_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an int-to-float op computes in: ``dtype`` if floating, else the default float."""
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


@overload
def convert(value: Value, dtype: torch.dtype) -> Value: ...
@overload
def convert(value: bool | int | float | Sym, dtype: torch.dtype) -> bool | int | float | Sym: ...
def convert(value: Operand, dtype: torch.dtype) -> Operand:
    """``value`` as ``dtype``; a no-op when it already is; Python scalars pass through. A
    symbolic size stays one (an int scalar, which prims take for a float tensor too)."""
    if not isinstance(value, Value):
        if dtype == torch.bool:
            return bool(value)
        if isinstance(value, Sym):
            return value
        if not dtype.is_floating_point and isinstance(value, bool):
            return int(value)
        if dtype.is_floating_point and not isinstance(value, float):
            return float(value)
        return value
    if value.type.dtype == dtype:
        return value
    return prims.convert(value, dtype=dtype)


def size_scalar(size: int | float | Sym) -> float | Sym:
    """A size (an element count) as a float operand (``div(total, 12.0)``); a symbolic size
    stays symbolic, an int scalar whose value each call's sizes give."""
    return size if isinstance(size, Sym) else float(size)


def broadcast_shapes(*shapes: Shape) -> Shape:
    """PyTorch's broadcast of ``shapes``; RuntimeError naming the sizes when they clash."""
    rank = max((len(s) for s in shapes), default=0)
    result: list[Any] = []
    for axis in range(-rank, 0):
        dims = [shape[axis] for shape in shapes if -axis <= len(shape)]
        if all(same_size(dim, dims[0]) for dim in dims[1:]):
            result.append(dims[0])  # (no question asked of a symbolic size: no guard)
            continue
        size: Any = 1
        for dim in dims:
            if dim == 1:
                continue
            if size not in (1, dim):
                raise RuntimeError(
                    f"The size of tensor a ({size}) must match the size of tensor b ({dim}) at "
                    f"non-singleton dimension {axis + rank}"
                )
            size = dim
        result.append(size)
    return tuple(result)


def broadcast_to(value: Value, shape: Shape) -> Value:
    """``value`` broadcast to ``shape`` (new leading dims, size-1 dims expanded)."""
    source = value.type.shape
    if same_shape(source, shape):
        return value
    offset = len(shape) - len(source)
    dims = tuple(range(offset, len(shape)))
    return prims.broadcast(value, shape=tuple(shape), dims=dims)


def broadcast(*operands: Operand) -> list[Operand]:
    """Broadcast the Value operands to their common shape; scalars stay scalars."""
    shapes = [o.type.shape for o in operands if isinstance(o, Value)]
    shape = broadcast_shapes(*shapes)
    return [broadcast_to(o, shape) if isinstance(o, Value) else o for o in operands]


def on_one_device(*operands: Operand) -> list[Operand]:
    """Eager lets a 0-d CPU tensor join tensors on another device (it reads it as a scalar:
    ``x_cuda / torch.tensor(8.0).sqrt()``); prims take one device, so it is moved there (a
    PyTorch copy). Any other mix is left for the prim to reject, as eager does."""
    values = [o for o in operands if isinstance(o, Value)]
    if len({v.type.device for v in values}) < 2:
        return list(operands)
    others = {v.type.device for v in values if not _cpu_scalar(v)}
    if len(others) != 1:
        return list(operands)
    (device,) = others
    from kiln.ops.externs import extern_call  # (externs imports the translations' table)

    return [
        extern_call(torch.Tensor.to, (o, device)) if isinstance(o, Value) and _cpu_scalar(o) else o
        for o in operands
    ]


def _cpu_scalar(value: Value) -> bool:
    return value.type.rank == 0 and value.type.device.type == "cpu"


def elementwise(
    *operands: Operand, int_to_float: bool = False
) -> tuple[list[Operand], torch.dtype]:
    """Promote and broadcast operands as eager elementwise ops do; returns them and the dtype.

    ``int_to_float`` is for ops that always compute in floating point (``div``, ``exp``...).
    """
    dtype = result_dtype(*operands)
    if int_to_float:
        dtype = float_dtype(dtype)
    converted = [convert(o, dtype) for o in operands]
    return broadcast(*converted), dtype


def full(
    shape: Shape, value: bool | int | float | Sym, dtype: torch.dtype, device: torch.device
) -> Value:
    return prims.full(shape=tuple(shape), value=value, dtype=dtype, device=device)


def with_gradient(value: Value, x: Value, weight: Value, nonfinite: Value | None = None) -> Value:
    """``value`` (elementwise in ``x``) with the gradient ``weight`` at finite ``x``, for eager's
    backward formulas that differ from the derivative of the forward at special points; where
    ``x`` is infinite or NaN, ``nonfinite`` (value and gradient), else ``value`` with no
    gradient. ``weight`` must be finite and not require grad. Without gradients, ``value``."""
    if not x.type.requires_grad:
        return value
    with torch.no_grad():
        frozen_value = prims.convert(value, dtype=value.type.dtype)
        frozen_x = prims.convert(x, dtype=x.type.dtype)
        finite = prims.eq(prims.sub(frozen_x, frozen_x), 0.0)
        frozen_carrier = prims.where(finite, frozen_x, 0.0)
    carrier = prims.where(finite, x, 0.0)  # x's gradient, finite values only
    nothing = prims.mul(prims.sub(frozen_carrier, carrier), weight)  # 0, gradient -weight
    nothing = prims.add(nothing, 0.0)  # (+0.0, so value's signed zeros survive the subtraction)
    result = prims.sub(frozen_value, nothing)
    if nonfinite is not None:
        result = prims.where(finite, result, nonfinite)
    return result


def root(value: Value, exponent: float = 0.5) -> Value:
    """``value ** exponent`` of a non-negative ``value`` (a sum of squares or powers) whose
    gradient at 0 is 0, not infinite: eager's norm and std backward mask it there, so a
    zero vector's norm passes no NaN back. Without gradients it is the plain root."""
    plain = prims.sqrt if exponent == 0.5 else (lambda v: prims.pow(v, exponent))
    if not value.type.requires_grad:
        return plain(value)
    zero = prims.eq(value, 0.0)
    return prims.where(zero, 0.0, plain(prims.where(zero, 1.0, value)))


def constant(tensor: torch.Tensor) -> Value:
    """A concrete tensor closed over by the program, lifted into a graph input."""
    return require_builder().constant(tensor)


# Autocast policies, by device type, keyed by the names translations pass (see autocast()).
# From PyTorch's autocast op lists (torch/csrc/autograd/autocast_mode.cpp and the AMP docs).
# The lower-precision list is the same on CPU and CUDA.
_LOWER_PRECISION = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "conv",
        "conv_transpose",
        "sdpa",
        "einsum",
        "prelu",
    }
)
_LOWER = {"cuda": _LOWER_PRECISION, "cpu": _LOWER_PRECISION}
_FP32 = {
    "cuda": {
        "pow",
        "rdiv",
        "acos",
        "asin",
        "cosh",
        "sinh",
        "tan",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log1p",
        "log2",
        "reciprocal",
        "rsqrt",
        "layer_norm",
        "group_norm",
        "norm",
        "softmax",
        "log_softmax",
        "softplus",
        "sum",
        "prod",
        "cumsum",
        "cross_entropy",
        "nll_loss",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "kl_div",
        "binary_cross_entropy_with_logits",
        "cosine_similarity",
        "normalize",
        "dist",
        "softmin",
        "cdist",
        "renorm",
    },
    "cpu": {
        "mse_loss",
        "nll_loss",
        "cross_entropy",
        "l1_loss",
        "smooth_l1_loss",
        "kl_div",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "prod",
        "cdist",
        "huber_loss",
        "margin_ranking_loss",
    },
}
_PROMOTE = {
    "cuda": {
        "addcdiv",
        "addcmul",
        "atan2",
        "cat",
        "stack",
        "index_put",
        "scatter_add",
        "tensordot",
        "dot",
        "cross",
    },
    "cpu": {"cat", "stack", "index_copy"},
}


def autocast(name: str, *operands: Any) -> list[Any]:
    """Apply the active ``torch.autocast`` policy of op ``name`` to its operands, as eager does.

    Lower-precision ops cast floating operands (except float64) to the autocast dtype; fp32 ops
    cast floating operands to float32; promote ops cast them to their widest floating type.
    Non-Value operands (None, scalars, lists) pass through.
    """
    values = [o for o in operands if isinstance(o, Value)]
    if not values:
        return list(operands)
    device_type = values[0].type.device.type
    if device_type not in _LOWER or not torch.is_autocast_enabled(device_type):
        return list(operands)
    target: torch.dtype | None = None
    if name in _LOWER[device_type]:
        target = torch.get_autocast_dtype(device_type)
    elif name in _FP32[device_type]:
        target = torch.float32
    elif name in _PROMOTE[device_type]:
        floats = [v.type.dtype for v in values if v.type.dtype.is_floating_point]
        if floats:
            target = floats[0]
            for dtype in floats[1:]:
                target = torch.promote_types(target, dtype)
    if target is None:
        return list(operands)
    return [
        convert(o, target)
        if isinstance(o, Value) and o.type.dtype.is_floating_point and o.type.dtype != torch.float64
        else o
        for o in operands
    ]
