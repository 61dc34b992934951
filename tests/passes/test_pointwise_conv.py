"""Pointwise convolutions of 1x1 images become matmuls (``kiln/passes/pointwise_conv.py``):
the rewrite on traced graphs, the convolutions it leaves alone, and a compiled
squeeze-excitation block's outputs and every gradient against eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes import convolutions_as_matmuls


def _ops(graph: kiln.ir.Graph) -> list[Op]:
    return [node.op for node in graph.nodes if node.op in (Op.CONVOLUTION, Op.MM, Op.ADDMM)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("stride", [1, 2])
def test_pointwise_convolution_of_pooled_features_is_a_matmul(bias: bool, stride: int) -> None:
    x = torch.randn(3, 12, 1, 1)
    weight = torch.randn(5, 12, 1, 1)
    b = torch.randn(5) if bias else None

    def fc(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, weight, b, stride=stride)

    graph = kiln.trace(fc, x, weight)
    inputs = graph_inputs(graph, fc, x, weight)
    expected = interpret(graph, inputs)
    rewritten = verify(convolutions_as_matmuls(graph))
    assert _ops(rewritten) == [Op.ADDMM if bias else Op.MM]
    (got,) = interpret(rewritten, inputs)
    assert got.shape == (3, 5, 1, 1)
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "arguments"),
    [
        ((2, 6, 4, 4), (3, 6, 1, 1), {}),  # larger images: convolutions stay (for now)
        ((2, 6, 1, 1), (3, 6, 3, 3), {"padding": 1}),  # a 3x3 kernel
        ((2, 6, 1, 1), (3, 6, 1, 1), {"padding": 1}),  # padding makes a 3x3 output
        ((2, 6, 1, 1), (6, 3, 1, 1), {"groups": 2}),
        ((2, 6, 1), (3, 6, 1), {}),  # 1-d: fine too
    ],
)
def test_other_convolutions_are_left_alone(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], arguments: dict[str, Any]
) -> None:
    conv = F.conv1d if len(x_shape) == 3 else F.conv2d
    graph = kiln.trace(
        lambda x, w: conv(x, w, **arguments), torch.randn(x_shape), torch.randn(w_shape)
    )
    rewritten = convolutions_as_matmuls(graph)
    one_by_one = len(x_shape) == 3
    assert _ops(rewritten) == ([Op.MM] if one_by_one else [Op.CONVOLUTION])


class _SqueezeExcitation(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = torch.nn.Conv2d(16, 4, 1)
        self.fc2 = torch.nn.Conv2d(4, 16, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.conv(x))
        scale = torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(y, 1)))))
        return y * scale


def test_squeeze_excitation_trains_like_eager() -> None:
    torch.manual_seed(0)
    model = _SqueezeExcitation()
    compiled = kiln.compile(model)
    explained = str(kiln.explain(model, torch.randn(2, 8, 6, 6)))
    assert explained.count("extern convolution") == 1, explained  # the 3x3 one
    assert explained.count("extern addmm") == 1 and explained.count("extern mm") == 1
    graphs = kiln.counters.graphs
    for batch in (2, 2, 3):
        x = torch.randn(batch, 8, 6, 6, requires_grad=True)
        got, want = compiled(x), model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(want)
        names = ["x", *(name for name, _ in model.named_parameters())]
        tensors = [x, *model.parameters()]
        for name, a, b in zip(
            names,
            torch.autograd.grad(got, tensors, grad),
            torch.autograd.grad(want, tensors, grad),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert kiln.counters.graphs - graphs == 2 and not kiln.counters.fallbacks  # batch 2, then 3
