"""Vector norms in prims: ``torch.linalg.vector_norm``, ``torch.norm``/``Tensor.norm`` (their
vector and Frobenius forms) and ``torch.linalg.norm`` without a matrix ``ord``.

By ``ord``: ``2`` is ``sqrt(sum(x * x))``, ``1`` is ``sum(|x|)``, ``inf``/``-inf`` are
``amax``/``amin`` of ``|x|``, ``0`` counts nonzeros, any other ``p`` is
``sum(|x| ** p) ** (1 / p)``. float16/bfloat16 compute in float32 and round once, as eager does;
the nuclear norm and matrix orders run as PyTorch calls (``FallbackToExtern``)::

    torch.linalg.vector_norm(x, dim=1)   # x: f32[3, 4]
    t1 = mul(t0, t0)
    t2 = sum(t1, dims=(1,))
    t3 = sqrt(t2)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.translations import common
from kiln.ops.translations.math import no_out
from kiln.ops.translations.reductions import (
    Case,
    Dims,
    calls,
    compute_dtype,
    reduce,
    reduction_dims,
    require_float,
    scalar_type_name,
)
from kiln.ops.translations.table import FallbackToExtern, translation


def vector_norm_of(x: Value, ord: float, dims: tuple[int, ...], keepdim: bool) -> Value:
    """The ``ord``-norm of floating ``x`` over ``dims``, in ``x``'s dtype."""
    wide = common.convert(x, compute_dtype(x.type.dtype))
    if ord == 2:
        result = common.root(reduce(prims.sum, prims.mul(wide, wide), dims, keepdim))
    elif ord == 0:
        nonzero = common.convert(prims.ne(wide, 0.0), wide.type.dtype)
        if wide.type.requires_grad:  # (eager's count is differentiable, with a zero gradient)
            nonzero = prims.add(prims.mul(prims.sign(wide), 0.0), nonzero)
        result = reduce(prims.sum, nonzero, dims, keepdim)
    elif ord == 1:
        result = reduce(prims.sum, prims.abs(wide), dims, keepdim)
    elif ord == math.inf:
        result = reduce(prims.amax, prims.abs(wide), dims, keepdim)
    elif ord == -math.inf:
        result = reduce(prims.amin, prims.abs(wide), dims, keepdim)
    else:
        result = common.root(reduce(prims.sum, _powers(wide, float(ord)), dims, keepdim), 1.0 / ord)
    return common.convert(result, x.type.dtype)


def _powers(x: Value, p: float) -> Value:
    """``|x| ** p``. Below ``p = 1`` the power's gradient at 0 is infinite (or NaN); eager's norm
    backward passes 0 there, so with gradients a zero element takes its power as a constant."""
    magnitude = prims.abs(x)
    if p >= 1 or not x.type.requires_grad:
        return prims.pow(magnitude, p)
    zero = prims.eq(x, 0.0)
    at_zero = 0.0 if p > 0 else math.inf
    return prims.where(zero, at_zero, prims.pow(prims.where(zero, 1.0, magnitude), p))


def vector_norm_call(
    op: str, x: Value, ord: float, dim: Dims, keepdim: bool, dtype: torch.dtype | None
) -> Value:
    if dtype is None:
        (x,) = common.autocast("norm", x)
    else:
        x = common.convert(x, dtype)
    require_float(
        x,
        op,
        f"{op}: Expected a floating point or complex tensor as input. "
        f"Got {scalar_type_name(x.type.dtype)}",
    )
    if isinstance(ord, str):
        raise RuntimeError(f"{op}: ord must be a number, got {ord!r}")
    return vector_norm_of(x, ord, reduction_dims(x, dim, op), keepdim)


NORM_CASES: tuple[Case, ...] = (
    ((3, 4), (), {}),
    ((3, 4), (), {"dim": 1}),
    ((2, 3, 4), (), {"dim": (-1, 0), "keepdim": True}),
    ((2, 3, 4), (1,), {"dim": -1}),
    ((3, 4), (math.inf,), {"dim": 0}),
    ((3, 4), (-math.inf,), {"dim": 1, "keepdim": True}),
    ((3, 4), (0,), {}),
    ((3, 4), (3,), {"dim": 1}),
    ((3, 4), (0.5,), {}),
    ((), (), {}),
    ((0, 3), (), {"dim": 0}),
)


@translation(
    torch.linalg.vector_norm, samples=calls((*NORM_CASES, ((3, 4), (), {"dtype": torch.float32})))
)
def vector_norm(
    x: Value,
    ord: float = 2,
    dim: Dims = None,
    keepdim: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> Value:
    return vector_norm_call("linalg.vector_norm", x, ord, dim, keepdim, dtype)


@translation(
    torch.norm,
    torch.Tensor.norm,
    samples=calls((*NORM_CASES, ((3, 4), ("fro",), {"dim": (0, 1)}), ((3, 4), (None,), {}))),
)
def norm(
    input: Value,
    p: float | str | None = "fro",
    dim: Dims = None,
    keepdim: bool = False,
    out: Any = None,
    dtype: torch.dtype | None = None,
) -> Value:
    no_out(out)
    if isinstance(p, str):
        if p != "fro" or not (dim is None or isinstance(dim, int) or len(dim) <= 2):
            raise FallbackToExtern  # nuclear and matrix norms: PyTorch's kernels
        p = 2
    return vector_norm_call("norm", input, 2.0 if p is None else p, dim, keepdim, dtype)


@translation(
    torch.linalg.norm,
    samples=calls(
        (
            ((3, 4), (), {}),
            ((2, 3, 4), (), {"dim": 1, "keepdim": True}),
            ((5,), (3,), {}),
            ((3, 4), ("fro",), {}),
            ((2, 3, 4), (math.inf,), {"dim": -1}),
        )
    ),
)
def linalg_norm(
    A: Value,
    ord: float | str | None = None,
    dim: Dims = None,
    keepdim: bool = False,
    *,
    out: Any = None,
    dtype: torch.dtype | None = None,
) -> Value:
    vector = isinstance(dim, int) or (dim is not None and len(dim) == 1) or A.type.rank == 1
    matrix = (dim is None and A.type.rank == 2) or (dim is not None and not vector)
    chosen: float = 2.0
    if isinstance(ord, str):
        if ord != "fro" or not matrix:
            raise FallbackToExtern  # nuclear norm, or an error PyTorch reports
    elif ord is not None:
        if not vector:
            raise FallbackToExtern  # matrix norms: PyTorch's kernels
        chosen = ord
    no_out(out)
    return vector_norm_call("linalg.norm", A, chosen, dim, keepdim, dtype)
