"""The correctness measure: relative to each tensor's scale, with a floor for near-zero tensors."""

from __future__ import annotations

import math
from pathlib import Path

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
    from kiln.bench.compare import max_relative_error, relative_norm_errors

    expected = torch.randn(10_000)
    noisy = expected.clone()
    noisy[:3] += 0.5 * expected.abs().max()  # a few entries off, the vector nearly the same
    assert max_relative_error([noisy], [expected]) > 0.4
    assert relative_norm_errors([noisy], [expected])[0] < 0.05
    assert relative_norm_errors([expected * 1.1], [expected])[0] == pytest.approx(0.1, rel=1e-3)
    assert relative_norm_errors([expected[:5]], [expected])[0] == float("inf")


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


def test_noise_tensors_are_judged_against_a_float64_oracle(tmp_path: Path) -> None:
    """A tensor far from eager passes when it is as close to the float64 run as eager is
    (both are rounding noise around it), and fails when it is not."""
    from kiln.bench.compare import relative_norm_errors
    from kiln.bench.worker import Job, Measurement, _judged_by_oracle

    reference = str(tmp_path / "reference.pt")
    job = Job("m", "train", "kiln", "cpu", "bfloat16", 1, reference)
    truth = [torch.ones(100), torch.zeros(100) + 1e-6]
    eager = [torch.ones(100), torch.randn(100, generator=torch.Generator().manual_seed(0))]
    torch.save(truth, reference + ".fp64")
    close = [torch.ones(100), torch.randn(100, generator=torch.Generator().manual_seed(1))]
    far = [torch.ones(100), 10 * torch.randn(100, generator=torch.Generator().manual_seed(1))]
    names = ["loss", "grad of bias"]
    for result, verdict in ((close, True), (far, False)):
        measurement = Measurement("kiln")
        judged = _judged_by_oracle(
            job, result, eager, [1], names, relative_norm_errors, measurement
        )
        assert judged is verdict
        assert "grad of bias" in measurement.notes[-1]
    missing = Job("m", "train", "kiln", "cpu", "bfloat16", 1, str(tmp_path / "none.pt"))
    assert not _judged_by_oracle(
        missing, close, eager, [1], names, relative_norm_errors, Measurement("kiln")
    )
