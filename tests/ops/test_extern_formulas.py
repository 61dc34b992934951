"""Generic externs whose result types and CPU layouts are known without running them: the CPU
flash attention a training graph calls, its backward, and convolution backward
(``extern_shapes.EXTERN_FORMULAS``, ``schedule.layouts``). Each formula is checked against
the abstract (FakeTensor) run and each layout against PyTorch's real CPU call; a first
training call that needs neither imports no sympy (it cost tiny_gpt's first call 1.4 s)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kiln.ir.graph import Node, Value
from kiln.ir.op import Op
from kiln.ir.types import TensorType
from kiln.ops.attention import sdpa_cpu_backward, sdpa_cpu_forward
from kiln.ops.attrs import ExternAttrs, Slot
from kiln.ops.extern_meta import run_abstractly
from kiln.ops.extern_shapes import extern_result_types
from kiln.ops.externs import _call, convolution_backward
from kiln.schedule import layouts
from kiln.schedule.loops import Buffer, BufferKind
from kiln.schedule.program import View

CPU = torch.device("cpu")
B, H, L, S, E = 2, 3, 5, 7, 8


def _check(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tensors: list[torch.Tensor],
) -> None:
    """The formula's types equal the abstract run's; the layout rule's strides the real call's."""
    attrs = ExternAttrs(fn, args, kwargs)
    types = [TensorType(tuple(t.shape), t.dtype, t.device) for t in tensors]
    formula = extern_result_types(attrs, *types)
    if formula is None:  # no formula for this case: the abstract run types it
        assert fn is sdpa_cpu_forward and tensors[0].dtype == torch.float64
        return
    fake = run_abstractly(_call, attrs, types, fake=True)
    fake_types = [TensorType(tuple(t.shape), t.dtype, CPU) for t in fake]
    assert list(formula) == fake_types
    real = _call(attrs, *tensors)
    outputs = tuple(Value(f"out{i}", t) for i, t in enumerate(formula))
    node = Node(Op.EXTERN, tuple(None for _ in tensors), attrs, outputs)
    views: list[object] = []
    for number, t in enumerate(tensors):
        buffer = Buffer(f"b{number}", tuple(t.shape), t.dtype, CPU, BufferKind.TEMP, t.stride())
        views.append(View(buffer, tuple(t.shape), tuple(t.stride()), 0))
    assert layouts.extern_strides(node, views) == [tuple(r.stride()) for r in real]


def _heads(length: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, length, E] contiguous, or the transpose of a [B, length, H*E] projection."""
    if layout == "contiguous":
        return torch.randn(B, H, length, E, dtype=dtype)
    projection = torch.randn(B, length, 3 * H * E, dtype=dtype)[..., : H * E]
    return projection.view(B, length, H, E).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "projected"])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_attention_types_and_layouts(
    dtype: torch.dtype, layout: str, causal: bool
) -> None:
    q, k, v = _heads(L, layout, dtype), _heads(S, layout, dtype), _heads(S, layout, dtype)
    kwargs = {"is_causal": causal, "scale": None}
    _check(sdpa_cpu_forward, (Slot(0), Slot(1), Slot(2), None), kwargs, [q, k, v])
    out, lse = sdpa_cpu_forward(q, k, v, None, causal)
    grad = torch.randn_like(out)
    args = (Slot(0), Slot(1), Slot(2), Slot(3), None, Slot(4), Slot(5))
    _check(sdpa_cpu_backward, args, kwargs, [grad, q, k, v, out, lse])


def test_irregular_flash_calls_run_pytorch() -> None:
    """Different head sizes (which PyTorch's flash kernel refuses) and 3-D operands have no
    formula: the abstract run decides, with PyTorch's error."""
    attrs = ExternAttrs(sdpa_cpu_forward, (Slot(0), Slot(1), Slot(2), None), {})
    odd = [TensorType((B, H, L, E), torch.float32), TensorType((B, H, S, E), torch.float32)]
    assert extern_result_types(attrs, *odd, TensorType((B, H, S, 4), torch.float32)) is None
    flat = [TensorType((H, L, E), torch.float32)] * 3
    assert extern_result_types(attrs, *flat) is None


