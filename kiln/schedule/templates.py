"""Matrix products and the pointwise kernels that read them: pairs a template can fuse.

``mode="max-autotune"`` may compute a 16-bit ``mm``, ``addmm``, ``bmm`` or 2-d convolution
(channels-last, one group or depthwise) in a generated
Triton kernel (``kiln/codegen/triton_matmul.py``) that applies the pointwise kernel reading its
result to each tile while the tile is in registers (an epilogue), instead of the library
writing the product and the kernel reading it back. Whether it does is measured at run time
(``kiln/backends/templates.py``); this module only finds the pairs where it may, and plans
the buffers so that either way is correct.

A pair is an :class:`~kiln.schedule.program.ExternCall` and the first later step that reads
its result, when that step is a kernel whose own loop (not its combined parts) is pointwise
over exactly the result's elements and reads the result only at the element it computes, and
no earlier product paired with that kernel (a residual block's kernel reads two: the first
pairs, the second stays the library's). The
steps in between must not write the product's operands (the template reads them at the
kernel's place) nor read its result (the template writes it at the kernel's place). The
result is still stored when a later step or an output reads it (``keeps_result``).

For GPT-2's MLP, ``addmm(bias, x, w)`` then ``gelu`` becomes one kernel: 8 bytes an element of
the hidden activation less memory traffic (written once in bf16, not written, read and
written again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.ir.op import Op
from kiln.schedule.buffers import plan_buffers, step_reads, step_writes
from kiln.schedule.index import INT32_LIMIT, var
from kiln.schedule.loops import Buffer, Kernel, KernelKind, Load, X, kernel_symbols, walk
from kiln.schedule.program import ExternCall, Program, Step, View

PRODUCTS = frozenset({Op.MM, Op.ADDMM, Op.BMM, Op.CONVOLUTION})
DTYPES = (torch.float16, torch.bfloat16)  # float32 would be tf32 in a template: not eager's


@dataclass(frozen=True)
class Problem:
    """A pair's product as a matrix product: ``batch`` products of ``m x k`` by ``k x n``. A
    2-d convolution with channels-last output is one (``conv``: ``m`` the output pixels,
    ``n`` the output channels, ``k`` the input channels times the window); a depthwise one
    (``depthwise``: each channel its own window) is not, and runs as direct sums (``k`` the
    window)."""

    kind: str  # "mm", "conv" or "depthwise"
    batch: int
    m: int
    n: int
    k: int


@dataclass(eq=False)
class MatmulPair:
    """A product and its epilogue. ``head``: the kernel's own loop, without the kernels
    combined into its launch (``rest``: those, as one kernel, or None)."""

    extern: ExternCall
    kernel: Kernel
    head: Kernel
    rest: Kernel | None
    keeps_result: bool

    @property
    def result(self) -> Buffer:
        return self.extern.outputs[0]

    @property
    def operands(self) -> list[View]:
        """The product's tensor operands as the extern takes them: ``(a, b)``, ``(bias, a,
        b)``, or a convolution's ``(x, weight[, bias])``."""
        return [o for o in self.extern.operands if isinstance(o, View)]

    @property
    def problem(self) -> Problem:
        return problem_of(self.extern)


def problem_of(call: ExternCall) -> Problem:
    result = call.outputs[0]
    views = [o for o in call.operands if isinstance(o, View)]
    if call.node.op is Op.CONVOLUTION:
        images, channels, height, width = (int(n) for n in result.shape)
        _, per_group, *window = (int(n) for n in views[1].shape)
        depthwise = call.node.attrs.groups != 1
        kind, k = ("depthwise", 1) if depthwise else ("conv", per_group)
        for size in window:
            k *= size
        return Problem(kind, 1, images * height * width, channels, k)
    *batch, m, n = (int(size) for size in result.shape)
    return Problem("mm", batch[0] if batch else 1, m, n, int(views[-1].shape[-2]))


def matmul_pairs(
    program: Program,
    devices: frozenset[str] = frozenset({"cuda"}),
    refused: dict[int, str] | None = None,
) -> list[MatmulPair]:
    """The pairs of ``program`` on devices of the types in ``devices``. ``refused`` receives,
    for each other product there (by the extern step's ``id``), why it stays the library's
    alone (``kiln.explain`` prints it)."""
    pairs = []
    steps = program.steps
    outputs = {id(v.buffer) for v in program.outputs}
    claimed: set[int] = set()  # kernels paired already (a residual may read two products)
    for position, step in enumerate(steps):
        if not isinstance(step, ExternCall) or step.node.op not in PRODUCTS:
            continue
        reason = _refusal(step, devices)
        if reason is None:
            reason, pair = _pair_at(steps, position, claimed, outputs)
            if pair is not None:
                pairs.append(pair)
                claimed.add(id(pair.kernel))
                continue
        if refused is not None and reason:
            refused[id(step)] = reason
    return pairs


