"""Factors constant along a sum move out of it: ``sum(c * e)`` is ``c * sum(e)``, so a
BatchNorm backward's last sum no longer waits for the others."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes import eliminate_dead_code
from kiln.passes.sum_factor import factor_sums
from kiln.recording import listen, unlisten
from tests.backends.op_table import run_compiled


def test_a_factor_broadcast_along_the_summed_dims_moves_out() -> None:
    def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        spread = c[:, :, None, None] * (x - 0.5)  # c: [N, C], constant along (2, 3)
        return -(spread + spread).sum(dim=(2, 3)) * 3

    x, c = torch.randn(2, 3, 4, 5), torch.randn(2, 3)
    graph = kiln.trace(f, x, c)
    inputs = graph_inputs(graph, f, x, c)
    expected = interpret(graph, inputs)
    rewritten = verify(eliminate_dead_code(factor_sums(graph)))
    (summed,) = [n for n in rewritten.nodes if n.op is Op.SUM]
    operand = summed.inputs[0]
    assert operand.node is not None and operand.node.op is Op.SUB  # type: ignore[union-attr]
    for got, want in zip(interpret(rewritten, inputs), expected, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(run_compiled(rewritten, inputs, "evaluate"), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_a_factor_varying_along_a_summed_dim_stays_inside() -> None:
    def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (c[:, :, None] * x).sum(dim=(1, 2))  # c varies along dim 1, which is summed

    x, c = torch.randn(2, 3, 4), torch.randn(2, 3)
    graph = kiln.trace(f, x, c)
    assert factor_sums(graph) is graph


@pytest.mark.parametrize("channels_last_sums", [False, True])
def test_batchnorm_backward_sums_share_one_kernel_and_match_eager(
    channels_last_sums: bool, monkeypatch: Any
) -> None:
    # The variance's gradient into the mean, sum(c * (x - mean)), joins the kernel of the
    # other two sums: the backward is recompute, sums, per-channel step, gradient (4 kernels;
    # 3 where the sums are channels-last columns, as on the GPU). With the GPU's column
    # split, this needs the graph autodiff differentiates to be unsplit: the VJP of a split
    # sum hid the per-channel factor behind a permute and reshapes.
    if channels_last_sums:
        import kiln.passes.reduction_split as reduction_split

        monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, padding=1),
    )
    x = torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(net)
    records: list = []
    listen(records, CompiledProgramRecord)
    try:
        kiln.compile(net)(x).square().mean().backward()
    finally:
        unlisten(records)
    reference(x).square().mean().backward()
    for got, want in zip(net.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    (backward,) = [r for r in records if r.graph.endswith("backward")]
    launched = backward.program.kernels()
    kernels = [k for k in [*launched, *(p for k in launched for p in k.parts)] if k.xnumel > 1]
    # the incoming gradient and the saved input, NCHW graph inputs, are copied channels-last
    # for the convolutions' backward (in the launch of another kernel: they depend on none);
    # the rest are the BatchNorm backward's
    copies = [k for k in kernels if k.name.endswith("channels_last")]
    assert len(copies) == 2
    assert len(kernels) - len(copies) <= 4, [k.name for k in kernels]
