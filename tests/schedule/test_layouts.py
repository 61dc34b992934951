"""Extern strides without a call: a convolution reading a channels-last operand answers
channels-last, on the GPU too, where other convolutions are probed (one real call)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.ir.graph import Node, Value
from kiln.ir.op import Op
from kiln.ir.types import TensorType
from kiln.ops.attrs import ConvolutionAttrs
from kiln.schedule import layouts
from kiln.schedule.loops import Buffer, BufferKind
from kiln.schedule.program import View


def _conv(device: str, channels_last: bool) -> tuple[Node, list[object]]:
    cuda = torch.device(device)
    x_shape, w_shape, out_shape = (2, 8, 6, 6), (4, 8, 3, 3), (2, 4, 4, 4)
    strides = layouts.channels_last_strides(x_shape) if channels_last else (288, 36, 6, 1)
    x = Buffer("x", x_shape, torch.float32, cuda, BufferKind.TEMP, strides)
    w = Buffer("w", w_shape, torch.float32, cuda, BufferKind.INPUT, (72, 9, 3, 1))
    out = Value("out", TensorType(out_shape, torch.float32, cuda))
    attrs = ConvolutionAttrs(stride=(1, 1), padding=(0, 0), dilation=(1, 1))
    node = Node(Op.CONVOLUTION, (None, None, None), attrs, (out,))
    return node, [View(x, x_shape, strides, 0), View(w, w_shape, w.strides, 0), None]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_channels_last_convolution_is_not_probed(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def probe(*_: Any) -> None:
        raise AssertionError("probed")

    monkeypatch.setattr(layouts, "probe_strides", probe)
    node, operands = _conv(device, channels_last=True)
    assert layouts.extern_strides(node, operands) == [(64, 1, 16, 4)]


def test_an_nchw_gpu_convolution_is_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[object] = []

    def probe(node: Node, operands: list[object]) -> list[tuple[int, ...]]:
        probed.append(node)
        return [(64, 16, 4, 1)]

    monkeypatch.setattr(layouts, "probe_strides", probe)
    node, operands = _conv("cuda", channels_last=False)
    assert layouts.extern_strides(node, operands) == [(64, 16, 4, 1)] and probed == [node]
