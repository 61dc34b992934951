"""The hottest externs bound for the host program: one PyTorch call, no checks.

A registry row's implementation checks its operands (floating, one dtype), because tests and
the reference backend call it on anything. In a compiled program those checks were made when
the graph was typed, and each costs microseconds a call: ResNet-50's inference program calls
53 convolutions a step, BERT's 86 matmuls. :func:`host_call` gives, for the matmul family and
convolution, a callable taking the operands and making only the PyTorch call, its attrs
bound once; other ops keep their row's implementation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kiln.ir.op import Op
from kiln.ops.attrs import ConvolutionAttrs, GemmAttrs

HostCall = Callable[..., torch.Tensor]


def _gemm(fn: Callable[..., torch.Tensor]) -> Callable[[GemmAttrs | None], HostCall]:
    def bind(attrs: GemmAttrs | None) -> HostCall:
        if attrs is None or (attrs.beta == 1 and attrs.alpha == 1):
            return fn
        return functools.partial(fn, beta=attrs.beta, alpha=attrs.alpha)

    return bind


def _convolution(attrs: ConvolutionAttrs) -> HostCall:
    geometry = (attrs.stride, attrs.padding, attrs.dilation, attrs.transposed)
    rest = (attrs.output_padding, attrs.groups)
    convolution = torch.convolution

    def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return convolution(x, weight, bias, *geometry, *rest)

    return call


_BINDERS: dict[Op, Callable[[Any], HostCall]] = {
    Op.MM: _gemm(torch.mm),
    Op.BMM: _gemm(torch.bmm),
    Op.ADDMM: _gemm(torch.addmm),
    Op.BADDBMM: _gemm(torch.baddbmm),
    Op.CONVOLUTION: _convolution,
}


def host_call(op: Op, attrs: Any) -> HostCall | None:
    """The unchecked host callable of ``op`` with ``attrs`` bound, or None (use the row's
    implementation)."""
    binder = _BINDERS.get(op)
    return binder(attrs) if binder is not None else None
