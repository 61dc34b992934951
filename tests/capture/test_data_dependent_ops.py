"""Torch calls no graph node can hold break the graph at the call, not the whole frame.

Ops whose output shape or Python result depends on tensor data (``nonzero``, ``unique``,
``masked_select``, ``allclose``...), and calls that write to their operand in place with a
random stream of PyTorch's own (``exponential_``...), run natively between two compiled graphs.
Each program is called with new values, then a new shape; the counters must show the break
(with its reason) and no frame run uncompiled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import kiln

DATA = kiln.BreakReason.DATA_DEPENDENT
CALL = kiln.BreakReason.UNSUPPORTED_CALL


def _ctc(x: torch.Tensor) -> torch.Tensor:
    log_probs = (x[:6].reshape(3, 1, 2) * 2).log_softmax(2)
    targets, lengths = torch.tensor([[1]]), torch.tensor([3])
    return F.ctc_loss(log_probs, targets, lengths, torch.tensor([1])) + 1


def _lstsq(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.lstsq(x[:6].reshape(3, 2), torch.ones(3, 1)).solution * 2


def _boolean_mask_then_work(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    kept = y[y > 0]
    return kept.sum() + kept.mean() * y.sum()


# name -> (program, the reason of its one break, whether its result is random)
PROGRAMS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], kiln.BreakReason, bool]] = {
    "nonzero": (lambda x: torch.nonzero(x > 0).float().sum() + x.sum(), DATA, False),
    "argwhere": (lambda x: torch.argwhere(x > 0).float().sum() * 2, DATA, False),
    "unique": (lambda x: torch.unique((x * 2).round()).sum() + 1, DATA, False),
    "unique_consecutive": (
        lambda x: torch.unique_consecutive((x * 2).round()).sum() + 1,
        DATA,
        False,
    ),
    "masked_select": (lambda x: torch.masked_select(x, x > 0).sum() * 3, DATA, False),
    "boolean_mask": (_boolean_mask_then_work, DATA, False),
    "allclose": (lambda x: x * 2 if torch.allclose(x, x + 1e-9) else x, DATA, False),
    "equal": (lambda x: x * 2 if torch.equal(x, x.clone()) else x - 1, DATA, False),
    "tensor_split_by_tensor": (
        lambda x: torch.tensor_split(x * 2, torch.tensor([1, 3]))[1] + 1,
        CALL,
        False,
    ),
    "lstsq": (_lstsq, DATA, False),
    "gaussian_nll_loss": (
        lambda x: F.gaussian_nll_loss(x, x * 0.5, x.abs() + 0.1) * 2,
        DATA,
        False,
    ),
    "ctc_loss": (_ctc, DATA, False),
    "exponential_": (lambda x: (x * 2).exponential_() + x, CALL, True),
    "cauchy_": (lambda x: (x * 2).cauchy_() + x, CALL, True),
    "geometric_": (lambda x: (x * 2).geometric_(0.5) + x, CALL, True),
    "log_normal_": (lambda x: (x * 2).log_normal_() + x, CALL, True),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_breaks_at_the_op_and_follows_new_inputs(name: str) -> None:
    program, reason, random = PROGRAMS[name]
    kiln.reset()
    compiled = kiln.compile(program)
    for size in (6, 6, 9):
        x = torch.randn(size)
        if random:  # PyTorch draws these numbers natively: same seed, same numbers
            torch.manual_seed(size)
            actual = compiled(x)
            torch.manual_seed(size)
            expected = program(x)
        else:
            actual, expected = compiled(x), program(x)
        torch.testing.assert_close(actual, expected)
    assert kiln.counters.fallbacks == []
    reasons = {record.reason for record in kiln.counters.graph_breaks}
    assert reasons == {reason}, kiln.counters.graph_breaks


def test_boolean_mask_explain_names_the_break_and_no_uncompiled_frame() -> None:
    x = torch.randn(10)
    report = kiln.explain(_boolean_mask_then_work, x)
    assert report.break_reasons == [DATA]
    assert report.skips == []
    assert report.graph_count == 2  # the code after the mask is compiled too


def test_an_unresumable_instruction_is_listed_as_run_uncompiled() -> None:
    """A break at an instruction the head cannot perform (a tensor formatted in an f-string)
    runs the rest of the frame as original code, and explain says so."""

    def formats(x: torch.Tensor) -> str:
        y = x * 2
        return f"{y.sum():.3f}" + str(float(y.max()))

    x = torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kiln.compile(formats)(x) == formats(x)
    report = kiln.explain(formats, x)
    assert report.break_reasons == [DATA]
    assert [record.reason for record in report.skips] == [kiln.SkipReason.RESUMED_UNCOMPILED]
    assert "0 frame(s) run uncompiled" not in str(report)