def _pair_at(
    steps: list[Step], position: int, claimed: set[int], outputs: set[int]
) -> tuple[str, MatmulPair | None]:
    step = steps[position]
    assert isinstance(step, ExternCall)
    result = step.outputs[0]
    reader = next(
        (k for k in range(position + 1, len(steps)) if result in step_reads(steps[k])), None
    )
    if reader is None:
        return "no later step reads its result", None
    kernel = steps[reader]
    if not isinstance(kernel, Kernel):
        return f"its first reader is another extern ({kernel.node.op.printed_name})", None
    if id(kernel) in claimed:
        return f"its reader {kernel.name} is paired with another product", None
    why = _epilogue(kernel, result)
    if why:
        return f"its reader {kernel.name} {why}", None
    operands = {id(o.buffer) for o in step.operands if isinstance(o, View)}
    between = steps[position + 1 : reader]
    if any(id(b) in operands for s in between for b in step_writes(s)):
        return f"a step before its reader {kernel.name} writes an operand", None
    later = any(result in step_reads(s) for s in steps[reader + 1 :])
    head = dataclasses.replace(kernel, parts=[])
    rest = None
    if kernel.parts:
        first, *others = kernel.parts
        rest = dataclasses.replace(first, name=f"{kernel.name}_rest", parts=others)
    keeps = later or id(result) in outputs
    return "", MatmulPair(step, kernel, head, rest, keeps)


def _refusal(call: ExternCall, devices: frozenset[str]) -> str | None:
    """Why this product has no template (None: it may have one; "": not on these devices)."""
    node = call.node
    (result,) = call.outputs if len(call.outputs) == 1 else (None,)
    if result is None or result.device.type not in devices:
        return ""
    views = [o for o in call.operands if isinstance(o, View)]
    absent = [o for o in call.operands if not isinstance(o, View)]
    if absent != ([None] if node.op is Op.CONVOLUTION and len(views) == 2 else []):
        return "a non-tensor operand"  # (a convolution without bias has None there)
    if result.dtype not in DTYPES or any(v.buffer.dtype != result.dtype for v in views):
        return f"{result.dtype} (templates are for float16 and bfloat16 products)"
    sizes = [*result.shape, *(n for v in views for n in (*v.shape, *v.strides, v.offset))]
    if not all(isinstance(n, int) for n in sizes):
        return "symbolic sizes (a template's tiles are chosen per size)"
    if result.numel == 0:
        return "an empty result"
    if node.op is Op.CONVOLUTION and not _plain_convolution(call):
        return "not a 2-d convolution of one group or depthwise"
    product = problem_of(call)
    if min(product.m, product.n, product.k) < 1:
        return "an empty product"
    if max(result.numel, *(_extent(v) for v in views)) > INT32_LIMIT:
        return "indices past 2**31"
    if node.op is Op.CONVOLUTION:  # (channels-last: the product's rows are pixels)
        _, channels, height, width = result.shape
        dense = (height * width * channels, 1, width * channels, channels)
        dense_result = result.offset == 0 and tuple(result.strides) == dense
        return None if dense_result else "its result is not dense channels-last"
    if result.offset == 0 and tuple(result.strides) == _contiguous(result.shape):
        return None
    return "its result is not dense (a padded product's columns, or a transposed layout)"


def _plain_convolution(call: ExternCall) -> bool:
    """A 2-d convolution, not transposed, of one group or depthwise (a channel each)."""
    attrs = call.node.attrs
    x, weight = (o for o in call.operands[:2] if isinstance(o, View))
    if len(x.shape) != 4 or attrs.transposed:
        return False
    return attrs.groups == 1 or (
        attrs.groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1
    )


def _epilogue(kernel: Kernel, result: Buffer) -> str:
    """Why ``kernel`` cannot be ``result``'s epilogue ("" when it can): its own loop must be
    pointwise over ``result``'s elements and read it only at the element it computes, unmasked
    (its parts must not read it)."""
    head = dataclasses.replace(kernel, parts=[])
    if head.kind is not KernelKind.POINTWISE:
        return "reduces"
    if head.xnumel != result.numel:
        return "runs over other positions than the product's elements"
    if kernel_symbols(kernel):
        return "has symbolic sizes"
    if any(result in part.reads() for part in kernel.parts):
        return "reads it in a combined part"
    identity = var(X, head.xnumel)
    loads = [e for e in walk([s.value for s in head.stores]) if isinstance(e, Load)]
    reads = [load for load in loads if load.buffer is result]
    if not reads:
        return "reads it in a combined part"
    if not all(r.offset == identity and r.mask is None for r in reads):
        return "reads it at other elements than its own"
    return ""


def _extent(view: View) -> int:
    """One past the last element ``view`` addresses."""
    steps = zip(view.shape, view.strides, strict=True)
    return int(view.offset) + sum((int(n) - 1) * abs(int(s)) for n, s in steps) + 1


def _contiguous(shape: tuple[object, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= int(size)  # type: ignore[call-overload]
    return tuple(reversed(strides))


def replanned(program: Program, pairs: list[MatmulPair]) -> Program:
    """``program`` with its buffers planned as if each pair's kernel also read the product's
    operands (the template reads them there): none is freed, nor its memory reused, before."""
    if not pairs:
        return program
    extra = {id(pair.kernel): [v.buffer for v in pair.operands] for pair in pairs}
    copy = dataclasses.replace(program, reuses={}, dead_after=[])
    plan_buffers(copy, extra)
    return copy
