"""The correctness column: how far a compiled run's tensors are from eager's.

The error of one tensor is ``max|actual - expected| / max|expected|``: relative to the tensor's
scale, so it reads the same for logits and for gradients. A tensor whose values are all
near zero would turn rounding noise into a huge relative error (a key projection's bias has a
gradient of exactly zero in exact arithmetic, since softmax ignores a per-row shift), so the
denominator never drops below ``FLOOR`` times the largest magnitude of the whole set.

Some tensors are rounding noise in eager too: in a train-mode BatchNorm network, the gradient
of a BatchNorm bias whose output feeds another train-mode BatchNorm is zero up to border
effects, so bf16 eager and any compiler disagree on it by 100%+. For those the worker also has
a float64 run of eager (the "oracle"): a tensor outside the tolerance against eager still
passes when it is within ``ORACLE_FACTOR`` times eager's own distance from the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOOR = 1e-3
ORACLE_FACTOR = 2.0

# Largest acceptable error per compute dtype: fp32 differs from eager only by summation order;
# half precisions round every fused intermediate differently.
TOLERANCES = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def relative_errors(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]
) -> list[float]:
    """Per tensor, ``max|actual - expected|`` over its scale (``inf`` for a shape mismatch,
    ``nan`` where a result has NaNs that the expected one does not). Computed in fp32: a
    result's error against eager is far above fp32's rounding, and fp64 copies of GPT-2's
    logits would not fit comfortably in memory."""
    if len(actual) != len(expected):
        return [float("inf")]
    scale = max((_magnitude(tensor) for tensor in expected), default=0.0)
    errors = []
    for got, want in zip(actual, expected, strict=True):
        if got.shape != want.shape:
            errors.append(float("inf"))
            continue
        got, want = got.float(), want.float()
        if bool(torch.isnan(got).ne(torch.isnan(want)).any()):
            errors.append(float("nan"))
            continue
        finite = ~torch.isnan(want)
        difference = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        errors.append(difference / max(_magnitude(want), FLOOR * scale, 1e-30))
    return errors


def relative_norm_errors(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]
) -> list[float]:
    """Per tensor, ``||actual - expected|| / ||expected||`` (training's loss and gradients).

    Elementwise maxima are the wrong measure for gradients of deep train-mode BatchNorm
    networks: summation order and TF32 convolutions make a few gradient entries differ by tens
    of percent (for torch.compile exactly as for Kiln) while the gradient as a vector agrees to
    a fraction of a percent. The floor of the denominator is as in :func:`relative_errors`.
    """
    if len(actual) != len(expected):
        return [float("inf")]
    norms = [float(t.float().norm()) for t in expected]
    scale = max(norms, default=0.0)
    errors = []
    for got, want, norm in zip(actual, expected, norms, strict=True):
        if got.shape != want.shape:
            errors.append(float("inf"))
            continue
        difference = float((got.float() - want.float()).norm())
        errors.append(difference / max(norm, FLOOR * scale, 1e-30))
    return errors


def _worst(errors: Sequence[float]) -> float:
    if any(error != error for error in errors):
        return float("nan")
    return max(errors, default=0.0)


def max_relative_error(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """The largest of :func:`relative_errors`."""
    return _worst(relative_errors(actual, expected))


def as_close_to_truth(
    mine: Sequence[float], eagers: Sequence[float], factor: float = ORACLE_FACTOR
) -> bool:
    """Whether a result is as close to a float64 run (its errors ``mine``) as eager's own
    result is (``eagers``), within ``factor``: how a tensor whose eager value is itself mostly
    rounding noise is judged."""
    return len(mine) == len(eagers) and all(
        m <= factor * e for m, e in zip(mine, eagers, strict=True)
    )


def _magnitude(tensor: torch.Tensor) -> float:
    values = tensor.float().abs()
    values = values[~torch.isnan(values)]
    return float(values.max().item()) if values.numel() else 0.0


def passes(error: float, dtype: torch.dtype) -> bool:
    """Whether ``error`` is within the tolerance of ``dtype`` (NaN never passes)."""
    return error <= TOLERANCES.get(dtype, 1e-3)
