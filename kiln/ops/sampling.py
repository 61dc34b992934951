"""Fresh random sample tensors for the table-driven op tests (never all zeros)."""

from __future__ import annotations

import torch

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
INTS = frozenset({torch.int32, torch.int64})
BOOL = frozenset({torch.bool})
NUMERIC = FLOATS | INTS
ALL = NUMERIC | BOOL


def make_tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    low: float | None = None,
    high: float | None = None,
    nonzero: bool = False,
) -> torch.Tensor:
    """A random tensor: uniform in [low, high) (defaults: [-3, 3) floats, [-9, 10) ints)."""
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        lo = -3.0 if low is None else low
        hi = 3.0 if high is None else high
        values = torch.rand(shape, device=device, dtype=torch.float32) * (hi - lo) + lo
        if nonzero:
            values = torch.where(values.abs() < 0.1, torch.full_like(values, 0.5), values)
        return values.to(dtype)
    lo_i = -9 if low is None else int(low)
    hi_i = 10 if high is None else int(high)
    values = torch.randint(lo_i, hi_i, shape, device=device, dtype=torch.int64)
    if nonzero:
        values = torch.where(values == 0, torch.ones_like(values), values)
    return values.to(dtype)


def scalar_for(dtype: torch.dtype) -> bool | int | float:
    """A Python scalar operand that does not promote a tensor of ``dtype``."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return 1.5
    return 3
