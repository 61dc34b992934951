"""Ops Kiln does not differentiate itself keep their gradients: complex numbers and externs run
as PyTorch calls differentiated by PyTorch's autograd, and a graph with an op PyTorch has no
derivative for runs under eager autograd (raising at backward exactly where eager raises).

Every case compares the output, its ``requires_grad`` and the input's gradient with eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kiln

Program = Callable[[torch.Tensor], torch.Tensor]

PROGRAMS: dict[str, Program] = {
    "fft_abs": lambda x: torch.fft.fft(x).abs(),
    "rfft_real": lambda x: torch.fft.rfft(x).real * 2,
    "view_as_complex": lambda x: torch.view_as_complex(x.reshape(-1, 2)).abs(),
    "polar": lambda x: torch.polar(x.abs(), x).real,
    "complex_product": lambda x: (torch.complex(x, x * 2) * torch.complex(x, -x)).imag,
    "complex_abs": lambda x: torch.complex(x, x).abs() + 1,
    "eigvals": lambda x: torch.linalg.eigvals(x.reshape(2, 2) + 3 * torch.eye(2)).real,
    "eigh": lambda x: torch.linalg.eigh((lambda m: m + m.T)(x.reshape(2, 2))).eigenvalues,
    "lu": lambda x: torch.linalg.lu(x.reshape(2, 2)).U,
    "qr": lambda x: torch.linalg.qr(x.reshape(2, 2)).R,
    "svdvals": lambda x: torch.linalg.svdvals(x.reshape(2, 2)),
    "det": lambda x: torch.linalg.det(x.reshape(2, 2)),
    "solve": lambda x: torch.linalg.solve(x.reshape(2, 2) + 3 * torch.eye(2), x[:2]),
    "nuclear_norm": lambda x: torch.linalg.norm(x.reshape(2, 2), "nuc"),
    "spectral_norm": lambda x: torch.linalg.matrix_norm(x.reshape(2, 2), 2),
    "fill_": lambda x: (x * 2).fill_(3.0) + x,
    "zero_": lambda x: (x * 2).zero_() + x,
    "stft": lambda x: torch.stft(x.repeat(4), 4, return_complex=True).abs(),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_gradients_through_pytorch_calls(name: str) -> None:
    program = PROGRAMS[name]
    kiln.reset()
    compiled = kiln.compile(program)
    for _ in range(2):
        theirs = torch.randn(4, requires_grad=True)
        mine = theirs.detach().clone().requires_grad_()
        expected, actual = program(theirs), compiled(mine)
        assert actual.requires_grad == expected.requires_grad
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
        cotangent = torch.randn_like(expected)
        expected.backward(cotangent)
        actual.backward(cotangent)
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-4, rtol=1e-4)
    assert kiln.counters.fallbacks == []


@pytest.mark.parametrize(
    "program",
    [
        lambda x: torch.special.zeta(x.abs() + 2, 2.0) + x,
        lambda x: torch.igamma(x.abs() + 1, x.abs() + 0.5) * 2,
        lambda x: torch.geqrf(x.reshape(2, 2))[0] + 1,
    ],
    ids=["zeta", "igamma", "geqrf"],
)
def test_no_derivative_raises_at_backward_like_eager(program: Any) -> None:
    """Outputs require grad as in eager; backward raises eager's NotImplementedError."""
    kiln.reset()
    x = torch.randn(4, requires_grad=True)
    expected, actual = program(x), kiln.compile(program)(x)
    assert actual.requires_grad and expected.requires_grad
    torch.testing.assert_close(actual, expected)
    with pytest.raises(NotImplementedError, match="not implemented"):
        expected.sum().backward()
    with pytest.raises(NotImplementedError, match="not implemented"):
        actual.sum().backward()
    assert kiln.counters.fallbacks == []


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return -grad * x


def test_custom_function_under_eager_autograd_keeps_its_backward() -> None:
    """A graph run by the interpreter under eager autograd (a node without a derivative)
    still gives a custom Function its own gradient (the marker's eager implementation)."""

    def program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _Reverse.apply(x) + torch.special.zeta(y.abs() + 2, 2.0)

    kiln.reset()
    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    out = kiln.compile(program)(mine, y)
    expected_out = program(x, y)
    torch.testing.assert_close(out, expected_out)
    # (only x's gradient: y's goes through zeta, whose derivative PyTorch does not implement)
    (actual,) = torch.autograd.grad(out.sum(), mine)
    (expected,) = torch.autograd.grad(expected_out.sum(), x)
    torch.testing.assert_close(actual, expected)
