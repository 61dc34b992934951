"""The harness itself: a "compiled" program that misbehaves the way Kiln bugs do (a stale
result, a lost gradient, a missing print, an input not written, a wrong count) must fail with
the matching failure class, and a row that could pass vacuously must be refused."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from torch import nn

import kiln

from .harness import (
    Program,
    WrongCounters,
    WrongGrad,
    WrongOutput,
    WrongSideEffect,
    check_program,
)


def scale(x):
    print("rows", x.shape[0])
    return x * 2


def add_in_place(x):
    x.add_(1)
    return x.sum()


def rows(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(3 + variant, 4),)


def stale(fn: Any) -> Any:
    """Returns its first result forever (the reported bug)."""
    first: list[Any] = []

    def call(*args):
        if not first:
            first.append(fn(*args))
        return first[0]

    return call


def silent(fn: Any) -> Any:
    """Loses the program's prints."""

    def call(*args):
        with contextlib.redirect_stdout(io.StringIO()):
            return fn(*args)

    return call


def on_a_copy(fn: Any) -> Any:
    """Writes to a copy of its input, not the caller's tensor."""
    return lambda x: fn(x.clone())


def cut_from_parameters(module: Any) -> Any:
    """Same values, requires_grad, but the graph to the parameters is cut: grads stay None."""
    return lambda x: module(x).detach().requires_grad_()


def test_stale_result_is_a_wrong_output() -> None:
    with pytest.raises(WrongOutput):
        check_program(Program("stale", lambda: scale, rows, compile=stale))


def test_lost_gradient_is_a_wrong_grad() -> None:
    program = Program("cut", lambda: nn.Linear(4, 2), rows, train=True, compile=cut_from_parameters)
    with pytest.raises(WrongGrad, match=r"weight\.grad is None compiled"):
        check_program(program)


def test_missing_print_is_a_wrong_side_effect() -> None:
    with pytest.raises(WrongSideEffect, match="printed"):
        check_program(Program("silent", lambda: scale, rows, compile=silent))


def test_input_not_written_is_a_wrong_side_effect() -> None:
    program = Program("copy", lambda: add_in_place, rows, compile=on_a_copy)
    with pytest.raises(WrongSideEffect, match="inputs after the call"):
        check_program(program)


def test_nan_must_stay_nan() -> None:
    def nan_input(variant: int) -> tuple[torch.Tensor]:
        return (torch.tensor([float("nan"), 1.0]),)

    program = Program("nan", lambda: torch.relu, nan_input, compile=lambda f: torch.nan_to_num)
    with pytest.raises(WrongOutput):
        check_program(program)


def test_wrong_count_is_wrong_counters() -> None:
    def graph_break(x):
        y = x * 2
        kiln.graph_break()
        return y + 1

    with pytest.raises(WrongCounters, match="broke for"):
        check_program(Program("count", lambda: graph_break, rows, graphs=2))


def test_program_returning_nothing_is_refused() -> None:
    def nothing(x):
        x * 2

    with pytest.raises(AssertionError, match="returns no tensor"):
        check_program(Program("nothing", lambda: nothing, rows))
