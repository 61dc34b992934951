"""Pointwise convolutions of 1x1 images as matmuls.

A squeeze-excitation block (EfficientNet, MobileNetV3, RegNetY and their relatives) runs two
1x1 convolutions on pooled ``[N, C, 1, 1]`` activations. Each is a small GEMM, but as
``torch.convolution`` it costs a convolution call: 33 us of host time on an H100's host
(RegNet-Y-1.6GF: 54 of its 140 convolutions), 0.1-0.2 ms through oneDNN on this project's CPU
for a few thousand multiply-adds. As a matmul it is one GEMM call, and its gradients are
matmuls too::

    before:  t2 = convolution(t0, w, b, stride=(1, 1), padding=(0, 0), ...)   # [N, C, 1, 1]
    after:   t3 = reshape(t0, shape=(N, C)); t4 = reshape(w, shape=(K, C))
             t5 = permute(t4, dims=(1, 0)); t6 = addmm(b, t3, t5)
             t2 = reshape(t6, shape=(N, K, 1, 1))

Only non-transposed, ungrouped floating-point convolutions without padding whose input's
spatial sizes and weight's kernel sizes are all 1 (stride and dilation then change nothing),
with every size concrete.
"""

from __future__ import annotations

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims
from kiln.passes.rewriting import rewrite_nodes, take_over


def _pointwise(node: Node) -> bool:
    if node.op is not Op.CONVOLUTION or node.attrs.transposed or node.attrs.groups != 1:
        return False
    x, weight = node.inputs[0], node.inputs[1]
    if not isinstance(x, Value) or not isinstance(weight, Value) or any(node.attrs.padding):
        return False
    sizes = (*x.type.shape, *weight.type.shape)
    if not x.type.dtype.is_floating_point or not all(isinstance(s, int) for s in sizes):
        return False
    spatial = (*x.type.shape[2:], *weight.type.shape[2:])
    return x.type.rank == weight.type.rank >= 3 and all(size == 1 for size in spatial)


def _emit(node: Node, builder: GraphBuilder) -> None:
    x, weight, bias = node.inputs
    assert isinstance(x, Value) and isinstance(weight, Value)
    (n, c, *spatial), k = x.type.shape, weight.type.shape[0]
    with builder.origin_scope(node.origin):
        rows = prims.reshape(x, shape=(n, c))
        columns = prims.permute(prims.reshape(weight, shape=(k, c)), dims=(1, 0))
        out = prims.mm(rows, columns) if bias is None else prims.addmm(bias, rows, columns)
        result = prims.reshape(out, shape=(n, k, *spatial))
    take_over(node.output, result)


def convolutions_as_matmuls(graph: Graph) -> Graph:
    """``graph`` with its pointwise convolutions of 1x1 images as matmuls."""
    return rewrite_nodes(graph, {node for node in graph.nodes if _pointwise(node)}, _emit)
