"""Custom ``torch.autograd.Function``s in compiled code: each gets exactly its own gradient.

Capture traces ``forward`` without gradients and ``backward`` into a graph of its own; the
outputs pass through a marker whose VJP is that backward (kiln/capture/calls/autograd_function.py).
A backward the graph cannot replay (I/O, data-dependent code) breaks the graph at the
``apply`` call, which then runs in eager autograd. Every test compares every parameter's and
input's gradient with eager over calls with new values and shapes, and the counters.
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


class GradReverse(torch.autograd.Function):
    """Identity forward, negated and scaled gradient: not the derivative of the forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.alpha * grad, None


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class SavedExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * y


class ScaleAndSum(torch.autograd.Function):
    """``setup_context`` style, two outputs, one marked non-differentiable."""

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * w, x.sum()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        x, w = inputs
        ctx.save_for_backward(x, w)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class NeedsInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gx = grad * 7 if ctx.needs_input_grad[0] else None
        gy = grad * 11 if ctx.needs_input_grad[1] else None
        return gx, gy


class BroadcastGrad(torch.autograd.Function):
    """Returns a bias gradient of the output's shape: autograd sums it to the bias's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad * 2, grad


class PrintingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        print("backward ran")
        return grad * -3


class OpaqueForward(torch.autograd.Function):
    """A forward capture cannot see into (NumPy): the call runs in eager autograd."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.detach().numpy() * 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 5


class TooManyGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


class Model(nn.Module):
    """Functions between linear layers: every parameter's gradient depends on them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = GradReverse.apply(self.first(x), 0.5)
        h = StraightThrough.apply(h) + SavedExp.apply(h * 0.1)
        h, total = ScaleAndSum.apply(h, self.scale)
        return self.second(h).sum() + total


def _check_grads(eager: nn.Module, mine: nn.Module) -> None:
    for (name, p), q in zip(eager.named_parameters(), mine.parameters(), strict=True):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
        p.grad = q.grad = None


def test_functions_inside_a_model_give_their_own_gradients() -> None:
    kiln.reset()
    eager = Model()
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for batch in (2, 2, 5):
        x = torch.randn(batch, 4)
        expected, actual = eager(x), compiled(x)
        torch.testing.assert_close(actual, expected)
        assert actual.requires_grad
        expected.backward()
        actual.backward()
        _check_grads(eager, mine)
    assert kiln.counters.fallbacks == []
    assert kiln.counters.graph_breaks == []
    assert kiln.counters.graphs == 2  # batch 2, then batch 5
    report = kiln.explain(mine, torch.randn(2, 4))
    assert report.externs == []  # the markers are not opaque calls


def _inputs(shapes: list[tuple[int, ...]], grads: list[bool]) -> list[torch.Tensor]:
    return [torch.randn(*s, requires_grad=g) for s, g in zip(shapes, grads, strict=True)]


# name -> (program, argument shapes, which require grad, expected break reasons)
PROGRAMS: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, ...]], list[bool], list]] = {
    "needs_input_grad": (
        lambda x, y: NeedsInputGrad.apply(x * 1, y) + 1,
        [(4,), (4,)],
        [True, False],
        [],
    ),
    "input_returned_as_is": (lambda x: GradReverse.apply(x, 2.0), [(3, 4)], [True], []),
    "bias_gradient_summed": (
        lambda x, b: BroadcastGrad.apply(x, b) * 2,
        [(3, 4), (4,)],
        [True, True],
        [],
    ),
    "backward_prints": (
        lambda x: PrintingBackward.apply(x * 1) + 1,
        [(4,)],
        [True],
        [kiln.BreakReason.IO],
    ),
    "opaque_forward": (
        lambda x: OpaqueForward.apply(x * 1) + 1,
        [(4,)],
        [True],
        [kiln.BreakReason.DATA_DEPENDENT],
    ),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_function_programs(name: str) -> None:
    program, shapes, grads, breaks = PROGRAMS[name]
    kiln.reset()
    compiled = kiln.compile(program)
    for scale in (1, 1, 2):
        sized = [tuple(n * scale for n in shape) for shape in shapes]
        eager_inputs = _inputs(sized, grads)
        mine = [t.detach().clone().requires_grad_(t.requires_grad) for t in eager_inputs]
        printed = [io.StringIO(), io.StringIO()]
        with redirect_stdout(printed[0]):
            expected = program(*eager_inputs)
            expected.sum().backward()
        with redirect_stdout(printed[1]):
            actual = compiled(*mine)
            actual.sum().backward()
        assert printed[1].getvalue() == printed[0].getvalue()
        torch.testing.assert_close(actual, expected)
        for a, e in zip(mine, eager_inputs, strict=True):
            assert (a.grad is None) == (e.grad is None)
            if e.grad is not None:
                torch.testing.assert_close(a.grad, e.grad)
    assert kiln.counters.fallbacks == []
    assert {r.reason for r in kiln.counters.graph_breaks} == set(breaks)


def test_a_wrong_backward_raises_eagers_error_at_backward_time() -> None:
    kiln.reset()
    x = torch.randn(4, requires_grad=True)
    out = kiln.compile(lambda t: TooManyGradients.apply(t) * 2)(x)
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        out.sum().backward()


def test_no_grad_gives_outputs_without_gradients() -> None:
    kiln.reset()
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        out = kiln.compile(lambda t: PrintingBackward.apply(t) + 1)(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, x.detach() * 3 + 1)
    assert kiln.counters.graph_breaks == []  # the backward is not traced without grad
