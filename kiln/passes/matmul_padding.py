"""Matmul padding: 16-bit GPU matmuls whose sizes are not multiples of 8 get zero-padded.

cuBLAS's fast tensor-core kernels want every leading dimension of a 16-bit matrix to be a
multiple of 8 elements (16 bytes). GPT-2's LM head multiplies by a ``768 x 50257`` weight: with
``N = 50257`` cuBLAS falls back to a kernel several times slower. Zero columns (``N``) and zero
rows and columns along ``K`` do not change the product, so the pass pads and slices::

    before:  t2 = mm(t0, t1)                          # [8192, 768] @ [768, 50257]
    after:   t3 = pad(t1, low=(0, 0), high=(0, 7))    # [768, 50264]: fused into t1's producer
             t4 = mm(t0, t3)
             t2 = slice(t4, dim=1, start=0, stop=50257)

The pad is index arithmetic the scheduler fuses into whatever kernel produces the operand (under
autocast, the weight's bf16 conversion), and the slice is a strided view. A graph output that is
such a view is returned as it is, with the padded row stride, as torch.compile returns GPT-2's
logits (eager's are dense): a dense copy held two copies of the logits at the peak (+785 MiB on
GPT-2) and cost 0.57 ms a step on the H100. Only CUDA graphs with float16/bfloat16 matmuls of at
least 256 along the padded size are touched.
"""

from __future__ import annotations

import torch

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ir.types import concrete_shape
from kiln.ops import prims
from kiln.passes.rewriting import rewrite_nodes, take_over

ALIGNMENT = 8
MIN_SIZE = 256
_DTYPES = (torch.float16, torch.bfloat16)
DEVICE_TYPES = ("cuda",)  # where cuBLAS's alignment matters (tests add "cpu")


def padding(node: Node) -> tuple[int, int] | None:
    """(K padding, N padding) for a matmul worth padding, else None."""
    if node.op not in (Op.MM, Op.ADDMM):
        return None
    a, b = node.inputs[-2], node.inputs[-1]
    if not isinstance(a, Value) or not isinstance(b, Value):
        return None
    out = node.output.type
    if out.device.type not in DEVICE_TYPES or out.dtype not in _DTYPES or a.type.dtype != out.dtype:
        return None
    if node.op is Op.ADDMM and not isinstance(node.inputs[0], Value):
        return None
    k, n = concrete_shape(b.type.shape)
    pad_k = -k % ALIGNMENT if k >= MIN_SIZE else 0
    pad_n = -n % ALIGNMENT if n >= MIN_SIZE else 0
    return (pad_k, pad_n) if pad_k or pad_n else None


def _pad_last(value: Value, amount: int, dim: int) -> Value:
    """``value`` zero-padded by ``amount`` at the end of ``dim``. A transposed operand (a
    ``linear`` weight) is padded before its transpose, so the kernel that writes the padded
    copy reads and writes along the same rows."""
    node = value.node
    if node is not None and node.op is Op.PERMUTE and node.attrs.dims == (1, 0):
        source = node.inputs[0]
        assert isinstance(source, Value)
        return prims.call(Op.PERMUTE, _pad_last(source, amount, 1 - dim), dims=(1, 0))
    rank = value.type.rank
    high = tuple(amount if d == dim else 0 for d in range(rank))
    return prims.call(Op.PAD, value, low=(0,) * rank, high=high, value=0)


def _emit(node: Node, builder: GraphBuilder) -> None:
    pad_k, pad_n = padding(node) or (0, 0)
    a, b = node.inputs[-2], node.inputs[-1]
    assert isinstance(a, Value) and isinstance(b, Value)
    n = concrete_shape(b.type.shape)[1]
    with builder.origin_scope(node.origin):
        if pad_k:
            a, b = _pad_last(a, pad_k, 1), _pad_last(b, pad_k, 0)
        if pad_n:
            b = _pad_last(b, pad_n, 1)
        if node.op is Op.MM:
            result = prims.mm(a, b)
        else:
            bias = node.inputs[0]
            assert isinstance(bias, Value)
            if pad_n and concrete_shape(bias.type.shape)[-1] == n:
                bias = _pad_last(bias, pad_n, bias.type.rank - 1)
            result = prims.addmm(bias, a, b, beta=node.attrs.beta, alpha=node.attrs.alpha)
        if pad_n:
            result = prims.call(Op.SLICE, result, dim=1, start=0, stop=n, step=1)
    take_over(node.output, result)


def pad_matmul(graph: Graph) -> Graph:
    """``graph`` with misaligned 16-bit GPU matmuls padded to multiples of 8."""
    chosen = {node for node in graph.nodes if padding(node) is not None}
    return rewrite_nodes(graph, chosen, _emit)
