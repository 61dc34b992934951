"""Layouts: dense strides in a given dim order (channels-last among them), and the strides an
extern call's results will have, which the scheduler must know before the call runs.

Extern strides come, in order, from a rule that needs no call (a convolution with a
channels-last operand is channels-last), from one real call per signature on CUDA for the
externs whose layout depends on the kernel PyTorch picks (attention, its backward, other
convolutions), from rules (matmuls are contiguous, attention returns its ``[B, S, H, D]``
buffer transposed), and otherwise from running the op's reference implementation on meta
tensors. The host program still checks every result
and a mismatch is learned for the next compilation (``KilnProgram.observed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kiln.ir.graph import Node, Value
from kiln.ir.op import Op, op_def
from kiln.ir.specialize import sized_node, sizes_in
from kiln.ir.symbolic import Dim, Sym, hint, substitute
from kiln.ir.types import concrete_shape
from kiln.ops.attention import (
    sdpa_backward,
    sdpa_cpu_backward,
    sdpa_cpu_forward,
    sdpa_cuda_backward,
    sdpa_cuda_forward,
)
from kiln.ops.attrs import Slot
from kiln.ops.externs import convolution_backward
from kiln.schedule import index as ix
from kiln.schedule.lowering import shape_of
from kiln.schedule.program import View

# Externs whose results PyTorch allocates contiguous (convolutions: unless an operand is
# channels-last, see extern_strides).
CONTIGUOUS_RESULTS = frozenset({Op.MM, Op.BMM, Op.ADDMM, Op.BADDBMM, Op.CONVOLUTION, Op.SDPA})


# Externs that write a copy of operand 0 (an embedding's gradient is an index_put into zeros):
# on the CPU a contiguous base gives a contiguous result.
SAME_AS_CONTIGUOUS_BASE = frozenset({Op.INDEX_PUT, Op.SCATTER, Op.SCATTER_ADD})


def memory_order(strides: Sequence[Dim]) -> tuple[int, ...]:
    """Dims from the largest stride to the smallest (ties keep the logical order)."""
    return tuple(sorted(range(len(strides)), key=lambda d: -strides[d]))


def strides_in_order(shape: Sequence[Dim], order: Sequence[int]) -> tuple[Dim, ...]:
    """Dense strides of ``shape`` with dims laid out in ``order`` (outermost first)."""
    strides: list[Dim] = [0] * len(shape)
    running: Dim = 1
    for dim in reversed(order):
        strides[dim] = running
        running *= max(shape[dim], 1)
    return tuple(strides)


def input_pattern(tensor: torch.Tensor) -> object:
    """What a program for symbolic sizes assumes of an input's layout: the order of its dims
    when it is dense in that order (any sizes then have the same strides in terms of them),
    and which dims are broadcast (stride 0: the gradient of a ``sum()`` autograd passes as
    one value expanded), else its strides themselves."""
    shape, stride = tuple(tensor.shape), tensor.stride()
    zero = tuple(d for d, (n, st) in enumerate(zip(shape, stride, strict=True)) if n > 1 and not st)
    order = memory_order(stride)
    expected = strides_in_order(_unbroadcast(shape, zero), order)
    dense = all(
        n <= 1 or d in zero or st == e
        for d, (n, st, e) in enumerate(zip(shape, stride, expected, strict=True))
    )
    if not dense:
        return stride
    return ("dense", order, zero) if zero else ("dense", order)


def _unbroadcast(shape: Sequence[Dim], zero: Sequence[int]) -> tuple[Dim, ...]:
    return tuple(1 if d in zero else n for d, n in enumerate(shape))


def input_layout(
    shape: Sequence[Dim], tensor: torch.Tensor
) -> tuple[tuple[Dim, ...], tuple[Dim, ...]]:
    """An input's shape and strides as the scheduler sees them: the tensor's own when its type
    is static; for a type with symbolic dims, the dense strides of its dim order in terms of
    the symbols when it is dense (:func:`input_pattern`), else its own, specialized."""
    if not any(isinstance(dim, Sym) for dim in shape):
        return tuple(tensor.shape), tuple(tensor.stride())
    pattern = input_pattern(tensor)
    if isinstance(pattern, tuple) and pattern and pattern[0] == "dense":
        zero = pattern[2] if len(pattern) > 2 else ()
        strides = strides_in_order(_unbroadcast(shape, zero), pattern[1])
        return tuple(shape), tuple(0 if d in zero else st for d, st in enumerate(strides))
    return concrete_shape(tuple(shape)), tuple(tensor.stride())


Observed = tuple[tuple[Dim, ...], tuple[Dim, ...]]  # a result's (shape, strides) on a run


def observed_strides(
    node: Node, seen: Sequence[Observed], predict: Callable[[], list[tuple[Dim, ...]]]
) -> list[tuple[Dim, ...]]:
    """Strides for ``node``'s results, given the (shape, strides) PyTorch gave them on a run:
    a result dense in some dim order at the size seen has that order's strides at any size;
    any other keeps the strides seen at that size alone (its sizes then specialize), and at
    another size is predicted again (``predict``): strides seen at one length, kept at
    another, overlapped the rows of a convolution's result."""
    result: list[tuple[Dim, ...]] = []
    for number, (value, (seen_shape, strides)) in enumerate(zip(node.outputs, seen, strict=True)):
        shape = value.type.shape
        order = memory_order(strides)
        if strides_in_order(seen_shape, order) == tuple(strides):
            result.append(strides_in_order(shape, order))
        elif tuple(hint(n) for n in shape) == tuple(seen_shape):
            concrete_shape(shape)
            result.append(strides)
        else:
            result.append(predict()[number])
    return result


