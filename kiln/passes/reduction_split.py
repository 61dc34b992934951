"""Reduction splitting: a reduction over leading and trailing dims becomes two reductions.

A BatchNorm in training reduces ``[N, C, H, W]`` over ``(0, 2, 3)``: only ``C`` rows, each
``N*H*W`` long and strided. One kernel gives each row to one program, so a ResNet's first
BatchNorm (64 rows of 802816) keeps 64 of a GPU's thousands of cores busy. Reducing the
contiguous trailing dims first gives ``N*C`` rows of ``H*W`` (parallel and coalesced), and the
second reduction over ``N`` is small::

    before:  t1 = sum(t0, dims=(0, 2, 3))            # [64, 64, 112, 112] -> [64]
    after:   t2 = sum(t0, dims=(2, 3))               # -> [64, 64]
             t1 = sum(t2, dims=(0,))                 # -> [64]

16-bit floats are summed in float32 across both steps (as one reduction accumulates), then
rounded once. Max and min split the same way; arg-reductions and products are left alone.
"""

from __future__ import annotations

import torch

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ir.types import concrete_shape
from kiln.ops import prims
from kiln.passes.rewriting import rewrite_nodes, take_over

SPLIT_OPS = (Op.SUM, Op.AMAX, Op.AMIN)
MAX_ROWS = 4096  # split only reductions with fewer output elements than this
MIN_INNER = 64  # and whose trailing reduced dims hold at least this many elements
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _plan(node: Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(trailing dims, leading dims) of a reduction worth splitting."""
    if node.op not in SPLIT_OPS or not isinstance(node.inputs[0], Value):
        return None
    shape = concrete_shape(node.inputs[0].type.shape)
    dims = tuple(sorted(node.attrs.dims))
    trailing: list[int] = []
    for dim in range(len(shape) - 1, -1, -1):
        if dim not in dims:
            break
        trailing.insert(0, dim)
    leading = tuple(d for d in dims if d not in trailing)
    if not trailing or not leading:
        return None
    rows = 1
    for dim, size in enumerate(shape):
        if dim not in dims:
            rows *= size
    inner = 1
    for dim in trailing:
        inner *= shape[dim]
    if rows >= MAX_ROWS or inner < MIN_INNER:
        return None
    return tuple(trailing), leading


def _emit(node: Node, builder: GraphBuilder) -> None:
    plan = _plan(node)
    assert plan is not None
    trailing, leading = plan
    source = node.inputs[0]
    assert isinstance(source, Value)
    dtype = source.type.dtype
    widen = node.op is Op.SUM and dtype in _LOW_PRECISION
    with builder.origin_scope(node.origin):
        if widen:
            source = prims.convert(source, dtype=torch.float32)
        partial = prims.call(node.op, source, dims=trailing)
        result = prims.call(node.op, partial, dims=leading)
        if widen:
            result = prims.convert(result, dtype=dtype)
    take_over(node.output, result)


def split_reductions(graph: Graph) -> Graph:
    """``graph`` with reductions over leading and trailing dims split in two."""
    chosen = {node for node in graph.nodes if _plan(node) is not None}
    return rewrite_nodes(graph, chosen, _emit)
