"""Output types of the common externs by formula, without running PyTorch on meta tensors.

An extern's meta runs its PyTorch function on tensors without data (``meta_by_running``). The
first such call in a process imports PyTorch's meta registrations, about a second: a visible
share of a model's first call. Matmuls, convolutions and attention, which every model has, get
their output type from the usual formulas here, and so do generic externs whose function
registered one in ``EXTERN_FORMULAS`` (the CPU flash attention a training graph calls).
Anything irregular (mismatched shapes or dtypes, unbatched or transposed convolutions,
grouped-query attention) returns None, and the meta runs PyTorch after all, so errors are
still eager's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.ir.op import Op
from kiln.ir.types import FLOATING, Shape, TensorType

Shapes = tuple[Shape, ...]


def _static(*operands: Any) -> Shapes | None:
    """The shapes of tensor operands of one floating dtype and device (symbolic sizes too: the
    formulas compare them, which guards a symbolic size)."""
    tensors = [o for o in operands if isinstance(o, TensorType)]
    if not tensors:
        return None
    first = tensors[0]
    if first.dtype not in FLOATING:
        return None
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return None
    return tuple(tuple(t.shape) for t in tensors)


def _result(like: TensorType, shape: Shape) -> TensorType:
    return TensorType(tuple(shape), like.dtype, like.device)


def _broadcasts(shape: Shape, target: Shape) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False))


def _mm(attrs: Any, a: Any, b: Any) -> TensorType | None:
    shapes = _static(a, b)
    if shapes is None or len(shapes[0]) != 2 or len(shapes[1]) != 2:
        return None
    (m, k), (k2, n) = shapes
    return _result(a, (m, n)) if k == k2 else None


def _bmm(attrs: Any, a: Any, b: Any) -> TensorType | None:
    shapes = _static(a, b)
    if shapes is None or len(shapes[0]) != 3 or len(shapes[1]) != 3:
        return None
    (batch, m, k), (batch2, k2, n) = shapes
    return _result(a, (batch, m, n)) if (batch, k) == (batch2, k2) else None


def _with_bias(product: Callable[..., TensorType | None]) -> Callable[..., TensorType | None]:
    def meta(attrs: Any, bias: Any, a: Any, b: Any) -> TensorType | None:
        result = product(attrs, a, b)
        if result is None or not isinstance(bias, TensorType) or _static(bias, a) is None:
            return None
        fits = _broadcasts(tuple(bias.shape), tuple(result.shape))
        return result if fits else None

    return meta


def _convolution(attrs: Any, x: Any, weight: Any, bias: Any = None) -> TensorType | None:
    shapes = _static(*(o for o in (x, weight, bias) if o is not None))
    if shapes is None or attrs.transposed:
        return None
    x_shape, w_shape = shapes[0], shapes[1]
    spatial = len(w_shape) - 2
    if len(x_shape) != len(w_shape) or spatial < 1 or len(attrs.stride) != spatial:
        return None
    groups = attrs.groups
    if x_shape[1] != w_shape[1] * groups or w_shape[0] % groups:
        return None
    if bias is not None and shapes[2] != (w_shape[0],):
        return None
    sizes = []
    for i in range(spatial):
        extent = attrs.dilation[i] * (w_shape[2 + i] - 1) + 1
        size = (x_shape[2 + i] + 2 * attrs.padding[i] - extent) // attrs.stride[i] + 1
        if size < 1:
            return None
        sizes.append(size)
    return _result(x, (x_shape[0], w_shape[0], *sizes))


def _attention(attrs: Any, q: Any, k: Any, v: Any, mask: Any = None) -> TensorType | None:
    shapes = _static(q, k, v)
    if shapes is None or attrs.enable_gqa:
        return None
    q_shape, k_shape, v_shape = shapes
    if not (len(q_shape) == len(k_shape) == len(v_shape) >= 2):
        return None
    if q_shape[:-2] != k_shape[:-2] or k_shape[:-2] != v_shape[:-2]:
        return None
    if q_shape[-1] != k_shape[-1] or k_shape[-2] != v_shape[-2]:
        return None
    if mask is not None:
        scores = (*q_shape[:-1], k_shape[-2])
        if not isinstance(mask, TensorType) or mask.device != q.device:
            return None
        if mask.dtype not in (q.dtype, torch.bool):
            return None
        if not _broadcasts(tuple(mask.shape), scores):
            return None
    return _result(q, (*q_shape[:-1], v_shape[-1]))


FORMULAS: dict[Op, Callable[..., Any]] = {
    Op.MM: _mm,
    Op.BMM: _bmm,
    Op.ADDMM: _with_bias(_mm),
    Op.BADDBMM: _with_bias(_bmm),
    Op.CONVOLUTION: _convolution,
    Op.SDPA: _attention,
}


# Formulas of generic externs, by the function they call (``kiln.ops.attention`` registers the
# CPU flash kernel's forward and backward): the operand types (a Slot's index picks one) and
# the call's attrs give the result's types, a TensorType or a tuple of them; None: run it.
EXTERN_FORMULAS: dict[Callable[..., Any], Callable[..., Any]] = {}


def extern_result_types(attrs: Any, *operands: Any) -> Any:
    """The result types of a generic extern by its function's formula, or None."""
    formula = EXTERN_FORMULAS.get(attrs.fn)
    return formula(attrs, *operands) if formula is not None else None


FORMULAS[Op.EXTERN] = extern_result_types


def with_formula(op: Op, meta: Callable[..., Any]) -> Callable[..., Any]:
    """``meta`` behind the formula of ``op`` (when it has one and it applies)."""
    formula = FORMULAS.get(op)
    if formula is None:
        return meta

    def fast(attrs: Any, *operands: Any) -> Any:
        result = formula(attrs, *operands)
        return result if result is not None else meta(attrs, *operands)

    return fast
