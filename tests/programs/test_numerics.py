"""Numerics users hit: NaN and infinity through clamp/min/max/relu/softmax and reductions,
integer and bool tensors, mixed dtypes, and type promotion with Python scalars.

A compiled kernel that computes ``min(x, 0)`` as ``x < 0 ? x : 0`` turns NaN into 0; eager
propagates it. Inputs carry NaN and infinities at fixed places among random values; the
harness compares NaN as equal to NaN (``assert_close`` does), and dtypes exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from .harness import Program, check_program, params

NAN, INF = float("nan"), float("inf")


def specials(variant: int, requires_grad: bool = False) -> tuple[torch.Tensor]:
    """Random values with NaN, +inf and -inf in fixed places (rows 0-2)."""
    x = torch.randn(4 + 2 * variant, 6)
    x[0, 1] = NAN
    x[1, 2] = INF
    x[2, 3] = -INF
    return (x.requires_grad_(requires_grad),)


def nan_only(variant: int) -> tuple[torch.Tensor]:
    x = torch.randn(4 + 2 * variant, 6)
    x[0, 1] = NAN
    x[3, 0] = NAN
    return (x,)


def clamp_max(x):
    return x.clamp(max=0.0)


def clamp_min(x):
    return x.clamp(min=0.5)


def clamp_both(x):
    return torch.clamp(x, -1.0, 1.0) * 2


def clamp_tensor_bounds(x):
    return x.clamp(min=torch.zeros(6), max=torch.full((6,), 0.5))


def minimum_maximum(x):
    return torch.minimum(x, torch.zeros_like(x)), torch.maximum(x, torch.ones_like(x))


def fmin_fmax(x):
    """fmin/fmax ignore NaN, unlike minimum/maximum."""
    return torch.fmin(x, torch.zeros_like(x)), torch.fmax(x, torch.ones_like(x))


def relu_family(x):
    return F.relu(x), F.relu6(x), F.hardtanh(x), F.leaky_relu(x, 0.1), F.elu(x)


def reductions(x):
    return x.amax(dim=1), x.amin(dim=1), x.max(), x.sum(dim=1), x.mean(dim=0)


def max_with_indices(x):
    values, index = x.max(dim=1)
    return values, index, x.argmax(dim=1), x.argmin(dim=0)


def softmax_masked_rows(x):
    """A fully masked row gives NaN (all -inf); a partly masked row renormalises."""
    scores = torch.nan_to_num(x, nan=0.0, posinf=5.0, neginf=-5.0)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[0] = True
    mask[1, :3] = True
    masked = scores.masked_fill(mask, -INF)
    return torch.softmax(masked, dim=-1), torch.log_softmax(masked, dim=-1)


def softmax_with_specials(x):
    return torch.softmax(x, dim=-1), torch.logsumexp(x, dim=-1)


def large_logits(x):
    """Stable softmax of values around 1e3, and exp overflowing to inf."""
    return torch.softmax(x * 1000, dim=-1), torch.exp(x * 100)


def invalid_math(x):
    """log of negatives, sqrt of negatives, 0/0 and inf - inf."""
    y = torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0)
    return torch.log(y), torch.sqrt(y), (y - y) / (y - y), torch.exp(y * 1e3) - torch.exp(y * 1e3)


def where_and_nan_checks(x):
    bad = torch.isnan(x) | torch.isinf(x)
    return torch.where(bad, torch.zeros_like(x), x), bad.any(dim=1), torch.isfinite(x).all()


def nan_to_num_grad(x):
    return torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0).tanh() * 2


def integers(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (3 + variant, 5)
    a = torch.randint(-20, 20, shape)
    b = torch.randint(1, 7, shape) * (torch.randint(0, 2, shape) * 2 - 1)  # never zero
    return a, b


def integer_arithmetic(a, b):
    return (
        a * 3 + b,
        a // b,
        a % b,
        torch.div(a, b, rounding_mode="trunc"),
        torch.div(a, b, rounding_mode="floor"),
        a / b,
        a.sum(),
        a.to(torch.int32).sum(dim=0),
        a.abs().max(dim=1).values,
    )


def integer_bitwise(a, b):
    return a & b, a | b, a ^ b, ~a, a << 2, a.abs() >> 1


def small_integers(variant: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 255, (4 + variant, 4), dtype=torch.uint8),)


def small_integer_arithmetic(x):
    """uint8 arithmetic wraps (image pixels); int8 and int16 keep their dtypes."""
    return x - 10, x * 2, x.float().mean(dim=1), x.to(torch.int16) - 300, x.to(torch.int8) + 1


def booleans(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4 + 2 * variant, 5)
    return x > 0, torch.randn(4 + 2 * variant, 5)


def boolean_ops(mask, x):
    return (
        mask & ~mask.roll(1, 0),
        mask | (x > 1),
        mask.sum(),
        mask.sum(dim=1),
        mask.any(dim=0),
        mask.all(),
        mask * x,
        x.masked_fill(mask, 0.5),
        mask.float().mean(),
        mask.long() - 1,
    )


def mixed(variant: int) -> tuple[torch.Tensor, ...]:
    shape = (3 + variant, 4)
    return (
        torch.randn(shape),
        torch.randn(shape, dtype=torch.float64),
        torch.randn(shape).to(torch.float16),
        torch.randn(shape).to(torch.bfloat16),
        torch.randint(-5, 5, shape),
    )


def mixed_dtypes(f32, f64, f16, bf16, i64):
    return f32 + f64, f16 * f32, bf16 + f16, i64 + f16, i64 * bf16, (f16 + bf16).dtype


def scalar_promotion(f32, f64, f16, bf16, i64):
    """Python scalars do not promote a tensor's floating dtype, but a float promotes ints."""
    return (
        i64 * 2.5,
        i64 + True,
        i64 / 2,
        i64 * 2,
        f16 * 1e5,  # overflows float16 to inf
        bf16 + 1.0,
        f32 * 3,
        f64 + 1,
        2 ** i64.abs().clamp(max=10),
        (i64 > 0) + 1,
        (i64 > 0) * 1.5,
    )


