"""Matmul padding: misaligned 16-bit matmuls are padded and sliced with the same result."""

from __future__ import annotations

import pytest
import torch

import kiln
import kiln.passes.matmul_padding as module
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes.matmul_padding import pad_matmul
from tests.backends.op_table import run_compiled


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "DEVICE_TYPES", ("cuda", "cpu"))  # CI has no GPU


def _ops(graph: kiln.ir.Graph) -> list[Op]:
    return [node.op for node in graph.nodes]


@pytest.mark.parametrize(
    ("shape_a", "shape_b", "bias"),
    [((32, 264), (264, 301), False), ((16, 301), (301, 256), False), ((8, 300), (300, 259), True)],
)
def test_padded_matmul_gives_the_same_product(
    shape_a: tuple[int, int], shape_b: tuple[int, int], bias: bool
) -> None:
    a = torch.randn(shape_a, dtype=torch.bfloat16)
    w = torch.randn(shape_b[::-1], dtype=torch.bfloat16)
    b = torch.randn(shape_b[1], dtype=torch.bfloat16) if bias else None

    def linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(a, w, b)

    graph = kiln.trace(linear, a, w)
    inputs = graph_inputs(graph, linear, a, w)
    expected = interpret(graph, inputs)[0]
    padded = verify(pad_matmul(graph))
    assert Op.PAD in _ops(padded)
    got = interpret(padded, inputs)[0]
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    compiled = run_compiled(padded, inputs, "evaluate")[0]
    torch.testing.assert_close(compiled, expected, rtol=2e-2, atol=2e-2)
    # The output is the padded product's view, as torch.compile returns it: no second copy.
    if shape_b[1] % 8:
        assert compiled.stride() == (shape_b[1] + (-shape_b[1] % 8), 1)


def test_aligned_or_float32_matmuls_are_left_alone() -> None:
    for dtype, n in ((torch.bfloat16, 256), (torch.float32, 301)):
        a, w = torch.randn(8, 264, dtype=dtype), torch.randn(n, 264, dtype=dtype)
        graph = kiln.trace(lambda a, w: a @ w.t(), a, w)
        assert Op.PAD not in _ops(pad_matmul(graph))


def test_gradients_flow_through_the_padded_matmul() -> None:
    a = torch.randn(16, 264, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(301, 264, dtype=torch.bfloat16, requires_grad=True)

    def head(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (a @ w.t()).float().square().mean()

    head(a, w).backward()
    expected = a.grad, w.grad
    a.grad = w.grad = None
    kiln.compile(head)(a, w).backward()
    assert a.grad is not None and w.grad is not None
    for got, want in zip((a.grad, w.grad), expected, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
