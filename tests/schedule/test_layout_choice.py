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


def test_a_convolution_operand_is_channels_last_beside_a_contiguous_store() -> None:
    # The kernel storing the residual stream (contiguous, like the input it is computed from)
    # also stores the convolution's operand: that one is still channels-last, cuDNN's fast
    # layout (an NCHW depthwise convolution is PyTorch's generic kernel on the GPU).
    from kiln.ir import Op
    from kiln.schedule.program import ExternCall
    from tests.schedule.test_fusion import scheduled

    def block(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stream = x + a
        return stream, F.conv2d(stream * 2.0, w, padding=1, groups=8)

    x, a, w = torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6), torch.randn(8, 1, 3, 3)
    program = scheduled(block, x, a, w)
    (convolution,) = [
        s for s in program.steps if isinstance(s, ExternCall) and s.node.op is Op.CONVOLUTION
    ]
    operand = convolution.operands[0]
    assert operand.strides == (288, 1, 48, 8), operand
    stream = program.outputs[0]
    assert stream.strides == (288, 36, 6, 1)
    assert kiln.compile(block)(x, a, w)[1].allclose(block(x, a, w)[1], atol=1e-5)