def channels_last_strides(shape: Sequence[Dim]) -> tuple[Dim, ...]:
    return strides_in_order(shape, (0, 2, 3, 1))


def extern_strides(node: Node, operands: list[object]) -> list[tuple[Dim, ...]]:
    """Output strides of an extern call with ``operands`` laid out as given: a CUDA probe,
    a rule, or a meta run, in that order (module docstring); contiguous when all fail. The
    wrapper checks them at run time, and a mismatch is learned for the next compilation
    (``observed``). With symbolic sizes, found at the sizes being compiled and written in the
    symbols by the results' dim order (:func:`observed_strides`)."""
    types = [v.type for v in (*node.input_values(), *node.outputs)]
    sizes = [*sizes_in(node.attrs), *sizes_in(operands), *(n for t in types for n in t.shape)]
    values = {s.name: s.hint for size in sizes if isinstance(size, Sym) for s in size.symbols()}
    if not values:
        return _extern_strides(node, operands)
    sized = [
        View(o.buffer, *(substitute(x, values) for x in (o.shape, o.strides, o.offset)))
        if isinstance(o, View)
        else substitute(o, values)
        for o in operands
    ]
    found = _extern_strides(sized_node(node, values), sized)
    hinted = [tuple(hint(n) for n in shape_of(v)) for v in node.outputs]
    return observed_strides(node, list(zip(hinted, found, strict=True)), lambda: found)


