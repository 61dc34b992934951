"""Programs with a graph break, called again with new values and then new shapes: every call's
result is eager's (never the first call's), inside a module's forward, behind ``*args`` and
``**kwargs`` forwarding, and in a function that forwards to a breaking callee.

The conformance harness calls a program twice with the same inputs; these tests are the
user's view: one compiled object, many different calls.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch
from torch import nn

import kiln


def _print_item(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    print("sum:", round(y.sum().item(), 3))
    return y + 1


def _item_scale(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().max().item()
    return x / s


def _tensor_branch(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    if y.sum() > 0:
        return y * 2
    return y - 3


def _explicit(x: torch.Tensor) -> torch.Tensor:
    y = x.cos()
    kiln.graph_break()
    return y * y + x


def _tolist(x: torch.Tensor) -> torch.Tensor:
    values = x.flatten().tolist()
    return x * values[0]


BREAKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "print_item": _print_item,
    "item": _item_scale,
    "tensor_branch": _tensor_branch,
    "explicit": _explicit,
    "tolist": _tolist,
}


class _Wrapped(nn.Module):
    """A module whose forward calls a breaking function between two linear layers."""

    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.body = body
        self.first = nn.Linear(5, 5)
        self.second = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.body(self.first(x)))


def _forwarding(body: Callable[..., Any]) -> Callable[..., Any]:
    def outer(*args: Any, **kwargs: Any) -> Any:
        return body(*args, **kwargs)

    return outer


def _inputs() -> list[torch.Tensor]:
    """New values, then new shapes, then the first shape again with new values."""
    return [torch.randn(2, 5), torch.randn(2, 5), torch.randn(7, 5), torch.randn(1, 5)]


def _run_both(eager: Callable[..., Any], compiled: Callable[..., Any], x: torch.Tensor) -> None:
    printed = [io.StringIO(), io.StringIO()]
    with redirect_stdout(printed[0]):
        expected = eager(x)
    with redirect_stdout(printed[1]):
        actual = compiled(x)
    torch.testing.assert_close(actual, expected)
    assert printed[1].getvalue() == printed[0].getvalue()


@pytest.mark.parametrize("kind", list(BREAKS))
def test_module_with_a_break_follows_every_input(kind: str) -> None:
    kiln.reset()
    eager = _Wrapped(BREAKS[kind])
    compiled = kiln.compile(copy.deepcopy(eager))
    for x in _inputs():
        _run_both(eager, compiled, x)
    assert kiln.counters.fallbacks == []
    assert kiln.counters.graph_breaks, "the program was expected to break"


@pytest.mark.parametrize("kind", list(BREAKS))
def test_args_forwarding_to_a_breaking_callee_follows_every_input(kind: str) -> None:
    kiln.reset()
    body = BREAKS[kind]
    compiled = kiln.compile(_forwarding(body))
    for x in _inputs():
        _run_both(body, compiled, x)
    assert kiln.counters.fallbacks == []


def test_kwargs_forwarding_follows_every_input() -> None:
    def inner(x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        y = x * scale
        kiln.graph_break()
        return y + scale

    kiln.reset()
    compiled = kiln.compile(_forwarding(inner))
    for x in _inputs():
        scale = torch.randn(x.shape[-1])
        torch.testing.assert_close(compiled(x, scale=scale), inner(x, scale=scale))
    assert kiln.counters.fallbacks == []


def test_training_through_a_module_with_a_break() -> None:
    """Every parameter's gradient, for calls with new values and shapes."""
    kiln.reset()
    eager = _Wrapped(_print_item)
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for x in _inputs():
        with redirect_stdout(io.StringIO()):
            expected = eager(x).square().sum()
            actual = compiled(x).square().sum()
        torch.testing.assert_close(actual, expected)
        expected.backward()
        actual.backward()
        for (name, p), q in zip(eager.named_parameters(), mine.parameters(), strict=True):
            assert q.grad is not None, name
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
            p.grad = q.grad = None
    assert kiln.counters.fallbacks == []
