"""ReLU masks read back from the ReLU's output: readers of ``le(x, 0)`` other than the ReLU
itself read ``le(relu(x), 0)``, so a training backward need not keep the pre-activation."""

from __future__ import annotations

import copy

import torch

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes.relu_mask import read_relu_masks_from_outputs
from tests.backends.op_table import run_compiled


def _edge_values() -> torch.Tensor:
    x = torch.randn(6, 8)
    x[0, :4] = torch.tensor([0.0, -0.0, float("nan"), float("-inf")])
    x[1, :2] = torch.tensor([float("inf"), 1e-45])
    return x


def test_other_readers_of_a_relu_mask_read_it_from_the_relu_output() -> None:
    def f(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = x <= 0
        y = torch.where(mask, 0.0, x)
        return y * 2, torch.where(mask, 0.0, g)  # the gradient form reads the same mask

    x, g = _edge_values(), torch.randn(6, 8)
    graph = kiln.trace(f, x, g)
    inputs = graph_inputs(graph, f, x, g)
    expected = interpret(graph, inputs)
    rewritten = verify(read_relu_masks_from_outputs(graph))
    masks = [n for n in rewritten.nodes if n.op is Op.LE]
    assert len(masks) == 2
    x_value = masks[0].inputs[0]
    relu = next(n for n in rewritten.nodes if n.op is Op.WHERE and n.inputs[2] is x_value)
    assert masks[1].inputs[0] is relu.output  # the second mask reads the ReLU's output
    for got, want in zip(interpret(rewritten, inputs), expected, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)
    for got, want in zip(run_compiled(rewritten, inputs, "evaluate"), expected, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_lt_masks_and_nonzero_thresholds_are_left_alone() -> None:
    def f(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        below = x < 0  # y < 0 never holds for y = where(x < 0, 0, x): not a function of y
        small = x <= 0.5
        return (
            torch.where(below, 0.0, x),
            torch.where(below, 0.0, g),
            torch.where(small, 0.0, x),
            torch.where(small, 0.0, g),
        )

    x, g = _edge_values(), torch.randn(6, 8)
    graph = kiln.trace(f, x, g)
    assert read_relu_masks_from_outputs(graph) is graph


def test_relu_network_trains_like_eager_with_the_mask_from_the_output() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, padding=1),
    )
    x = torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(net)
    kiln.compile(net)(x).square().mean().backward()
    reference(x).square().mean().backward()
    for got, want in zip(net.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
