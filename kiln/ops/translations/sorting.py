"""Scans and orderings: ``cumsum``, ``sort``, ``argsort``, ``msort`` and ``topk``, on the extern
prims ``cumsum``, ``sort`` and ``topk`` (PyTorch's kernels run them).

The translations add dims and dtype rules: ``cumsum`` of bool and integer tensors is int64 (the
prim takes floating or int64 tensors, so int32 and bool convert first), float16/bfloat16 scan in
float32 and round once, as eager does::

    torch.cumsum(x, -1)   # x: i32[3, 4]
    t1 = convert(t0, dtype=torch.int64)
    t2 = cumsum(t1, dim=1)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import ALL, NUMERIC, make_tensor
from kiln.ops.translations import common
from kiln.ops.translations.reductions import Case, calls, compute_dtype
from kiln.ops.translations.table import Call, translation

# ---------------------------------------------------------------------------------------------
# cumsum


def _cumsum(x: Value, dim: int, dtype: torch.dtype | None) -> Value:
    if dtype is None:
        (x,) = common.autocast("cumsum", x)
    result_dtype = dtype or (x.type.dtype if x.type.dtype.is_floating_point else torch.int64)
    x = common.convert(x, result_dtype)
    scan_dtype = compute_dtype(result_dtype) if result_dtype.is_floating_point else torch.int64
    axis = common.normalize_dim(dim, x.type.rank, "cumsum")
    return common.convert(prims.cumsum(common.convert(x, scan_dtype), dim=axis), result_dtype)


CUMSUM_CASES: tuple[Case, ...] = (
    ((3, 4), (1,), {}),
    ((3, 4), (), {"dim": 0}),
    ((2, 3, 4), (-1,), {}),
    ((4, 1), (1,), {}),
    ((), (0,), {}),
    ((0, 4), (0,), {}),
    ((3, 4), (1,), {"dtype": torch.float32}),
)


@translation(torch.cumsum, torch.Tensor.cumsum, samples=calls(CUMSUM_CASES), dtypes=ALL)
def cumsum(input: Value, dim: int, *, dtype: torch.dtype | None = None) -> Value:
    return _cumsum(input, dim, dtype)


@translation(torch.Tensor.cumsum_, samples=calls(CUMSUM_CASES[:-1]), dtypes=NUMERIC, inplace=True)
def cumsum_(input: Value, dim: int, *, dtype: torch.dtype | None = None) -> Value:
    return _cumsum(input, dim, dtype)


# ---------------------------------------------------------------------------------------------
# sort, argsort, msort, topk


def _sort(x: Value, dim: int, descending: bool, stable: bool | None) -> tuple[Value, Value]:
    axis = common.normalize_dim(dim, x.type.rank, "sort")
    values, indices = prims.sort(x, dim=axis, descending=descending, stable=bool(stable))
    return values, indices


SORT_CASES: tuple[Case, ...] = (
    ((3, 5), (), {}),
    ((3, 5), (0,), {}),
    ((2, 3, 4), (-2, True), {}),
    ((2, 3, 4), (), {"dim": 1, "descending": True, "stable": True}),
    ((6, 1), (), {"stable": True}),
    ((), (), {}),
    ((0, 4), (0,), {}),
)


@translation(torch.sort, torch.Tensor.sort, samples=calls(SORT_CASES), dtypes=ALL)
def sort(
    input: Value, dim: int = -1, descending: bool = False, *, stable: bool | None = None
) -> Any:
    return torch.return_types.sort(_sort(input, dim, descending, stable))  # type: ignore[arg-type]


@translation(torch.argsort, torch.Tensor.argsort, samples=calls(SORT_CASES), dtypes=ALL)
def argsort(
    input: Value, dim: int = -1, descending: bool = False, *, stable: bool = False
) -> Value:
    return _sort(input, dim, descending, stable)[1]


@translation(
    torch.msort,
    torch.Tensor.msort,
    samples=calls((((3, 5), (), {}), ((4,), (), {}), ((0, 2), (), {}))),
    dtypes=ALL,
)
def msort(input: Value) -> Value:
    return _sort(input, 0, False, False)[0]


def _topk_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(*shape: int) -> torch.Tensor:
        # distinct values: with ties, which index topk reports is the kernel's choice
        count = math.prod(shape)
        return torch.randperm(2 * count, device=device)[:count].reshape(shape).to(dtype)

    return [
        Call((x(3, 5), 2)),
        Call((x(3, 5), 5, 1, False)),
        Call((x(3, 5), 0)),
        Call((x(2, 3, 4), 1), {"dim": 0, "sorted": False}),
        Call((x(2, 3, 4), 2), {"dim": -2, "largest": False}),
        Call((x(), 1)),
        Call((make_tensor((0, 4), dtype, device), 2)),
    ]


@translation(torch.topk, torch.Tensor.topk, samples=_topk_samples, dtypes=NUMERIC)
def topk(input: Value, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    axis = common.normalize_dim(dim, input.type.rank, "topk")
    values, indices = prims.topk(input, k=k, dim=axis, largest=largest, sorted=sorted)
    return torch.return_types.topk((values, indices))
