"""Attention that will be differentiated keeps its log-sum-exp (CPU).

Autodiff's general rule for attention re-runs ``F.scaled_dot_product_attention`` under autograd
in the backward, so every attention layer runs its forward twice a training step. Eager
autograd does not: PyTorch's flash kernels return each row's log-sum-exp next to the output,
and their backward starts from those. On the CPU, where ``F.scaled_dot_product_attention``
picks the flash kernel, this pass calls that kernel directly and keeps both results, so the
backward (``ops.attention.sdpa_cpu_backward``, registered in ``externs.EXTERN_VJPS``) is the
kernel's own::

    before:  t3 = sdpa(t0, t1, t2, None, is_causal=True)
    after:   t3, t4 = extern(t0, t1, t2, fn=sdpa_cpu_forward, ...)   # output, log-sum-exp

Only graphs where q, k or v require grad are touched (inference keeps the plain SDPA), and
only where PyTorch's own choice for these shapes and dtypes is the flash kernel (checked with
``torch._fused_sdp_choice`` on empty tensors of the same sizes), so the numbers are eager's.
Grouped-query attention and masks that require grad keep the general rule. CUDA's kernels
(flash, memory-efficient, cuDNN) each have their own signature: not done yet.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ir.types import concrete_shape
from kiln.ops.attention import sdpa_cpu_forward
from kiln.ops.externs import extern_call
from kiln.passes.rewriting import rewrite_nodes


def _chosen(node: Node) -> bool:
    if node.op is not Op.SDPA or node.attrs.enable_gqa:
        return False
    q, k, v, mask = node.inputs
    tensors = [t for t in (q, k, v) if isinstance(t, Value)]
    if len(tensors) != 3 or any(t.type.device.type != "cpu" for t in tensors):
        return False
    if not any(t.type.requires_grad for t in tensors) or q.type.rank != 4:  # type: ignore[union-attr]
        return False
    if isinstance(mask, Value) and mask.type.requires_grad:
        return False
    return _flash_is_eagers_choice(node)


def _flash_is_eagers_choice(node: Node) -> bool:
    """Whether PyTorch picks the flash kernel for this call (empty tensors: nothing is read)."""
    try:
        empties = [
            torch.empty(concrete_shape(v.type.shape), dtype=v.type.dtype)
            if isinstance(v, Value)
            else None
            for v in node.inputs
        ]
        q, k, v, mask = empties
        assert q is not None and k is not None and v is not None
        attrs = node.attrs
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, attrs.is_causal, scale=attrs.scale)
    except Exception:  # symbolic sizes, an unusual mask: keep the general rule
        return False
    return bool(choice == SDPBackend.FLASH_ATTENTION.value)


def _emit(node: Node, builder: GraphBuilder) -> None:
    q, k, v, mask = node.inputs
    options = {"is_causal": node.attrs.is_causal, "scale": node.attrs.scale}
    with builder.origin_scope(node.origin):
        out, lse = extern_call(sdpa_cpu_forward, (q, k, v, mask), options)
    # The extern computes the old output Value (every reader stays connected) and the lse.
    extern = out.node
    assert extern is not None
    extern.outputs = (node.output, lse)
    node.output.node = extern


def keep_attention_statistics(graph: Graph) -> Graph:
    """``graph`` with differentiated CPU attention keeping its log-sum-exp (module docstring)."""
    return rewrite_nodes(graph, {n for n in graph.nodes if _chosen(n)}, _emit)