def _extern_strides(node: Node, operands: list[object]) -> list[tuple[Dim, ...]]:
    convolution = _convolution_rule(node, operands)
    on_gpu = all(o.buffer.device.type == "cuda" for o in operands if isinstance(o, View))
    if convolution is not None and (not on_gpu or torch.backends.cudnn.enabled):
        # Not probed: with a channels-last operand, cuDNN answers channels-last whichever
        # kernel it picks. ResNet-50's first call spent 0.3-0.6 s in 53 such probes.
        return convolution
    if _is_probed(node) and (on_gpu or node.op is not Op.CONVOLUTION):
        probed = probe_strides(node, operands)
        if probed is not None:
            return probed
    if node.op is Op.SDPA and len(shape_of(node.output)) == 4:
        # The flash kernels (CUDA's and the CPU one), memory-efficient and cuDNN kernels write
        # [B, S, H, D] and return its [B, H, S, D] transpose (meta answers contiguous; the math
        # fallback's contiguous result is learned at run time).
        return [strides_in_order(shape_of(node.output), (0, 2, 1, 3))]
    if node.op is Op.EXTERN and node.attrs.fn is sdpa_backward:
        # Its gradients of q, k and v come back laid out as the flash kernels' outputs.
        return [
            strides_in_order(shape, (0, 2, 1, 3))
            if len(shape) == 4
            else ix.contiguous_strides(shape)
            for shape in (shape_of(v) for v in node.outputs)
        ]
    if not on_gpu:
        cpu = _cpu_flash_rule(node, operands) or _cpu_convolution_backward_rule(node, operands)
        if cpu is not None:
            return cpu
        base = operands[0] if operands else None
        if node.op in SAME_AS_CONTIGUOUS_BASE and _is_contiguous(base):
            return [ix.contiguous_strides(shape_of(node.output))]
    if node.op in CONTIGUOUS_RESULTS:
        # Known answers save the meta run (its first call imports PyTorch's meta registrations,
        # about a second); a wrong guess costs one copy and is learned (see the docstring).
        return [ix.contiguous_strides(shape_of(v)) for v in node.outputs]
    return _meta_strides(node, operands)


def _is_contiguous(operand: object) -> bool:
    return isinstance(operand, View) and operand.strides == ix.contiguous_strides(operand.shape)


def _cpu_flash_rule(node: Node, operands: list[object]) -> list[tuple[Dim, ...]] | None:
    """PyTorch's CPU flash kernel (training graphs call it directly, see
    ``passes.attention_statistics``) returns its output in the query's dim order (dense:
    torchvision's attention passes [L, B, H, E] ones, whose rebuild at the second call cost
    ViT 3 s), and its log-sum-exp as the transpose of ``[B, L, H]``; its backward returns
    every gradient as ``[B, L, H, E]`` transposed. Known here, the meta run (whose first call
    imports sympy, 0.4 s) is saved."""
    if node.op is not Op.EXTERN or node.attrs.fn not in (sdpa_cpu_forward, sdpa_cpu_backward):
        return None
    shapes = [shape_of(v) for v in node.outputs]
    if any(len(shape) not in (3, 4) for shape in shapes):
        return None
    transposed = [strides_in_order(s, (0, 2, 1, 3) if len(s) == 4 else (0, 2, 1)) for s in shapes]
    if node.attrs.fn is sdpa_cpu_forward:
        query = node.attrs.args[0]
        view = operands[query.index] if isinstance(query, Slot) else None
        if isinstance(view, View) and len(view.strides) == len(shapes[0]):
            transposed[0] = strides_in_order(shapes[0], memory_order(view.strides))
    return transposed


def _cpu_convolution_backward_rule(
    node: Node, operands: list[object]
) -> list[tuple[Dim, ...]] | None:
    """oneDNN's (and meta's) convolution backward: the input and weight gradients are
    channels-last when the input or the weight is, else contiguous; a bias gradient is a
    vector. Known here, the meta run (whose first call imports sympy, 0.4 s) is saved."""
    if node.op is not Op.EXTERN or node.attrs.fn is not convolution_backward:
        return None
    slots = node.attrs.args[1:3]
    views = [operands[s.index] if isinstance(s, Slot) else None for s in slots]
    if not all(isinstance(v, View) and len(v.shape) == 4 for v in views):
        return None
    laid_out = any(
        v.strides == channels_last_strides(v.shape) != ix.contiguous_strides(v.shape)
        for v in views
        if isinstance(v, View)
    )
    shapes = [shape_of(v) for v in node.outputs]
    return [
        channels_last_strides(s) if laid_out and len(s) == 4 else ix.contiguous_strides(s)
        for s in shapes
    ]


