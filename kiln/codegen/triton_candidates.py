"""The launch shapes ``mode="max-autotune"`` tries for one Triton kernel.

:func:`candidate_blocks` starts from :func:`~kiln.codegen.triton.choose_blocks` (the heuristic,
always first, so a search that measures nothing else keeps today's choice) and adds a few
legal variations: half, double and four times the ``XBLOCK``, other warp counts, the other
reduction form where both are legal, and a few ``RBLOCK`` widths for a looped reduction.
A softmax over 4096 rows of 1000 on the GPU gives::

    persistent x4 r1024 w8      (the heuristic)
    persistent x4 r1024 w4
    persistent x2 r1024 w8
    persistent x8 r1024 w8 ...
    looped x1 r512 w4, looped x1 r512 w8 ...

The runtime compiles them all in parallel and times them at the kernel's first launch
(``kiln/runtime/autotune.py``).
"""

from __future__ import annotations

from kiln.codegen.sources import Form
from kiln.codegen.triton import (
    MAX_PERSISTENT_RBLOCK,
    Blocks,
    choose_blocks,
    next_power_of_2,
)
from kiln.schedule.loops import Kernel, KernelKind

MAX_CANDIDATES = 10
MAX_XBLOCK = 4096  # Triton's largest pointwise block worth trying on a GPU
INTERPRET_MAX_XBLOCK = 8192
WARPS = (2, 4, 8)


def candidate_blocks(kernel: Kernel, interpret: bool) -> list[Blocks]:
    """The heuristic's :class:`Blocks` first, then legal variations (at most
    ``MAX_CANDIDATES``, no duplicates). A pointwise kernel only gets pointwise shapes; a
    combined kernel (``kernel.parts``, whose parts keep their own heuristic blocks) only
    other warp counts."""
    first = choose_blocks(kernel, interpret)
    if kernel.parts:
        tried = [Blocks(first.form, first.xblock, first.rblock, w) for w in WARPS]
    elif kernel.kind is KernelKind.POINTWISE:
        tried = _pointwise(kernel, first, interpret)
    else:
        tried = _persistent(kernel, first, interpret)[:6] + _looped(kernel, first, interpret)
    unique = list(dict.fromkeys([first, *tried]))
    return unique[:MAX_CANDIDATES]


def _warps_for(elements: int, big: bool) -> list[int]:
    """Warp counts worth trying for a block of ``elements`` (at least 32 elements a warp,
    16 warps only for blocks of 8192 and more on a GPU)."""
    counts = [w for w in WARPS if w * 32 <= elements] or [1]
    return counts + ([16] if big and elements >= 8192 else [])


def _pointwise(kernel: Kernel, first: Blocks, interpret: bool) -> list[Blocks]:
    cap = min(INTERPRET_MAX_XBLOCK if interpret else MAX_XBLOCK, next_power_of_2(kernel.xnumel))
    xblocks = (first.xblock, first.xblock // 2, first.xblock * 2, first.xblock * 4)
    shapes = []
    for xblock in dict.fromkeys(x for x in xblocks if 1 <= x <= cap):
        for warps in _warps_for(xblock, not interpret):
            shapes.append(Blocks(Form.POINTWISE, xblock, 1, warps))
    return _heuristic_warps_first(shapes, first)


def _persistent(kernel: Kernel, first: Blocks, interpret: bool) -> list[Blocks]:
    rblock = next_power_of_2(kernel.rnumel)
    if rblock > MAX_PERSISTENT_RBLOCK:
        return []
    budget = max(16384 if interpret else 4096, rblock)
    base = first.xblock if first.form is Form.PERSISTENT else max(1, budget // rblock)
    rows = next_power_of_2(kernel.xnumel)
    shapes = []
    for xblock in dict.fromkeys((base, base // 2, base * 2)):
        if 1 <= xblock <= rows and xblock * rblock <= budget:
            for warps in _warps_for(xblock * rblock, not interpret):
                shapes.append(Blocks(Form.PERSISTENT, xblock, rblock, warps))
    return _heuristic_warps_first(shapes, first)


def _looped(kernel: Kernel, first: Blocks, interpret: bool) -> list[Blocks]:
    """Looped shapes narrower than the whole row (a whole-row loop is the persistent form
    with a loop's overhead), the heuristic's rows per program kept."""
    full = next_power_of_2(kernel.rnumel)
    xblock = first.xblock if first.form is Form.LOOPED else 1
    budget = 16384 if interpret else 4096
    widths = [r for r in (512, 1024, 2048) if r < full and xblock * r <= budget]
    if first.form is Form.LOOPED:
        widths = [first.rblock, *widths]
    return [
        Blocks(Form.LOOPED, xblock, width, warps)
        for width in dict.fromkeys(widths)
        for warps in (4, 8)
    ]


def _heuristic_warps_first(shapes: list[Blocks], first: Blocks) -> list[Blocks]:
    """The heuristic's own block with other warps first, then other blocks, so the
    ``MAX_CANDIDATES`` cut drops the far variations."""
    return sorted(shapes, key=lambda b: (b.xblock != first.xblock, b.num_warps != 4))
