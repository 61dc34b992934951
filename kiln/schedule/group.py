"""Group: a kernel the fusion walk is forming, and the loop kernel it becomes.

A group computes and stores its ``members`` over one loop space: ``numel`` elements in a
pointwise kernel, or ``rows`` (``xnumel`` rows of ``rnumel`` elements) in a row kernel. Each
member sits at a multi-index of the loop variables (:meth:`Group.index_of`); when the walk is
done, :func:`build_kernel` lowers every member there into one :class:`~kiln.schedule.loops.Kernel`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.ir.graph import Node, Value
from kiln.ir.symbolic import Dim
from kiln.schedule import index as ix
from kiln.schedule.index import Index
from kiln.schedule.loops import Buffer, Kernel, R, Store, X
from kiln.schedule.lowering import Lowering, MultiIndex, RowSpace, shape_of
from kiln.schedule.program import View
from kiln.schedule.recompute import recomputable
from kiln.schedule.views import VIEW_OPS


@dataclass(eq=False)
class Group:
    """A kernel being formed: the values it computes, over ``numel`` elements or ``rows``."""

    position: int
    numel: Dim
    device: torch.device
    rows: RowSpace | None = None
    members: list[Value] = field(default_factory=list)
    reductions: set[Value] = field(default_factory=set)
    touched: set[Value] = field(default_factory=set)
    # A pointwise kernel walks ``shape`` in memory order of its first stored value: dims in
    # ``order``, outermost first, so stores (and loads of like-laid-out inputs) are contiguous.
    shape: tuple[Dim, ...] = ()
    order: tuple[int, ...] = ()
    # Per-channel factors read from graph inputs, computed ahead of everything (scheduler's
    # _place_input_factors): they recompute, rather than load, the factors they read.
    factors: bool = False

    @property
    def elements(self) -> Dim:
        """How many elements the group's loops visit."""
        return self.numel * (self.rows.rnumel if self.rows else 1)

    def loop_variables(self) -> tuple[Index, Index]:
        """The kernel's loop variables ``x`` and ``r`` (zero where the loop has one step)."""
        x = ix.var(X, self.numel)
        r = ix.var(R, self.rows.rnumel) if self.rows else Index()
        return x, r

    def index_of(self, value: Value, x: Index, r: Index) -> MultiIndex | None:
        """The multi-index of ``value`` at the group's loop position, if it fits the loops."""
        shape = shape_of(value)
        numel = math.prod(shape)
        if self.rows is None:
            if numel != self.numel:
                return None
            if shape != self.shape or self.order == tuple(range(len(shape))):
                return ix.decompose(x, shape)
            digits = ix.decompose(x, [shape[d] for d in self.order])
            index: list[Index] = [Index()] * len(shape)
            for dim, digit in zip(self.order, digits, strict=True):
                index[dim] = digit
            return tuple(index)
        if shape == self.rows.shape:
            # (empty rows reduce to a constant, with no loop over r to store elements in)
            return self.rows.full_index(x, r) if self.rows.rnumel else None
        if numel == self.rows.xnumel:
            return ix.decompose(x, shape)
        return None


def build_kernel(
    group: Group,
    layouts: dict[Value, View],
    buffers: dict[Value, Buffer],
    node_order: dict[int, int],
    ready: Callable[[Value], bool] | None = None,
) -> Kernel:
    """The kernel storing each member of ``group`` into its buffer, given the ``layouts`` of
    the values in memory; named after its first few ops in graph order (``node_order``: node
    id -> position). ``ready``: whether a value in memory is there before the kernel runs;
    it recomputes any other (stored by a later step than the walk had placed when it placed
    the kernel: per-channel factors placed ahead of everything), and stored values it can
    recompute from what it reads anyway and small ready values (``recompute.py``)."""
    lowering, stores = _lowered(group, layouts, buffers)
    if ready is None:
        return _kernel(group, lowering, stores, node_order)
    while late := {v for v in lowering.loaded if v.node is not None and not ready(v)}:
        layouts = {v: view for v, view in layouts.items() if v not in late}
        lowering, stores = _lowered(group, layouts, buffers)
    recomputed = recomputable(lowering.loaded, layouts, ready, group.factors)
    if recomputed:
        kept = {v: view for v, view in layouts.items() if v not in recomputed}
        lowering, stores = _lowered(group, kept, buffers)
    return _kernel(group, lowering, stores, node_order)


def _kernel(
    group: Group, lowering: Lowering, stores: list[Store], node_order: dict[int, int]
) -> Kernel:
    nodes = sorted(lowering.nodes.values(), key=lambda n: node_order.get(id(n), len(node_order)))
    name = f"k{group.position}_" + "_".join(_short_names(nodes))
    fused = [f"{n.op.printed_name}  {n.origin}".rstrip() for n in nodes]
    # An empty row reduces to the identity (a constant), leaving no loop over r.
    rnumel = max(group.rows.rnumel, 1) if group.rows else 1
    return Kernel(name, group.numel, rnumel, stores, fused, group.device)


def _lowered(
    group: Group, layouts: dict[Value, View], buffers: dict[Value, Buffer]
) -> tuple[Lowering, list[Store]]:
    x, r = group.loop_variables()
    lowering = Lowering(layouts, set(group.members), x, r, group.rows, group.reductions)
    stores = []
    for value in group.members:
        index = group.index_of(value, x, r)
        assert index is not None
        buffer = buffers[value]
        offset = ix.linear(index, buffer.strides)
        stores.append(Store(buffer, offset, lowering.load(value, index)))
    return lowering, stores


def _short_names(nodes: list[Node]) -> list[str]:
    names: list[str] = []
    for node in nodes:
        api = node.origin.api.rsplit(".", 1)[-1].strip("_") or node.op.printed_name
        api = "".join(ch if ch.isalnum() else "_" for ch in api)[:16]
        if api not in names and node.op not in VIEW_OPS:
            names.append(api)
    return names[:3] or ["copy"]
