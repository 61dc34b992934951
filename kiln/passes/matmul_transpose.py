"""Transposed matmul results: ``mm(a, b).T`` becomes ``mm(b.T, a.T)``.

A linear layer's weight gradient comes out of autodiff as the transpose of a product: the
forward multiplies by ``w.T`` (``[in, out]``), so its VJP computes ``x.T @ g`` (``[in, out]``)
and transposes it back to the weight's ``[out, in]``. That result is a column-major view, and
PyTorch's autograd copies every such gradient into the parameter's layout when it accumulates
it (8 copies a step in the CPU suite's tiny_gpt). Multiplying the transposed operands instead
gives the same values already row-major; transposes of operands are free, as matmul libraries
take them by strides::

    before:  t2 = mm(t0, t1)            # [128, 64] @ [64, 512] -> [128, 512]
             t3 = permute(t2, dims=(1, 0))
    after:   t4 = permute(t1, dims=(1, 0)); t5 = permute(t0, dims=(1, 0))
             t3 = mm(t4, t5)            # [512, 64] @ [64, 128] -> [512, 128]

Only products whose every reader is such a transpose are rewritten (else both layouts would
be needed), and not those whose columns ``matmul_padding`` pads: it pads ``N`` and ``K``, and
an unpadded ``M`` of 50257 ran 4.7x slower than padded on the H100
(``benchmarks/matmul_alignment.py``). DCE drops the old product.
"""

from __future__ import annotations

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ops import prims
from kiln.passes.matmul_padding import padding
from kiln.passes.rewriting import rewrite_nodes, take_over

_SWAP = (1, 0)


def _is_transpose(node: Node) -> bool:
    return node.op is Op.PERMUTE and tuple(node.attrs.dims) == _SWAP


def _chosen(graph: Graph) -> set[Node]:
    users = graph.users()
    outputs = {*graph.outputs, *(new for _, new in graph.mutations)}
    chosen: set[Node] = set()
    for node in graph.nodes:
        if node.op is not Op.MM or node.output in outputs:
            continue
        pads = padding(node)
        if pads is not None and pads[1]:  # its N padded: transposed, an unpadded M
            continue
        readers = users.get(node.output, [])
        if readers and all(_is_transpose(reader) for reader in readers):
            chosen.update(readers)
    return chosen


def _emit(node: Node, builder: GraphBuilder) -> None:
    product = node.inputs[0]
    assert isinstance(product, Value) and product.node is not None
    a, b = product.node.inputs
    with builder.origin_scope(product.node.origin):
        result = prims.mm(prims.permute(b, dims=_SWAP), prims.permute(a, dims=_SWAP))
    take_over(node.output, result)


def transpose_matmul(graph: Graph) -> Graph:
    """``graph`` with transposed products computed transposed (module docstring)."""
    return rewrite_nodes(graph, _chosen(graph), _emit)
