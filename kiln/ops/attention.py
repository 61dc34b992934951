"""Attention: the registry row of SDPA (``F.scaled_dot_product_attention`` without dropout)
and the externs its gradients run as.

Two backward paths. The general one (``sdpa_backward``) re-runs the forward under autograd
with only the operands that need gradients as leaves, so PyTorch picks the same kernel eager
would and runs its backward. Where ``passes.attention_statistics`` can name the kernel eager
picks, a differentiated graph instead calls that kernel directly, keeps its log-sum-exp, and
its VJP is the kernel's own backward, so the forward runs once a step: the CPU flash kernel
(``sdpa_cpu_forward``, ``sdpa_cpu_backward``) and CUDA's flash, memory-efficient and cuDNN
kernels (``sdpa_cuda_forward``, ``sdpa_cuda_backward``, the kernel an argument).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.op import Op, Sample
from kiln.ir.types import FLOATING, TensorType, same_shape, same_size
from kiln.ops import prims
from kiln.ops.attrs import ExternAttrs, SdpaAttrs, Slot
from kiln.ops.extern_shapes import EXTERN_FORMULAS
from kiln.ops.externs import (
    EXTERN_VJPS,
    Case,
    Grads,
    autograd_grads,
    check_floats,
    extern,
    extern_call,
    fields_of,
    grad_leaf,
    needs_grad,
    shape_samples,
    spread_to,
)
from kiln.ops.sampling import FLOATS, make_tensor


def _sdpa(
    attrs: SdpaAttrs,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    check_floats(Op.SDPA, q, k, v)  # torch checks the mask: bool, or q's dtype
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=0.0,
        is_causal=attrs.is_causal,
        scale=attrs.scale,
        enable_gqa=attrs.enable_gqa,
    )


def sdpa_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    wanted: tuple[bool, ...] = (True, True, True, True),
    **options: Any,
) -> tuple[torch.Tensor, ...]:
    """The gradients of those of q, k, v and a floating mask that ``wanted`` names, by
    re-running the forward under autograd (eager's backend choice and its backward);
    ``options``: the fields of :class:`SdpaAttrs`.

    Only wanted operands require grad in the re-run: a mask that requires grad rules out the
    flash and cuDNN kernels (PyTorch falls back to the memory-efficient kernel and computes
    the mask's gradient too), which made attention's backward 4-7x slower than eager's on
    BERT and GPT-2, whose masks are inputs."""
    with torch.inference_mode(False), torch.enable_grad():
        leaves: list[Any] = [
            grad_leaf(t) if want else t for t, want in zip((q, k, v, mask), wanted, strict=True)
        ]
        out = _sdpa(SdpaAttrs(**options), *leaves)
        grad = laid_out_as(out, grad) if out.is_cuda else grad
        return tuple(autograd_grads([out], leaves, [grad]))


def laid_out_as(out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``out``'s strides (copied when they differ). PyTorch 2.11's cuDNN
    attention backward caches its cuDNN graph by q, k, v and the mask, not by the incoming
    gradient's strides: a later call whose gradient is laid out differently reuses the first
    call's graph and returns wrong gradients (``benchmarks/cudnn_gradient_layout.py`` on an
    H100: relative error 1.4). Kiln passes it the output's layout always, as eager's
    attention layers do."""
    if grad.stride() == out.stride():
        return grad
    return torch.empty_like(out).copy_(grad)


def cudnn_output_layout(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` with the strides cuDNN's attention forward gives an output for ``q`` (copied
    when they differ). PyTorch 2.11 caches cuDNN's backward graph by q's, k's, v's and the
    mask's sizes and strides, not the output's: a Llama step whose output Kiln kept as
    [B, L, H, E] for q of [B, H, L, E] built a graph that a later eager call of that shape
    (output as q) reused, and its gradients were off by 1.6 relative to float64
    (``benchmarks/cudnn_gradient_layout.py``, third table; ``attention_first_step.py``).
    Passing the layout eager passes keeps the cached graph right for both."""
    if q.shape == out.shape:
        strides = torch.empty_like(q, device="meta").stride()  # (PyTorch's own rule)
    else:
        order = sorted(range(q.dim()), key=q.stride)
        step, found = 1, [0] * q.dim()
        for dim in order:
            found[dim], step = step, step * out.shape[dim]
        strides = tuple(found)
    if out.stride() == strides:
        return out
    return torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device).copy_(out)


def sdpa_cpu_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by PyTorch's CPU flash kernel, the one ``F.scaled_dot_product_attention``
    picks there (``passes.attention_statistics`` checks), and its per-row log-sum-exp, which
    lets the backward call the kernel's own backward (:func:`sdpa_cpu_backward`) instead of
    re-running the forward under autograd. ``enable_gqa`` is never set here (the pass keeps
    those graphs on the general path)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(q, k, v, 0.0, is_causal, attn_mask=_additive(mask, q), scale=scale)
    return out, lse


def _additive(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask as the additive one ``F.scaled_dot_product_attention`` makes of it
    before calling the flash kernel (0 where attended, -inf elsewhere): PyTorch 2.11's kernel
    takes only a mask of the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))


def sdpa_cpu_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v of :func:`sdpa_cpu_forward`, by the flash kernel's
    backward, from the forward's output and log-sum-exp (what eager autograd saves)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    mask = _additive(mask, q)
    gq, gk, gv = op(grad, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
    return gq, gk, gv


# CUDA's kernels, by ``torch.nn.attention.SDPBackend`` value.
CUDA_FLASH, CUDA_EFFICIENT, CUDA_CUDNN = 1, 2, 3
# The memory-efficient kernel reads a bias whose rows start at multiples of this many elements
# (PyTorch pads a bias that is not, keeping its values: so does ``_efficient_bias``).
_ALIGN = 16
_aten = torch.ops.aten


def sdpa_cuda_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool = False,
    scale: float | None = None,
    backend: int = CUDA_FLASH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by the CUDA kernel ``backend`` (the one ``F.scaled_dot_product_attention``
    picks for these operands: ``passes.attention_statistics`` asks PyTorch), and its
    log-sum-exp for :func:`sdpa_cuda_backward`. Without dropout; the pass calls the flash and
    cuDNN kernels only without a mask (cuDNN takes a float one as its additive bias, as eager
    passes it) and with head sizes that need no padding; they read the k and v of
    grouped-query attention (fewer heads) as they are."""
    if backend == CUDA_FLASH:
        found = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)
    elif backend == CUDA_CUDNN:
        found = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, True, 0.0, is_causal, scale=scale
        )
    else:
        bias = _efficient_bias(mask, q, k)
        found = _aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, is_causal, scale=scale
        )
    return found[0], found[1]


def sdpa_cuda_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    backend: int = CUDA_FLASH,
    mask_grad: bool = False,
) -> tuple[torch.Tensor, ...]:
    """The gradients of q, k and v of :func:`sdpa_cuda_forward`, by the kernel's backward
    from the forward's output and log-sum-exp (what eager autograd saves). No dropout: the
    random state arguments are never read; the flash and cuDNN kernels' sequence offsets are
    undefined (``None``), as for dense operands. ``mask_grad`` (the memory-efficient kernel
    only, which eager picks for a float mask that requires grad, such as T5's learned
    position bias): the mask's gradient too, fourth; the kernel writes it at [B, H, L, S],
    summed back to the mask's shape as autograd sums a broadcast."""
    # Stand-ins for the random state, made per call (a cached one could be a FakeTensor of
    # the run that typed the extern).
    seed = torch.zeros(2, dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    length, keys = q.shape[-2], k.shape[-2]
    if backend == CUDA_FLASH:
        return _aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, length, keys, 0.0, is_causal, seed, offset,
            scale=scale,
        )  # fmt: skip
    if backend == CUDA_CUDNN:
        out = cudnn_output_layout(q, out)
        return _aten._scaled_dot_product_cudnn_attention_backward(
            laid_out_as(out, grad), q, k, v, out, lse, seed, offset, mask, None, None, length,
            keys, 0.0, is_causal, scale=scale,
        )  # fmt: skip
    bias = _efficient_bias(mask, q, k)
    gq, gk, gv, gbias = _aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, mask_grad],
        is_causal, scale=scale,
    )  # fmt: skip
    if not mask_grad or mask is None:
        return gq, gk, gv
    if is_causal:  # (where the causal mask hides a score its gradient is 0; eager's came
        gbias.tril_()  # back as garbage there: H200, benchmarks/attention_backward.py)
    return gq, gk, gv, gbias.sum_to_size(mask.shape)


def _efficient_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> Any:
    """The bias the memory-efficient kernel reads, as ``F.scaled_dot_product_attention``
    prepares it: a boolean mask as 0/-inf in the query's dtype, rows aligned (padded past the
    last column, the values unchanged), broadcast to ``[B, H, L, S]``."""
    if mask is None:
        return None
    bias = _additive(mask, q)
    assert bias is not None
    size, strides = bias.shape[-1], (*bias.stride()[:-1], bias.storage_offset())
    if bias.stride(-1) != 1 or any(stride % _ALIGN for stride in strides):
        padded = bias.new_zeros((*bias.shape[:-1], size + (-size) % _ALIGN))
        bias = padded[..., :size].copy_(bias)
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _spread_qkv(attrs: ExternAttrs, inputs: Sequence[Any], results: Any) -> Grads:
    """q's, k's and v's gradients (and the mask's, when there are four) at their operands'
    positions (q, k and v may share a slot: the same tensor)."""
    spread: list[Any] = [None] * len(inputs)
    for arg, grad in zip(attrs.args[: len(results)], results, strict=True):
        if isinstance(arg, Slot):
            previous = spread[arg.index]
            spread[arg.index] = grad if previous is None else prims.add(previous, grad)
    return tuple(spread)


def _kernel_vjp(backward: Any) -> Any:
    """The VJP of a forward that kept its log-sum-exp: ``backward`` (the kernel's own) from
    the forward's operands, output and log-sum-exp; the mask's gradient too where it requires
    grad (the pass allows that on CUDA's memory-efficient kernel only)."""

    def vjp(attrs: ExternAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
        q, k, v, mask = (inputs[a.index] if isinstance(a, Slot) else a for a in attrs.args[:4])
        out, lse = outputs
        kwargs = {**attrs.kwargs, "mask_grad": True} if needs_grad(mask) else attrs.kwargs
        results = extern_call(backward, (grads[0], q, k, v, mask, out, lse), kwargs)
        return _spread_qkv(attrs, inputs, results)

    return vjp


EXTERN_VJPS[sdpa_cpu_forward] = _kernel_vjp(sdpa_cpu_backward)
EXTERN_VJPS[sdpa_cuda_forward] = _kernel_vjp(sdpa_cuda_backward)


def _flash_operands(attrs: ExternAttrs, operands: Sequence[Any]) -> list[TensorType] | None:
    """q, k and v of a CPU flash call when their types are regular (4-D, one dtype and
    device, one head size; k and v of one length, for every size), else None (the meta runs
    PyTorch)."""
    slots = attrs.args[:3]
    if len(slots) < 3 or not all(isinstance(s, Slot) and s.index < len(operands) for s in slots):
        return None
    q, k, v = (operands[s.index] for s in slots)
    types = [q, k, v]
    if not all(isinstance(t, TensorType) and t.rank == 4 for t in types):
        return None
    if len({(t.dtype, t.device) for t in types}) != 1 or q.dtype not in FLOATING:
        return None
    if not same_shape(q.shape[:2], k.shape[:2]) or not same_shape(k.shape[:3], v.shape[:3]):
        return None
    if not all(same_size(t.shape[3], q.shape[3]) for t in types):  # (flash: one head size)
        return None
    return types


def _sdpa_cpu_forward_types(attrs: ExternAttrs, *operands: Any) -> Any:
    found = _flash_operands(attrs, operands)
    if found is None:
        return None
    q = found[0]
    if q.dtype == torch.float64:  # its log-sum-exp's dtype differs between PyTorch versions
        return None
    return (q, TensorType(q.shape[:3], torch.float32, q.device))


def _sdpa_cpu_backward_types(attrs: ExternAttrs, *operands: Any) -> Any:
    shifted = ExternAttrs(attrs.fn, attrs.args[1:], attrs.kwargs)  # grad comes first
    found = _flash_operands(shifted, operands)
    return None if found is None else tuple(found)


@functools.cache
def _lse_form(backend: int) -> tuple[int, int] | None:
    """How CUDA kernel ``backend`` shapes its log-sum-exp in the installed PyTorch, from its
    meta function at one row: ``[B, H, L]`` with L rounded up to a multiple of the first
    number (the memory-efficient kernel's 32), then the second number of unit dims (cuDNN's
    ``[B, H, L, 1]``). None: no meta function (a fake run types it)."""
    q = torch.empty(1, 1, 1, 8, dtype=torch.float16, device="meta")
    try:
        lse = sdpa_cuda_forward(q, q, q, None, backend=backend)[1]
    except Exception:
        return None
    return int(lse.shape[2]), lse.dim() - 3


def _sdpa_cuda_forward_types(attrs: ExternAttrs, *operands: Any) -> Any:
    """The output and log-sum-exp of :func:`sdpa_cuda_forward`, in symbolic sizes too (the
    fit of a fake run's sizes would read the memory-efficient kernel's padded rows as L)."""
    q, k, v = (operands[s.index] if isinstance(s, Slot) else None for s in attrs.args[:3])
    if not all(isinstance(t, TensorType) and t.rank == 4 for t in (q, k, v)):
        return None
    assert isinstance(q, TensorType) and isinstance(v, TensorType)
    form = _lse_form(attrs.kwargs.get("backend", CUDA_FLASH))
    if form is None:
        return None
    (align, units), (batch, heads, length) = form, q.shape[:3]
    rows = (length + align - 1) // align * align if align > 1 else length
    lse = TensorType((batch, heads, rows, *(1,) * units), torch.float32, q.device)
    return TensorType((batch, heads, length, v.shape[3]), q.dtype, q.device), lse


def _sdpa_cuda_backward_types(attrs: ExternAttrs, *operands: Any) -> Any:
    """The gradients of :func:`sdpa_cuda_backward`: q's, k's, v's (and the mask's) types."""
    q, k, v, mask = (operands[s.index] if isinstance(s, Slot) else None for s in attrs.args[1:5])
    grads = (q, k, v, mask) if attrs.kwargs.get("mask_grad") else (q, k, v)
    if not all(isinstance(t, TensorType) for t in grads):
        return None
    return tuple(TensorType(t.shape, t.dtype, t.device) for t in grads)  # type: ignore[union-attr]


# Their output types by formula: no fake run, whose first use costs about a second.
EXTERN_FORMULAS[sdpa_cpu_forward] = _sdpa_cpu_forward_types
EXTERN_FORMULAS[sdpa_cpu_backward] = _sdpa_cpu_backward_types
EXTERN_FORMULAS[sdpa_cuda_forward] = _sdpa_cuda_forward_types
EXTERN_FORMULAS[sdpa_cuda_backward] = _sdpa_cuda_backward_types


def _sdpa_vjp(attrs: SdpaAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    wanted = tuple(needs_grad(item) for item in inputs)
    results = extern_call(sdpa_backward, (grads[0], *inputs, wanted), fields_of(attrs))
    return spread_to(wanted, results)


SDPA_CASES: tuple[Case, ...] = (
    (((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5), None), SdpaAttrs()),
    (((2, 3, 4, 8), (2, 3, 4, 8), (2, 3, 4, 8), None), SdpaAttrs(is_causal=True)),
    (((3, 4, 8), (3, 6, 8), (3, 6, 8), (4, 6)), SdpaAttrs(scale=0.3)),
    (((1, 2, 1, 8), (1, 2, 5, 8), (1, 2, 5, 8), (1, 1, 1, 5)), SdpaAttrs()),
    (((2, 4, 4, 8), (2, 2, 6, 8), (2, 2, 6, 8), None), SdpaAttrs(enable_gqa=True)),
    (((2, 3, 0, 8), (2, 3, 4, 8), (2, 3, 4, 8), None), SdpaAttrs()),
)


def _sdpa_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    cases = shape_samples(SDPA_CASES)(dtype, device)
    mask = make_tensor((4, 6), torch.bool, device)
    mask[:, 0] = True  # no fully masked row: its softmax would be NaN
    q, k, v = (make_tensor((2, 3, n, 8), dtype, device) for n in (4, 6, 6))
    return [*cases, Sample((q, k, v, mask), SdpaAttrs(), note="bool mask")]


extern(
    Op.SDPA,
    _sdpa,
    attrs=SdpaAttrs,
    dtypes=FLOATS,
    samples=_sdpa_samples,
    doc="sdpa(q, k, v, mask or None, ...): F.scaled_dot_product_attention, no dropout",
    vjp=_sdpa_vjp,
)
