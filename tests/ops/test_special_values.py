"""Special values through compiled code: NaN and infinities propagate as in eager, and the
gradients at ties, zeros and saturated inputs are eager's.

The table-driven op tests draw ordinary random numbers; users' data has NaN (a bad batch), inf
(masks), zero vectors (padding), ties (ReLU outputs, max over equal scores). Each case compiles
a one-line program with ``kiln.compile`` and compares outputs (NaN positions included) and the
input's gradient with eager's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import kiln

NAN, INF = math.nan, math.inf
SPECIAL = torch.tensor([NAN, 1.0, -2.0, INF, -INF, 0.5, -0.0, 3.0])
OTHER = torch.tensor([0.5, NAN, -1.0, 2.0, INF, -INF, 0.0, NAN])

Program = Callable[..., torch.Tensor]

# Forward values with NaN and infinities in x (and y).
FORWARD: dict[str, Program] = {
    "clamp_max": lambda x, y: x.clamp(max=0.0),
    "clamp_both": lambda x, y: torch.clamp(x, -1, 5),
    "clamp_tensor_min": lambda x, y: torch.clamp(x, min=y),
    "clamp_tensor_max": lambda x, y: torch.clamp(x, max=y),
    "clip": lambda x, y: x.clip(-1, 1),
    "hardtanh": lambda x, y: F.hardtanh(x),
    "relu6": lambda x, y: F.relu6(x),
    "relu": lambda x, y: F.relu(x),
    "leaky_relu": lambda x, y: F.leaky_relu(x, 0.1),
    "elu": lambda x, y: F.elu(x),
    "selu": lambda x, y: F.selu(x),
    "silu": lambda x, y: F.silu(x),
    "mish": lambda x, y: F.mish(x),
    "softplus": lambda x, y: F.softplus(x),
    "hardswish": lambda x, y: F.hardswish(x),
    "threshold": lambda x, y: F.threshold(x, 0.5, -1.0),
    "maximum": lambda x, y: torch.maximum(x, y),
    "minimum": lambda x, y: torch.minimum(x, y),
    "fmax": lambda x, y: torch.fmax(x, y),
    "fmin": lambda x, y: torch.fmin(x, y),
    "max": lambda x, y: x.max(),
    "amax_dim": lambda x, y: x.reshape(2, 4).amax(1),
    "argmax": lambda x, y: x.reshape(2, 4).argmax(1),
    "softmax": lambda x, y: x.softmax(0),
    "logsumexp": lambda x, y: x.reshape(2, 4).logsumexp(1),
    "where": lambda x, y: torch.where(x > 0, x, y),
    "nan_to_num": lambda x, y: x.nan_to_num(),
    "sort": lambda x, y: x.sort().values,
    "max_pool": lambda x, y: F.max_pool1d(x.reshape(1, 1, 8), 2),
    "remainder": lambda x, y: x % y,
    "pow": lambda x, y: x**y,
    "atan2": lambda x, y: torch.atan2(x, y),
    "layer_norm": lambda x, y: F.layer_norm(x, (8,)),
}

# (program, input): gradients at ties, zeros, bounds and infinities.
GRADIENTS: dict[str, tuple[Program, list[float]]] = {
    "clamp_nan": (lambda x: torch.clamp(x, -1, 5), [NAN, 1.0, 9.0, -3.0]),
    "clamp_at_bounds": (lambda x: x.clamp(0, 3), [0.0, 1.0, 3.0, 9.0]),
    "max_dim_ties": (lambda x: x.reshape(2, 2).max(1).values, [3.0, 3.0, 2.0, 2.0]),
    "min_dim_ties": (lambda x: x.reshape(2, 2).min(1).values, [3.0, 3.0, 2.0, 2.0]),
    "max_ties": (lambda x: x.max(), [1.0, 3.0, 3.0, 2.0]),
    "adaptive_max_ties": (
        lambda x: F.adaptive_max_pool1d(x.reshape(1, 1, 4), 2),
        [3.0, 3.0, 3.0, 2.0],
    ),
    "max_pool_ties": (lambda x: F.max_pool1d(x.reshape(1, 1, 4), 2, 1), [3.0, 3.0, 3.0, 2.0]),
    "norm_of_zeros": (lambda x: (x * 0).norm(), [0.0, 1.0, 4.0, 9.0]),
    "p_norm_of_zeros": (lambda x: torch.linalg.vector_norm(x * 0, 3), [0.0, 1.0, 4.0, 9.0]),
    "normalize_zeros": (lambda x: F.normalize(x * 0, dim=0), [1.0, 1.0, 2.0, 3.0]),
    "std_of_constant": (lambda x: (x * 0 + 1).std(), [0.0, 1.0, 4.0, 9.0]),
    "atan2_origin": (lambda x: torch.atan2(x * 0, x * 0), [0.0, 1.0, 4.0, 9.0]),
    "prod_with_zero": (lambda x: x.prod(), [1.0, 0.0, 2.0, 3.0]),
    "cumprod_with_zero": (lambda x: x.cumprod(0), [1.0, 0.0, 2.0, 3.0]),
    "elu_infinities": (lambda x: F.elu(x), [INF, -INF, 0.0, -1.0]),
    "softplus_infinity": (lambda x: F.softplus(x), [INF, -INF, 0.0, 30.0]),
    "softmax_minus_inf": (
        lambda x: torch.where(x > 2.5, x, -INF).softmax(0),
        [3.0, 3.0, 1.0, 2.0],
    ),
    "relu_zero": (lambda x: F.relu(x), [0.0, -0.0, 1.0, -1.0]),
    "abs_zero": (lambda x: x.abs(), [0.0, -0.0, 1.0, -1.0]),
    # eager's backward formulas, not the forward's derivative: NaN passes 1 (hardswish) or 0
    "hardswish_special": (lambda x: F.hardswish(x), [NAN, INF, -INF, 3.0, -3.0, 1.0]),
    "hardsigmoid_special": (lambda x: F.hardsigmoid(x), [NAN, INF, -INF, 3.0, -3.0, 1.0]),
    # max()/min() of everything split the gradient among the NaNs when the result is NaN
    "max_with_nans": (lambda x: x.max() * 2, [NAN, 1.0, NAN, 2.0]),
    "min_with_nan": (lambda x: x.min(), [1.0, NAN, -INF, 2.0]),
    "max_infinite_ties": (lambda x: x.max(), [INF, INF, 1.0, 0.0]),
}


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(FORWARD))
def test_special_values_forward(name: str) -> None:
    program = FORWARD[name]
    kiln.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = kiln.compile(program)(SPECIAL, OTHER)
    _same(actual, program(SPECIAL, OTHER))
    assert kiln.counters.fallbacks == []


@pytest.mark.parametrize("name", list(GRADIENTS))
def test_gradients_at_special_points(name: str) -> None:
    program, values = GRADIENTS[name]
    kiln.reset()
    mine = torch.tensor(values, requires_grad=True)
    theirs = torch.tensor(values, requires_grad=True)
    actual, expected = kiln.compile(program)(mine), program(theirs)
    _same(actual, expected)
    cotangent = torch.linspace(0.5, 1.5, expected.numel()).reshape(expected.shape)
    actual.backward(cotangent)
    expected.backward(cotangent)
    _same(mine.grad, theirs.grad)
    assert kiln.counters.fallbacks == []