def _stride_two(padding: tuple[int, int]) -> dict[str, Any]:
    """A 2-D convolution's geometry fields, stride 2, in ``ConvolutionAttrs`` order."""
    return {
        "stride": (2, 2),
        "padding": padding,
        "dilation": (1, 1),
        "transposed": False,
        "output_padding": (0, 0),
        "groups": 1,
    }


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(("wanted", "bias"), [((True, True), True), ((False, True), False)])
def test_convolution_backward_types_and_layouts(
    channels_last: bool, wanted: tuple[bool, bool], bias: bool
) -> None:
    x, weight = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3)
    grad = torch.randn(2, 6, 5, 5)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        grad = grad.contiguous(memory_format=torch.channels_last)
    geometry = _stride_two((1, 1))
    args = (Slot(0), Slot(1), Slot(2), (6,) if bias else None, wanted)
    _check(convolution_backward, args, geometry, [grad, x, weight])


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("wanted", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("shape", [(3, 8, 10, 12), (5, 8, 10, 12), (3, 8, 9, 9)])
def test_strided_pointwise_convolution_backward(
    channels_last: bool, wanted: tuple[bool, bool], shape: tuple[int, ...]
) -> None:
    """A 1x1 stride-2 convolution's weight gradient (a ResNet shortcut's): PyTorch 2.13's
    CPU kernel for a channels-last input crashed the process at [3, 8, 10, 12] and [5, ...];
    Kiln computes it as the stride-1 gradient of the pixels read, in the layout the layout
    rule predicts, and matches the contiguous computation."""
    x, weight = torch.randn(shape, dtype=torch.float64), torch.randn(16, 8, 1, 1).double()
    geometry = _stride_two((0, 0))
    grad = torch.randn(torch.nn.functional.conv2d(x, weight, stride=2).shape).double()
    expected = torch.ops.aten.convolution_backward(
        grad, x, weight, [16], *geometry.values(), [*wanted, True]
    )
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        grad = grad.contiguous(memory_format=torch.channels_last)
    got = convolution_backward(grad, x, weight, [16], wanted, **geometry)
    want = [e for e, w in zip(expected, (*wanted, True), strict=True) if w]
    assert len(got) == len(want)
    for result, reference in zip(got, want, strict=True):
        torch.testing.assert_close(result, reference)
    args = (Slot(0), Slot(1), Slot(2), (16,), wanted)
    _check(convolution_backward, args, geometry, [grad, x, weight])


def test_first_training_call_imports_no_sympy() -> None:
    """A transformer and a CNN trained on the CPU: every extern's types and layouts come from
    formulas and rules, so nothing imports sympy (PyTorch's meta kernels do, 0.4-1.4 s)."""
    script = """
import sys, torch
import kiln
from kiln.bench.worker import prepare
from kiln.bench.models import training_loss
for name in ("tiny_gpt", "small_cnn"):
    model, inputs, step = prepare(name, "train", torch.device("cpu"), torch.float32)
    step(kiln.compile(model), inputs)
print("sympy" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "False", done.stderr[-2000:]


def test_cpu_flash_kernel_takes_boolean_masks_as_sdpa_does() -> None:
    """A boolean mask reaches the flash kernel as the additive mask
    ``F.scaled_dot_product_attention`` makes of it (PyTorch 2.11's kernel refuses booleans):
    output and gradients equal eager's."""
    q, k, v = (torch.randn(B, H, L, E, requires_grad=True) for _ in range(3))
    mask = torch.rand(B, 1, L, L) > 0.3
    mask[..., 0] = True  # no fully masked row
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, lse = sdpa_cpu_forward(q.detach(), k.detach(), v.detach(), mask)
    torch.testing.assert_close(out, expected.detach())
    grad = torch.randn_like(out)
    wanted = torch.autograd.grad(expected, (q, k, v), grad)
    got = sdpa_cpu_backward(grad, q.detach(), k.detach(), v.detach(), mask, out, lse)
    for mine, theirs in zip(got, wanted, strict=True):
        torch.testing.assert_close(mine, theirs)
