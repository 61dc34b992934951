"""Layout choice: values computed through pooling windows and crops keep their input's dim
order, as eager's results do (a max pool of channels-last activations is channels-last)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import kiln

CHANNELS_LAST = torch.channels_last
CONTIGUOUS = torch.contiguous_format


def _relu_max_pool(x: torch.Tensor) -> torch.Tensor:
    return F.max_pool2d(torch.relu(x), 3, 2, 1)


def _avg_pool(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x * 2.0, 2)


def _crop(x: torch.Tensor) -> torch.Tensor:
    return x[:, :, 1:-1, 2:].sigmoid()


@pytest.mark.parametrize("fn", [_relu_max_pool, _avg_pool, _crop])
@pytest.mark.parametrize("memory_format", [CHANNELS_LAST, CONTIGUOUS])
def test_windows_and_crops_keep_the_input_dim_order(
    fn: Callable[[torch.Tensor], torch.Tensor], memory_format: torch.memory_format
) -> None:
    kiln.counters.reset()
    compiled = kiln.compile(fn)
    for size in (16, 16, 11):
        x = torch.randn(2, 8, size, size).to(memory_format=memory_format).requires_grad_()
        want = fn(x)
        grad = torch.randn_like(want)
        (want_grad,) = torch.autograd.grad(want, x, grad)
        got = compiled(x)
        (got_grad,) = torch.autograd.grad(got, x, grad)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
        assert got.is_contiguous(memory_format=memory_format)
        assert got.stride() == want.stride()
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks
