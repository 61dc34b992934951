"""Reduction splitting: BatchNorm-style reductions become two, with the same results."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes import split_reductions


def _reductions(graph: kiln.ir.Graph) -> list[tuple[Op, tuple[int, ...]]]:
    return [(n.op, tuple(n.attrs.dims)) for n in graph.nodes if n.op in (Op.SUM, Op.AMAX)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_statistics_split(dtype: torch.dtype) -> None:
    x = torch.randn(8, 4, 12, 12, dtype=dtype)

    def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum((0, 2, 3)), x.amax((0, 2, 3))

    graph = kiln.trace(stats, x)
    inputs = graph_inputs(graph, stats, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    assert ((Op.SUM, (2, 3)) in _reductions(split)) and ((Op.SUM, (0,)) in _reductions(split))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_trailing_only_or_many_rows_are_left_alone() -> None:
    x = torch.randn(4, 8, 16)
    for fn in (lambda x: x.sum((1, 2)), lambda x: x.sum(0)):
        graph = kiln.trace(fn, x)
        assert _reductions(split_reductions(graph)) == _reductions(graph)


def test_training_batchnorm_gradients_match_after_the_split() -> None:
    bn = torch.nn.BatchNorm2d(4).train()
    x = torch.randn(6, 4, 10, 10, requires_grad=True)
    bn(x).square().mean().backward()
    expected = x.grad
    x.grad = None
    kiln.compile(bn)(x).square().mean().backward()
    assert x.grad is not None and expected is not None
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-6)
