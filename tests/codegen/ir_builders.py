"""Loop-level IR built by hand, for the code generators' tests (C++ and Triton alike)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.op import Op
from kiln.schedule.index import Index
from kiln.schedule.loops import Apply, Buffer, BufferKind, Const, Expr, Load

CPU = torch.device("cpu")
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
I8, U8, I32, I64, BOOL = torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool


def buffer(name: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
    return Buffer(name, tuple(shape), dtype, CPU, BufferKind.TEMP)


def apply(op: Op, *args: Expr, dtype: torch.dtype | None = None) -> Apply:
    return Apply(dtype or args[-1].dtype, op, tuple(args))


def const(value: bool | int | float, dtype: torch.dtype = F32) -> Const:
    return Const(dtype, value)


def load(source: Buffer, offset: Index, mask: Expr | None = None, other: Any = 0) -> Load:
    return Load(source.dtype, source, offset, mask, other)
