"""Strided views: which movement prims keep data where it is, and the layout they give.

A value in memory is a :class:`~kiln.schedule.program.View` (buffer, shape, strides, offset).
Permute, broadcast, expand, slice, squeeze, unsqueeze and most reshapes of a view are views
again, with no data moved: ``x.t()`` of a contiguous ``[4, 6]`` buffer is shape ``[6, 4]`` with
strides ``(1, 6)``. Kernels then read it through those strides, and extern calls (``mm``) get
the strided tensor PyTorch would have passed. Flip (negative strides) and reshapes that would
need a copy are not views; kernels compute those by index arithmetic instead.
"""

from __future__ import annotations

import torch

from kiln.ir.graph import Node
from kiln.ir.op import Op
from kiln.ir.symbolic import Dim, Sym
from kiln.schedule.program import View

VIEW_OPS = frozenset(
    {Op.RESHAPE, Op.PERMUTE, Op.BROADCAST, Op.EXPAND, Op.SLICE, Op.SQUEEZE, Op.UNSQUEEZE}
)


def view_of(view: View, node: Node) -> View | None:
    """The layout of ``node``'s output when its operand is laid out as ``view``, or None when
    the op would have to move data."""
    op, attrs = node.op, node.attrs
    shape, strides = list(view.shape), list(view.strides)
    out_shape: tuple[Dim, ...] = tuple(node.output.type.shape)
    if op is Op.PERMUTE:
        return View(view.buffer, out_shape, tuple(strides[d] for d in attrs.dims), view.offset)
    if op is Op.BROADCAST:
        new: list[Dim] = [0] * len(out_shape)
        for i, out_dim in enumerate(attrs.dims):
            new[out_dim] = strides[i] if shape[i] == out_shape[out_dim] else 0
        return View(view.buffer, out_shape, tuple(new), view.offset)
    if op is Op.EXPAND:
        pairs = zip(shape, out_shape, strides, strict=True)
        expanded: list[Dim] = [st if size == out_size else 0 for size, out_size, st in pairs]
        return View(view.buffer, out_shape, tuple(expanded), view.offset)
    if op is Op.SLICE:
        offset = view.offset + attrs.start * strides[attrs.dim]
        strides[attrs.dim] *= attrs.step
        return View(view.buffer, out_shape, tuple(strides), offset)
    if op is Op.SQUEEZE:
        kept = [st for d, st in enumerate(strides) if d not in attrs.dims]
        return View(view.buffer, out_shape, tuple(kept), view.offset)
    if op is Op.UNSQUEEZE:
        # PyTorch's rule: a new dim's stride spans the dim it is inserted before (1 at the
        # end). The stride of a size-1 dim addresses nothing, but an extern's choice of layout
        # reads it: a convolution of x[:, None] with stride 1 there came back channels-last.
        for d in sorted(attrs.dims):
            strides.insert(d, shape[d] * strides[d] if d < len(shape) else 1)
            shape.insert(d, 1)
        return View(view.buffer, out_shape, tuple(strides), view.offset)
    if op is Op.RESHAPE:
        reshaped = reshape_strides(tuple(shape), tuple(strides), out_shape)
        return None if reshaped is None else View(view.buffer, out_shape, reshaped, view.offset)
    return None


def reshape_strides(
    shape: tuple[Dim, ...], strides: tuple[Dim, ...], new_shape: tuple[Dim, ...]
) -> tuple[Dim, ...] | None:
    """Strides of ``new_shape`` viewing the same elements, or None when a copy is needed."""
    if shape == new_shape:
        return strides
    numel: Dim = 1
    for size in shape:
        numel *= size
    if numel == 0 or _is_contiguous(shape, strides):
        result: list[Dim] = [1] * len(new_shape)
        for i in range(len(new_shape) - 2, -1, -1):
            result[i] = result[i + 1] * max(new_shape[i + 1], 1)
        return tuple(result)
    if any(isinstance(n, Sym) for n in (*shape, *strides, *new_shape)):
        return view_rule(shape, strides, new_shape)
    try:
        meta = torch.empty_strided(
            [int(n) for n in shape], [int(n) for n in strides], device="meta"
        )
        return tuple(meta.view([int(n) for n in new_shape]).stride())
    except RuntimeError:
        return None


def view_rule(
    shape: tuple[Dim, ...], strides: tuple[Dim, ...], new_shape: tuple[Dim, ...]
) -> tuple[Dim, ...] | None:
    """PyTorch's rule for ``view`` on sizes that may be symbolic (each comparison decided for
    all sizes or guarded): the old dims fall into runs laid out as one contiguous block
    (each dim's stride the product of the sizes inside it times the run's last stride); the
    new dims must cover each run exactly, from the innermost out, and take strides within
    it. None where a new dim would straddle two runs (a copy is needed). Without it a
    symbolic ``q.view(b, t, h, d).transpose(1, 2)`` of a strided projection was copied."""
    new_strides: list[Dim] = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    base: Dim = strides[-1] if strides else 1
    run_numel: Dim = 1
    view_numel: Dim = 1
    for d in range(len(shape) - 1, -1, -1):
        run_numel = run_numel * shape[d]
        if d > 0 and (shape[d - 1] == 1 or strides[d - 1] == run_numel * base):
            continue  # (the run goes on into dim d - 1)
        while view_d >= 0 and (view_numel < run_numel or new_shape[view_d] == 1):
            new_strides[view_d] = view_numel * base
            view_numel = view_numel * new_shape[view_d]
            view_d -= 1
        if view_numel != run_numel:
            return None
        if d > 0:
            base, run_numel, view_numel = strides[d - 1], 1, 1
    return tuple(new_strides) if view_d == -1 else None


def _is_contiguous(shape: tuple[Dim, ...], strides: tuple[Dim, ...]) -> bool:
    expected: Dim = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def is_dense(view: View) -> bool:
    """Whether the view covers its elements without gaps or overlaps in some dim order."""
    pairs = sorted(
        (st, size) for size, st in zip(view.shape, view.strides, strict=True) if size != 1
    )
    expected: Dim = 1
    for stride, size in pairs:
        if stride != expected:
            return False
        expected *= size
    return True
