"""Transposed products: ``mm(a, b).T`` is computed as ``mm(b.T, a.T)``, so a linear layer's
weight gradient comes out in the weight's own layout (no copy when autograd accumulates it)."""

from __future__ import annotations

from typing import Any

import torch

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes import eliminate_dead_code
from kiln.passes.matmul_transpose import transpose_matmul
from tests.backends.op_table import run_compiled


def test_transposed_product_is_computed_transposed() -> None:
    a, b = torch.randn(6, 5), torch.randn(5, 7)

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (a @ b).t(), (a @ b.t().contiguous().t()).t() * 2

    graph = kiln.trace(f, a, b)
    inputs = graph_inputs(graph, f, a, b)
    expected = interpret(graph, inputs)
    rewritten = verify(eliminate_dead_code(transpose_matmul(graph)))
    for got, want in zip(interpret(rewritten, inputs), expected, strict=True):
        torch.testing.assert_close(got, want)
    compiled = run_compiled(rewritten, inputs, "evaluate")
    for got, want in zip(compiled, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert compiled[0].is_contiguous()  # [7, 6] row-major: the product of b.T and a.T
    mms = [n for n in rewritten.nodes if n.op is Op.MM]
    assert all(tuple(n.output.type.shape) == (7, 6) for n in mms)


def test_a_product_read_untransposed_is_left_alone() -> None:
    a, b = torch.randn(6, 5), torch.randn(5, 7)

    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        product = a @ b
        return product.t(), product + 1

    graph = kiln.trace(f, a, b)
    assert transpose_matmul(graph) is graph


def test_linear_weight_gradients_come_out_in_the_weight_layout() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 24)
    x = torch.randn(8, 16)
    layer(x).square().sum().backward()
    expected = layer.weight.grad
    layer.weight.grad = None
    kiln.compile(layer)(x).square().sum().backward()
    assert layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad.stride() == (16, 1)


def test_a_product_whose_columns_get_padded_keeps_its_orientation(monkeypatch: Any) -> None:
    # On the GPU a 16-bit product with N = 301 is padded along N; transposed, 301 would be an
    # unpadded M (cuBLAS's slow path), so it stays as it is.
    import kiln.passes.matmul_padding as padding

    monkeypatch.setattr(padding, "DEVICE_TYPES", ("cuda", "cpu"))
    a, b = torch.randn(16, 264, dtype=torch.bfloat16), torch.randn(264, 301, dtype=torch.bfloat16)
    graph = kiln.trace(lambda a, b: (a @ b).t(), a, b)
    assert transpose_matmul(graph) is graph
