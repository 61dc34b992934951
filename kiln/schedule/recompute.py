"""Recomputing a stored value in a kernel that already reads everything it is made of.

A pointwise value an extern needs is stored (a ReLU's output, which a convolution's weight
gradient reads), and every kernel reading it loads it. A kernel that already loads the
value's full-size operands can recompute it instead, for a few ops and no memory: a
BatchNorm-ReLU backward loads the gradient, the ReLU's output (for its mask) and the
BatchNorm's input, and the mask is the sign of ``input * scale + shift``, whose only full-size
operand the kernel reads anyway. On ResNet-50's backward that is one read in three of each
BatchNorm-ReLU's kernels.

The walk runs once the kernel's expressions are built (:func:`recomputable`): a loaded value
qualifies when its expression, down to values in memory, is elementwise work and views of at
most ``TRAFFIC_RECOMPUTE_LIMIT`` ops, reading only values the kernel loads anyway or values
smaller than it (per-channel factors and weights) that are ``ready``: graph inputs no kernel
writes in place, or results of earlier steps. So what the kernel then reads was in memory
before it ran (the buffer plan, made afterwards, keeps it there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Set

from kiln.ir.graph import Value
from kiln.ir.op import Op, Tag, op_def
from kiln.schedule import inlining
from kiln.schedule.lowering import shape_of
from kiln.schedule.program import View
from kiln.schedule.views import VIEW_OPS

# A factor kernel's value this small is recomputed from values in memory as small (a
# backward's per-channel factors of its saved statistics: the kernels computing them then
# read graph inputs only, and share one launch).
SMALL_VALUE = 1 << 12
# Ops that recompute to the same values anywhere (no random draws, no gathers).
_RECOMPUTABLE_OPS = VIEW_OPS | {Op.CONVERT, Op.WHERE, Op.FULL}


def recomputable(
    loaded: Set[Value],
    layouts: dict[Value, View],
    ready: Callable[[Value], bool],
    factors: bool = False,
) -> set[Value]:
    """The values among ``loaded`` (those a kernel reads from memory) that it can recompute
    from the rest of ``loaded`` and small ``ready`` values in memory, with every stored value
    their expressions pass through: the kernel lowers them all inline when they are left out
    of its layouts. ``factors``: a kernel of per-channel factors read from graph inputs,
    which recomputes the factors it reads from inputs of any size (``SMALL_VALUE``)."""
    dropped: set[Value] = set()
    for value in sorted(loaded, key=lambda v: (len(v.name), v.name)):  # (the same every run)
        if value.node is None or value in dropped:
            continue
        inner = _stored_inside(value, loaded - {value}, layouts, ready, factors)
        if inner is not None:
            dropped |= inner
    return dropped


def _stored_inside(
    value: Value,
    loaded: Set[Value],
    layouts: dict[Value, View],
    ready: Callable[[Value], bool],
    factors: bool,
) -> set[Value] | None:
    """The stored values ``value``'s expression passes through on its way down to ``loaded``
    and small ``ready`` values (``value`` included); None when it reads anything else or
    costs too much."""
    numel = math.prod(shape_of(value))
    if not isinstance(numel, int):
        return None  # (symbolic sizes: comparing them would guard)
    limit = inlining.TRAFFIC_RECOMPUTE_LIMIT[value.type.device.type == "cuda"]
    cheap = factors and numel <= SMALL_VALUE  # (its reads cost nothing either way)
    passed: set[Value] = set()
    seen: set[Value] = set()
    stack, cost = [value], 0
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current is not value and current in loaded:
            continue
        if current is not value and current in layouts and _is_small(current, numel, cheap):
            if not ready(current):
                return None
            continue
        if current.node is None:
            return None
        node = current.node
        if node.op not in _RECOMPUTABLE_OPS and Tag.ELEMENTWISE not in op_def(node.op).tags:
            return None
        cost += inlining.op_cost(node.op)
        if cost > limit:
            return None
        if current in layouts:
            passed.add(current)
        stack.extend(node.input_values())
    return passed if cost else None  # (views alone: the same buffer's load, reached again)


def _is_small(value: Value, numel: int, cheap: bool) -> bool:
    size = math.prod(shape_of(value))
    return isinstance(size, int) and (size < numel or (cheap and size <= SMALL_VALUE))
