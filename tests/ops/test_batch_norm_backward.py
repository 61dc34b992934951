"""The closed-form BatchNorm backward (``kiln/ops/batch_norm_backward.py``): the marker's
reference implementation under eager autograd (what the reference interpreter runs when a
graph falls back to eager autograd) and the compiled VJP both give eager's gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ops.batch_norm_backward import batch_norm_output


@pytest.mark.parametrize("affine", [True, False])
def test_the_markers_reference_backward_is_eagers(affine: bool) -> None:
    """``x * scale + shift`` passed through the marker: the gradients come from the closed
    form alone (none through the output's producers or the statistics), and match eager's
    batch norm, whose backward holds what flows through the mean and the variance."""
    x = torch.randn(4, 6, 5, 5, dtype=torch.float64, requires_grad=True)
    weight = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_() if affine else None
    bias = torch.randn(6, dtype=torch.float64, requires_grad=True) if affine else None
    g = torch.randn(4, 6, 5, 5, dtype=torch.float64)
    expected = torch.autograd.grad(
        (F.batch_norm(x, None, None, weight, bias, training=True) * g).sum(),
        [t for t in (x, weight, bias) if t is not None],
    )
    mean = x.mean((0, 2, 3))
    inverse = (x.var((0, 2, 3), unbiased=False) + 1e-5).rsqrt()
    scale = inverse * weight if weight is not None else inverse
    shift = -mean * scale + (bias if bias is not None else 0)
    y = x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
    affine_operands = [t for t in (weight, bias) if t is not None]
    out = batch_norm_output(y, x, mean, inverse, *affine_operands, weight=affine, bias=affine)
    torch.testing.assert_close(out, F.batch_norm(x, None, None, weight, bias, training=True))
    got = torch.autograd.grad((out * g).sum(), [t for t in (x, weight, bias) if t is not None])
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("shape", [(8, 5), (4, 6, 7), (2, 6, 5, 5)])
def test_compiled_batch_norm_training_gradients_match_eager(shape: tuple[int, ...]) -> None:
    """Compiled BatchNorm1d/2d training steps (the marker's VJP), every gradient and the
    running statistics, over three calls with fresh inputs."""
    kiln.reset()
    channels = shape[1]
    make = torch.nn.BatchNorm1d if len(shape) < 4 else torch.nn.BatchNorm2d
    eager = torch.nn.Sequential(make(channels), torch.nn.ReLU())
    with torch.no_grad():
        eager[0].weight.uniform_(0.5, 1.5)
        eager[0].bias.normal_()
    model = copy.deepcopy(eager)
    compiled = kiln.compile(model)
    for _ in range(3):
        x = torch.randn(shape) * 3 + 2
        g = torch.randn(shape)
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        (compiled(mine) * g).sum().backward()
        (eager(theirs) * g).sum().backward()
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)
        for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(model[0].running_mean, eager[0].running_mean)
        torch.testing.assert_close(model[0].running_var, eager[0].running_var)
    assert kiln.counters.fallbacks == [] and kiln.counters.graph_breaks == []
