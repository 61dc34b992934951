"""Attention that will be differentiated keeps its log-sum-exp.

Autodiff's general rule for attention re-runs ``F.scaled_dot_product_attention`` under autograd
in the backward, so every attention layer runs its forward twice a training step. Eager
autograd does not: PyTorch's flash kernels return each row's log-sum-exp next to the output,
and their backward starts from those. This pass calls the kernel eager picks directly and
keeps both results, so the backward (registered in ``externs.EXTERN_VJPS``) is the kernel's
own::

    before:  t3 = sdpa(t0, t1, t2, None, is_causal=True)
    after:   t3, t4 = extern(t0, t1, t2, fn=sdpa_cpu_forward, ...)   # output, log-sum-exp

Only graphs where q, k or v require grad are touched (inference keeps the plain SDPA), and
only where PyTorch's own choice for these shapes, dtypes and gradients is known (asked of
``torch._fused_sdp_choice`` on empty tensors of the same sizes; symbolic sizes at their hints,
on CUDA checked per size: :func:`_kernel`), so the numbers are eager's:
- on the CPU, the flash kernel (``sdpa_cpu_forward``);
- on CUDA (``sdpa_cuda_forward``, the kernel an argument): the flash kernel without a mask,
  cuDNN's without one or with a float one (its additive bias, as eager passes it), each with a
  head size that is a multiple of 8 (eager pads others), and the memory-efficient kernel with
  or without a mask. (A "first-step fault" once blamed on cuDNN with a mask was the layout
  probe's own call on uninitialized tensors, seen by the checking script:
  ``benchmarks/attention_first_step.py`` now leaves probes out.)
  On H100 with PyTorch 2.11, ViT-B/16's training step ran each attention forward twice
  before (24 cuDNN forward kernels a step, 1.1 ms).
Grouped-query attention (``enable_gqa``: k and v with fewer heads) goes to CUDA's flash and
cuDNN kernels as they are, as eager calls them (``benchmarks/attention_backward.py`` on an
H100: gradients identical to eager's with 2 and 4 kv heads of 8). Masks that require grad keep
the general rule, except on CUDA's memory-efficient kernel, which eager picks for a float
mask that requires grad (T5's learned position bias): its backward returns the mask's
gradient too (``sdpa_cuda_backward``'s ``mask_grad``). The math kernel keeps the general rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op
from kiln.ir.symbolic import current_env, hint, substitute
from kiln.ir.types import TensorType
from kiln.ops.attention import (
    CUDA_CUDNN,
    CUDA_EFFICIENT,
    CUDA_FLASH,
    sdpa_cpu_forward,
    sdpa_cuda_forward,
)
from kiln.ops.attrs import SdpaAttrs
from kiln.ops.externs import extern_call
from kiln.passes.rewriting import rewrite_nodes

# cuDNN with a float mask as its bias (a switch for ``benchmarks/attention_backward.py``).
CUDNN_FLOAT_MASKS = True


def _chosen(node: Node) -> bool:
    if node.op is not Op.SDPA:
        return False
    q, k, v, _ = node.inputs
    tensors = [t for t in (q, k, v) if isinstance(t, Value)]
    devices = {t.type.device.type for t in tensors}
    if len(tensors) != 3 or len(devices) != 1 or not devices <= {"cpu", "cuda"}:
        return False
    if node.attrs.enable_gqa and devices != {"cuda"}:
        return False
    if not any(t.type.requires_grad for t in tensors) or q.type.rank != 4:  # type: ignore[union-attr]
        return False
    return _kernel(node) is not None


@dataclass(frozen=True)
class _Call:
    """What PyTorch's kernel choice reads of an SDPA node: its operands' types (None: no
    mask) and attributes."""

    types: tuple[TensorType | None, ...]
    attrs: SdpaAttrs

    @property
    def symbolic(self) -> bool:
        return any(t.is_symbolic for t in self.types if t is not None)

    def kernel(self, values: Mapping[str, int]) -> int | None:
        """The kernel this call runs as at sizes ``values`` of the symbols (an ``SDPBackend``
        value: what eager picks, asked of PyTorch on empty tensors; where this pass calls it
        directly), else None. A symbol ``values`` lacks is taken at its hint."""
        try:
            empties = [
                torch.empty(
                    tuple(hint(substitute(n, values)) for n in t.shape),
                    dtype=t.dtype,
                    device=t.device,
                    requires_grad=t.requires_grad,
                )
                if t is not None
                else None
                for t in self.types
            ]
            q, k, v, mask = empties
            assert q is not None and k is not None and v is not None
            attrs = self.attrs
            choice = torch._fused_sdp_choice(
                q, k, v, mask, 0.0, attrs.is_causal, scale=attrs.scale, enable_gqa=attrs.enable_gqa
            )
        except Exception:  # an unusual mask, no CUDA: keep the general rule
            return None
        if attrs.enable_gqa and choice not in (CUDA_FLASH, CUDA_CUDNN):
            return None  # (only these two read k and v of fewer heads, as eager calls them)
        if mask is not None and mask.requires_grad and choice != CUDA_EFFICIENT:
            return None  # (only the memory-efficient kernel's backward returns the mask's gradient)
        if q.device.type == "cpu":
            return choice if choice == SDPBackend.FLASH_ATTENTION.value else None
        if choice in (CUDA_FLASH, CUDA_CUDNN) and (q.shape[-1] | v.shape[-1]) % 8:
            return None  # (eager pads head sizes)
        bias = (
            CUDNN_FLOAT_MASKS
            and choice == CUDA_CUDNN
            and mask is not None
            and mask.is_floating_point()
        )
        if mask is not None and choice in (CUDA_FLASH, CUDA_CUDNN) and not bias:
            return None  # (flash takes no mask; cuDNN's with a float one: module docstring)
        return choice if choice in (CUDA_FLASH, CUDA_EFFICIENT, CUDA_CUDNN) else None


def _call(node: Node) -> _Call:
    return _Call(tuple(v.type if isinstance(v, Value) else None for v in node.inputs), node.attrs)


def _kernel(node: Node) -> int | None:
    """The kernel ``node`` runs as, asked at the hints of its sizes (:meth:`_Call.kernel`).

    On the CPU that choice holds for every size: PyTorch's CPU flash kernel takes them all,
    and eager's choice there depends on dtypes, masks and gradients (pinned, a dynamic
    transformer's training graph compiled its passes and autodiff once per length). On CUDA
    it may depend on sizes (cuDNN's limits): :func:`_emit` records it as a check on the
    sizes (:attr:`ShapeEnv.checks`), so a size where eager picks another kernel compiles
    again. Symbolic sizes with nothing to record the check: the general rule."""
    call = _call(node)
    if call.symbolic and current_env() is None and node.inputs[0].type.device.type == "cuda":  # type: ignore[union-attr]
        return None
    return call.kernel({})


_NAMES = {CUDA_FLASH: "flash", CUDA_EFFICIENT: "memory-efficient", CUDA_CUDNN: "cuDNN"}


def _emit(node: Node, builder: GraphBuilder) -> None:
    q, k, v, mask = node.inputs
    options: dict[str, object] = {"is_causal": node.attrs.is_causal, "scale": node.attrs.scale}
    if cuda := isinstance(q, Value) and q.type.device.type == "cuda":
        options["backend"] = choice = _kernel(node)
        call, env = _call(node), current_env()
        if call.symbolic and env is not None:
            shapes = ", ".join(repr(list(t.shape)) for t in call.types if t is not None)
            text = f"PyTorch picks its {_NAMES[choice]} attention kernel at {shapes}"  # type: ignore[index]
            env.checks[text] = lambda values: call.kernel(values) == choice
    with builder.origin_scope(node.origin):
        function = sdpa_cuda_forward if cuda else sdpa_cpu_forward
        out, lse = extern_call(function, (q, k, v, mask), options)
    # The extern computes the old output Value (every reader stays connected) and the lse.
    extern = out.node
    assert extern is not None
    extern.outputs = (node.output, lse)
    node.output.node = extern


def keep_attention_statistics(graph: Graph) -> Graph:
    """``graph`` with differentiated attention keeping its log-sum-exp (module docstring)."""
    return rewrite_nodes(graph, {n for n in graph.nodes if _chosen(n)}, _emit)
