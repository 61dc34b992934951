"""fold_conv_batchnorm: an eval BatchNorm after a convolution folds into the convolution's weight
and bias, computing the same outputs as parameters change; training graphs are left alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import SmallResNet
from torch import nn

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Graph, Op, interpret, verify
from kiln.passes import fold_conv_batchnorm, optimize


def _randomized(model: nn.Module) -> nn.Module:
    """Random parameters and running statistics (so folding them is visible in the outputs)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
            if isinstance(module, nn.modules.batchnorm._BatchNorm | nn.Conv1d | nn.Conv2d):
                for parameter in module.parameters():
                    parameter.normal_()
    return model


def _trace(model: nn.Module, x: torch.Tensor) -> Graph:
    with torch.no_grad():
        return kiln.trace(model, x)


def _check_folded(model: nn.Module, x: torch.Tensor, graph: Graph) -> Graph:
    """Fold ``graph`` and compare it with the original on fresh parameters and inputs."""
    fresh_x = torch.randn_like(x)
    inputs = graph_inputs(graph, _randomized(model), fresh_x)
    expected = interpret(graph, inputs)
    folded = verify(fold_conv_batchnorm(graph))
    for actual, want in zip(interpret(folded, inputs), expected, strict=True):
        torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    return folded


def _activation_ops(graph: Graph, conv_count: int) -> None:
    """Every convolution's output goes on without BatchNorm arithmetic (a mul reading it)."""
    users = graph.users()
    convs = [node for node in graph.nodes if node.op is Op.CONVOLUTION]
    assert len(convs) == conv_count
    for conv in convs:
        assert all(user.op is not Op.MUL for user in users[conv.output]), str(graph)


FOLDED = [
    ("conv2d with bias", nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)), 3),
    ("conv2d, no bias", nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)), 3),
    (
        "groups=2, stride 2",
        nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, groups=2, bias=False), nn.BatchNorm2d(6)),
        4,
    ),
    (
        "BatchNorm without affine",
        nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, affine=False)),
        3,
    ),
    ("conv1d", nn.Sequential(nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5)), 3),
]


@pytest.mark.parametrize(("model", "channels"), [c[1:] for c in FOLDED], ids=[c[0] for c in FOLDED])
def test_eval_batchnorm_folds_into_the_convolution(model: nn.Module, channels: int) -> None:
    model = _randomized(model).eval()
    x = (
        torch.randn(2, channels, 8)
        if isinstance(model[0], nn.Conv1d)
        else torch.randn(2, channels, 8, 8)
    )
    graph = _trace(model, x)
    folded = _check_folded(model, x, graph)
    _activation_ops(folded, 1)
    assert folded.outputs[0].node is not None and folded.outputs[0].node.op is Op.CONVOLUTION


def test_resnet_style_cnn_folds_every_batchnorm() -> None:
    model = _randomized(SmallResNet()).eval()
    x = torch.randn(2, 3, 16, 16)
    graph = _check_folded(model, x, _trace(model, x))
    _activation_ops(graph, 6)
    optimized = verify(optimize(_trace(model, x)))
    _activation_ops(optimized, 6)


def _unchanged(graph: Graph, model: nn.Module, x: torch.Tensor) -> None:
    before = [node.op for node in graph.nodes]
    inputs = graph_inputs(graph, model, x)
    expected = interpret(graph, inputs)
    result = verify(fold_conv_batchnorm(graph))
    assert [node.op for node in result.nodes] == before
    torch.testing.assert_close(interpret(result, inputs), expected)


def test_training_batchnorm_is_left_alone() -> None:
    """Batch statistics depend on the convolution's output; the running stats are mutated."""
    model = _randomized(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).train()
    x = torch.randn(2, 3, 6, 6)
    graph = _trace(model, x)
    assert graph.mutations
    _unchanged(graph, model, x)


def test_graph_that_records_gradients_is_left_alone() -> None:
    model = _randomized(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    x = torch.randn(2, 3, 6, 6)
    _unchanged(kiln.trace(model, x), model, x)


class _ConvReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.conv(x)
        return self.bn(y), y


def test_convolution_read_elsewhere_is_left_alone() -> None:
    model = _randomized(_ConvReadTwice()).eval()
    x = torch.randn(2, 3, 6, 6)
    _unchanged(_trace(model, x), model, x)