def _convolution_rule(node: Node, operands: list[object]) -> list[tuple[Dim, ...]] | None:
    """Meta convolutions answer contiguous; cuDNN and oneDNN answer channels-last when the
    input or the weight is channels-last (PyTorch's ``suggest_memory_format``; a tensor that
    is both, such as one of a single channel, counts as contiguous). Channels-last strides
    then, else None (the probe or the meta run decides)."""
    if node.op is not Op.CONVOLUTION or len(shape_of(node.output)) != 4:
        return None
    laid_out = [o for o in operands[:2] if isinstance(o, View) and len(o.shape) == 4]
    if any(
        o.strides == channels_last_strides(o.shape) != ix.contiguous_strides(o.shape)
        for o in laid_out
    ):
        return [channels_last_strides(shape_of(node.output))]
    return None


def _is_probed(node: Node) -> bool:
    """Externs whose layout depends on the kernel PyTorch picks: attention and its backward
    (on the CPU too, where a mask that requires grad takes the math kernel: T5's backward was
    rebuilt at its second call), CUDA convolutions."""
    return node.op in (Op.SDPA, Op.CONVOLUTION) or (
        node.op is Op.EXTERN
        and node.attrs.fn in (sdpa_backward, sdpa_cuda_forward, sdpa_cuda_backward)
    )


_PROBED: dict[tuple[object, ...], list[tuple[Dim, ...]] | None] = {}


def probe_strides(node: Node, operands: list[object]) -> list[tuple[Dim, ...]] | None:
    """Output strides of an extern, from running it once on uninitialized tensors laid out
    like the operands (attention here has no dropout: nothing draws random numbers). Which
    kernel PyTorch picks (flash, cuDNN, memory-efficient or math attention; cuDNN's
    convolutions) and so the layout it returns depends on shapes, dtypes and the card: a wrong
    guess cost ViT-B/16 a rebuild of its whole program during its first call (0.8-1.4 s on the
    H100). A graph input that requires grad does in the probe too (PyTorch's CPU attention
    takes the math kernel for such a mask even under ``no_grad``). One probe per distinct
    signature, for the life of the process."""
    grads = [isinstance(v, Value) and v.node is None and v.type.requires_grad for v in node.inputs]
    key = (
        node.op,
        repr(node.attrs),
        tuple(
            (o.shape, o.strides, o.buffer.dtype, o.buffer.device, grad)
            if isinstance(o, View)
            else repr(o)
            for o, grad in zip(operands, grads, strict=True)
        ),
    )
    if key not in _PROBED:
        try:
            tensors = [
                _empty_like_view(o).requires_grad_(grad) if isinstance(o, View) else o
                for o, grad in zip(operands, grads, strict=True)
            ]
            with torch.no_grad():
                result = op_def(node.op).impl(node.attrs, *tensors)
            results = result if isinstance(result, tuple) else (result,)
            _PROBED[key] = [tuple(t.stride()) for t in results]
        except Exception:  # out of memory, an unsupported case: the rules below decide
            _PROBED[key] = None
    return _PROBED[key]


def _empty_like_view(view: View, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialized tensor laid out like ``view`` (on its buffer's device by default)."""
    buffer = view.buffer
    where = buffer.device if device is None else device
    shape, strides = [int(n) for n in view.shape], [int(n) for n in view.strides]
    return torch.empty_strided(shape, strides, dtype=buffer.dtype, device=where)


def _meta_strides(node: Node, operands: list[object]) -> list[tuple[Dim, ...]]:
    metas = [_empty_like_view(o, "meta") if isinstance(o, View) else o for o in operands]
    try:
        with torch.no_grad():
            result = op_def(node.op).impl(node.attrs, *metas)
        results = result if isinstance(result, tuple) else (result,)
        strides = [tuple(t.stride()) for t in results]
        if all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in results):
            return strides
    except Exception:  # an opaque function without meta support
        pass
    return [ix.contiguous_strides(shape_of(v)) for v in node.outputs]