def reductions_of_low_precision(f32, f64, f16, bf16, i64):
    return f16.sum(), bf16.mean(dim=0), f16.float().softmax(-1).half(), i64.float().std()


LOW = {"atol": 1e-2, "rtol": 1e-2}

PROGRAMS = [
    Program("nan-clamp-max", lambda: clamp_max, specials),
    Program("nan-clamp-min", lambda: clamp_min, specials),
    Program("nan-clamp-both", lambda: clamp_both, specials),
    Program("nan-clamp-tensor-bounds", lambda: clamp_tensor_bounds, specials),
    Program("nan-minimum-maximum", lambda: minimum_maximum, specials),
    Program("nan-fmin-fmax", lambda: fmin_fmax, specials),
    Program("nan-relu-family", lambda: relu_family, specials),
    Program("nan-reductions", lambda: reductions, specials),
    Program("nan-max-indices", lambda: max_with_indices, nan_only),
    Program("inf-softmax-masked-rows", lambda: softmax_masked_rows, specials),
    Program("inf-softmax-logsumexp", lambda: softmax_with_specials, specials),
    Program("inf-large-logits", lambda: large_logits, specials),
    Program("nan-invalid-math", lambda: invalid_math, specials),
    Program("nan-where-isnan", lambda: where_and_nan_checks, specials),
    Program(
        "nan-to-num-train",
        lambda: nan_to_num_grad,
        lambda v: specials(v, requires_grad=True),
        train=True,
    ),
    Program("int-arithmetic", lambda: integer_arithmetic, integers),
    Program("int-bitwise", lambda: integer_bitwise, integers),
    Program(
        "uint8-int8-arithmetic",
        lambda: small_integer_arithmetic,
        small_integers,
    ),
    Program("bool-ops", lambda: boolean_ops, booleans),
    Program("mixed-dtypes", lambda: mixed_dtypes, mixed, **LOW),
    Program("python-scalar-promotion", lambda: scalar_promotion, mixed, **LOW),
    Program("low-precision-reductions", lambda: reductions_of_low_precision, mixed, **LOW),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_numerics(program: Program) -> None:
    check_program(program)
