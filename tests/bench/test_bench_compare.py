"""The correctness measure: relative to each tensor's scale, with a floor for near-zero tensors."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.bench.compare import max_relative_error, passes


def test_relative_to_scale() -> None:
    expected = [torch.tensor([100.0, -200.0])]
    assert max_relative_error([torch.tensor([100.0, -198.0])], expected) == 0.01


def test_floor_for_near_zero_tensors() -> None:
    # A zero gradient computed as 1e-9 noise is not a 100% error next to gradients of size 1.
    expected = [torch.ones(4), torch.zeros(4)]
    actual = [torch.ones(4), torch.full((4,), 1e-9)]
    assert max_relative_error(actual, expected) < 1e-5


def test_mismatches() -> None:
    assert max_relative_error([torch.ones(2)], [torch.ones(3)]) == math.inf
    assert max_relative_error([torch.ones(2)], []) == math.inf
    nan = torch.tensor([float("nan"), 1.0])
    assert math.isnan(max_relative_error([nan], [torch.ones(2)]))
    assert max_relative_error([nan], [nan.clone()]) == 0.0
    assert not passes(float("nan"), torch.float32)
    assert passes(1e-2, torch.bfloat16) and not passes(1e-2, torch.float32)


def test_training_error_is_relative_to_the_gradient_norm() -> None:
    from kiln.bench.compare import max_relative_error, max_relative_norm_error

    expected = torch.randn(10_000)
    noisy = expected.clone()
    noisy[:3] += 0.5 * expected.abs().max()  # a few entries off, the vector nearly the same
    assert max_relative_error([noisy], [expected]) > 0.4
    assert max_relative_norm_error([noisy], [expected]) < 0.05
    assert max_relative_norm_error([expected * 1.1], [expected]) == pytest.approx(0.1, rel=1e-3)
    assert max_relative_norm_error([expected[:5]], [expected]) == float("inf")


def test_compilers_are_judged_against_eagers_own_variation() -> None:
    from kiln.bench.runner import _judge
    from kiln.bench.worker import Measurement

    noisy_eager = Measurement("eager", False, max_rel_error=1.0, ok=True)
    within = Measurement("kiln", False, max_rel_error=1.3, ok=False)
    _judge(within, noisy_eager)
    assert within.ok and "run-to-run" in within.notes[-1]
    beyond = Measurement("kiln", False, max_rel_error=1.3, ok=False)
    _judge(beyond, Measurement("eager", False, max_rel_error=0.1, ok=True))
    assert not beyond.ok and not beyond.notes
