"""The correctness column: how far a compiled run's tensors are from eager's.

The error of one tensor is ``max|actual - expected| / max|expected|``: relative to the tensor's
scale, so it reads the same for logits and for gradients. A tensor whose values are all
near zero would turn rounding noise into a huge relative error (a key projection's bias has a
gradient of exactly zero in exact arithmetic, since softmax ignores a per-row shift), so the
denominator never drops below ``FLOOR`` times the largest magnitude of the whole set.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOOR = 1e-3

# Largest acceptable error per compute dtype: fp32 differs from eager only by summation order;
# half precisions round every fused intermediate differently.
TOLERANCES = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def max_relative_error(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """The largest per-tensor relative error (``inf`` for a shape mismatch or a count mismatch,
    ``nan`` where a result has NaNs that eager does not). Computed in fp32: a result's error
    against eager is far above fp32's rounding, and fp64 copies of GPT-2's logits would not
    fit comfortably in memory."""
    if len(actual) != len(expected):
        return float("inf")
    scale = max((_magnitude(tensor) for tensor in expected), default=0.0)
    worst = 0.0
    for got, want in zip(actual, expected, strict=True):
        if got.shape != want.shape:
            return float("inf")
        got, want = got.float(), want.float()
        if bool(torch.isnan(got).ne(torch.isnan(want)).any()):
            return float("nan")
        finite = ~torch.isnan(want)
        difference = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        denominator = max(_magnitude(want), FLOOR * scale, 1e-30)
        worst = max(worst, difference / denominator)
    return worst


def max_relative_norm_error(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]
) -> float:
    """The largest per-tensor ``||result - eager|| / ||eager||`` (training's loss and gradients).

    Elementwise maxima are the wrong measure for gradients of deep train-mode BatchNorm
    networks: summation order and TF32 convolutions make a few gradient entries differ by tens
    of percent (for torch.compile exactly as for Kiln) while the gradient as a vector agrees to
    a fraction of a percent. The floor of the denominator is as in :func:`max_relative_error`.
    """
    if len(actual) != len(expected):
        return float("inf")
    norms = [float(t.float().norm()) for t in expected]
    scale = max(norms, default=0.0)
    worst = 0.0
    for got, want, norm in zip(actual, expected, norms, strict=True):
        if got.shape != want.shape:
            return float("inf")
        difference = float((got.float() - want.float()).norm())
        if difference != difference:
            return float("nan")
        worst = max(worst, difference / max(norm, FLOOR * scale, 1e-30))
    return worst


def _magnitude(tensor: torch.Tensor) -> float:
    values = tensor.float().abs()
    values = values[~torch.isnan(values)]
    return float(values.max().item()) if values.numel() else 0.0


def passes(error: float, dtype: torch.dtype) -> bool:
    """Whether ``error`` is within the tolerance of ``dtype`` (NaN never passes)."""
    return error <= TOLERANCES.get(dtype, 1e-3)
