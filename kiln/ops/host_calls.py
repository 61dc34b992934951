"""The hottest externs bound for the host program: one PyTorch call, no checks.

A registry row's implementation checks its operands (floating, one dtype), because tests and
the reference backend call it on anything. In a compiled program those checks were made when
the graph was typed, and each costs microseconds a call: ResNet-50's inference program calls
53 convolutions a step, BERT's 86 matmuls. :func:`host_call` gives, for the matmul family and
convolution, a callable taking the operands and making only the PyTorch call, its attrs
bound once; other ops keep their row's implementation. A float32 matmul on the CPU runs
through oneDNN instead of ``torch.mm`` where that was measured faster on this machine
(:mod:`kiln.ops.cpu_matmul`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Node, Value
from kiln.ir.op import Op
from kiln.ir.types import TensorType
from kiln.ops import cpu_matmul as cpu_matmul_library
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


def host_call(
    op: Op, attrs: Any, operands: Sequence[TensorType | None] = (), cpu_matmul: str = "auto"
) -> HostCall | None:
    """The unchecked host callable of ``op`` with ``attrs`` bound, or None (use the row's
    implementation). ``operands`` are the types of the tensor operands, when known;
    ``cpu_matmul`` picks the library of float32 CPU matmuls (``Options.cpu_matmul``)."""
    onednn = _onednn_gemm(op, attrs, operands, cpu_matmul)
    if onednn is not None:
        return onednn
    binder = _BINDERS.get(op)
    return binder(attrs) if binder is not None else None


def operand_types(node: Node) -> list[TensorType | None]:
    """The types of ``node``'s operands (None for a non-tensor operand)."""
    return [v.type if isinstance(v, Value) else None for v in node.inputs]


def library(node: Node, cpu_matmul: str = "auto") -> str:
    """Which library other than PyTorch's default call runs ``node`` ("oneDNN"), or ""
    (``kiln.explain`` says it)."""
    return "oneDNN" if _onednn_gemm(node.op, node.attrs, operand_types(node), cpu_matmul) else ""


def _onednn_gemm(
    op: Op, attrs: Any, operands: Sequence[TensorType | None], choice: str
) -> HostCall | None:
    """``mm(a, b)`` and ``addmm(bias, a, b)`` (a bias per column, no scaling) as oneDNN's
    ``linear(a, b.T, bias)``, for float32 CPU operands of a size where that is faster."""
    if op not in (Op.MM, Op.ADDMM) or not operands or any(t is None for t in operands):
        return None
    types = [t for t in operands if t is not None]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in types):
        return None
    a, b = types[-2].shape, types[-1].shape
    if not all(isinstance(d, int) and d > 0 for d in (*a, *b)):
        return None
    m, k, n = a[0], a[1], b[1]
    if op is Op.ADDMM:
        scaled = attrs is not None and (attrs.beta != 1 or attrs.alpha != 1)
        if scaled or types[0].shape != (n,):
            return None
    linear = cpu_matmul_library.onednn_linear()
    if linear is None or not cpu_matmul_library.use_onednn(m, k, n, choice):  # type: ignore[arg-type]
        return None
    if op is Op.MM:
        return lambda x, y: linear(x, y.t(), None, "none", [], "")
    return lambda bias, x, y: linear(x, y.t(), bias, "none", [], "")
