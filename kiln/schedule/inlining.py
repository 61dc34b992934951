"""Inlining: which values the fusion walk stores and which it recomputes in every reader.

A value must be in memory when it is a graph output (or a mutated input's new value), an
extern's operand, or the base of a view one of those needs. Every other pointwise value is
inlined into the kernels that read it unless recomputing it there costs too much:

- a value whose readers end in one kernel, at one position, is computed once there, whatever
  it costs (kernels intern expressions);
- a stencil (a max-pool window) reads its producer at several positions and recomputes it at
  each: up to ``STENCIL_LIMIT`` ops an element;
- a value read by several kernels is stored once it costs more than ``RECOMPUTE_LIMIT`` ops,
  unless recomputing it reads no more memory than storing it would (it reads at most one
  full-size value), up to ``TRAFFIC_RECOMPUTE_LIMIT`` ops; and, however cheap, a chain of
  ops once it reads more than ``MAX_RECOMPUTED_READS`` full-size values.

Where a value's work ends up and at how many positions it is read comes from one reverse walk
over the graph (:func:`read_sites`), counted as distinct routes to the sink through views, pad,
cat, gather and index: a max pool's backward reads the forward's BatchNorm at about 100.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op, Tag, op_def
from kiln.schedule.lowering import REDUCE_KINDS, REINDEXING_OPS, in_kernels, shape_of
from kiln.schedule.program import View
from kiln.schedule.views import VIEW_OPS

RECOMPUTE_LIMIT = 6  # a value several kernels read is stored once it costs more ops than this
MAX_RECOMPUTED_READS = 2  # or once it reads more full-size values in memory than this
# Ops per element one kernel may recompute reading a value at many positions (CPU, GPU). The GPU
# has compute to spare in memory-bound kernels: ResNet-50's BatchNorm, ReLU and 3x3 max pool
# are one kernel there. A CPU recomputing the BatchNorm 9 times was 1.5x slower than storing it.
STENCIL_LIMIT = (32, 128)
# Ops per element a value read by several kernels may cost and still be recomputed in each
# when that reads no more memory than storing it would (CPU, GPU): on the CPU a transcendental
# recomputed costs about what the saved write and read do, so only cheap arithmetic goes.
TRAFFIC_RECOMPUTE_LIMIT = (8, 128)
# A small value broadcast into work at least ``BROADCAST_SPREAD`` times its size is stored
# (by a kernel computing it anyway) once it costs this many ops an element (CPU, GPU; None:
# never). A flat GPU kernel recomputes a BatchNorm's per-channel scale (a division, a
# reciprocal square root) at every element, and ResNet-50's backward kernels were bound by
# that arithmetic, not by memory; the C++ kernels compute per-channel work once per lane.
BROADCAST_STORE_COST: tuple[int | None, int | None] = (None, 2)
BROADCAST_SPREAD = 16
# ...or once it is a division (a mean: several instructions an element in float32).
_DIVISIONS = (Op.DIV, Op.FLOOR_DIV, Op.REMAINDER, Op.FMOD)
COST_CAP = 1 << 12  # costs and read counts saturate here


class Inlining:
    """The costs of inlining values of ``graph``, queried while fusion places them.

    ``layouts``: the values in memory so far (the fusion walk adds to it as it stores them);
    an inlined expression ends at them. ``needs_memory``: the values that must be stored.
    ``sinks`` and ``reads``: see :func:`read_sites`."""

    def __init__(
        self,
        graph: Graph,
        users: dict[Value, list[Node]],
        outputs: Sequence[Value],
        layouts: dict[Value, View],
    ):
        self.users = users
        self.layouts = layouts
        self.needs_memory = values_needing_memory(graph, outputs)
        self.sinks, self.reads = read_sites(graph, users, self.needs_memory)
        self._cost: dict[Value, int] = {}

    def inline_cost(self, value: Value) -> int:
        """Elementwise ops computed per element when ``value`` is inlined into a consumer: the
        distinct nodes of its expression down to values in memory (an operand read twice, as
        ``where(gt(b, a), b, a)`` reads ``a``, is computed once: kernels intern expressions)."""
        if value in self.layouts or value.node is None:
            return 0
        if value not in self._cost:
            total, seen, stack = 0, set(), [value]
            while stack and total <= COST_CAP:
                current = stack.pop()
                node = current.node
                if current in seen or current in self.layouts or node is None:
                    continue
                seen.add(current)
                total += _own_cost(node)
                stack.extend(node.input_values())
            self._cost[value] = total
        return self._cost[value]

    def costs_too_much_inlined(self, value: Value) -> bool:
        """Whether ``value`` is better stored once than recomputed by its readers: when
        consumers in several kernels would each recompute more than ``RECOMPUTE_LIMIT`` ops
        and recomputing would read more memory than storing (or cost more than
        ``TRAFFIC_RECOMPUTE_LIMIT``), or one consumer reads so many positions of it (a pooling
        window) that the recomputed ops pass ``STENCIL_LIMIT``. Readers in one kernel at one
        position compute it once."""
        cost = self.inline_cost(value)
        limit = STENCIL_LIMIT[value.type.device.type == "cuda"]
        several = len(self.users.get(value, ())) > 1 and len(self.sinks[value]) > 1
        # Stored, a value costs a write, and each kernel a read. Recomputed, it costs each
        # kernel the reads of its full-size operands: with at most one, no more traffic than
        # reading it back, and the write is saved (a BatchNorm backward's centered values,
        # recomputed from the saved input instead of stored and reloaded).
        # However cheap, a chain of ops reading more than two of them costs each kernel more
        # than storing it does (a residual stream, x0 + a1 + a2 + ..., summed again in every
        # LayerNorm that reads it). A single op (a three-operand where) is left to the rules
        # above: the limit was measured on chains.
        traffic_limit = TRAFFIC_RECOMPUTE_LIMIT[value.type.device.type == "cuda"]
        if several and cost > 1:
            operands = self._full_size_operands(value)
            if operands > MAX_RECOMPUTED_READS or (
                cost > RECOMPUTE_LIMIT and (operands > 1 or cost > traffic_limit)
            ):
                return True
        reads = self.reads[value]
        return reads > 1 and reads * cost > limit

    def forget_costs(self) -> None:
        """Drop the inline costs counted so far (they end at the values then in memory)."""
        self._cost.clear()

    def broadcast_costs_too_much(self, value: Value) -> bool:
        """Whether ``value`` is small work broadcast into much larger work (a per-channel
        factor into a flat kernel) that costs enough to compute once and load instead."""
        least = BROADCAST_STORE_COST[value.type.device.type == "cuda"]
        if least is None or value.node is None:
            return False
        cost = self.inline_cost(value)
        if cost < least and not (cost and value.node.op in _DIVISIONS):
            return False
        numel = math.prod(shape_of(value))
        if not isinstance(numel, int):
            return False  # (symbolic sizes: comparing them would guard)
        stack, seen = [value], {value}
        while stack:
            for user in self.users.get(stack.pop(), ()):
                out = user.outputs[0] if len(user.outputs) == 1 else None
                if out is None or out in seen:
                    continue
                if user.op in (Op.BROADCAST, Op.EXPAND):
                    # Into a row kernel's reduction it is a per-row value, computed once a
                    # row there; a stored result means elementwise work at every element.
                    spread = math.prod(shape_of(out))
                    into_elements = any(isinstance(s, Value) for s in self.sinks[out])
                    if (
                        into_elements
                        and isinstance(spread, int)
                        and spread >= BROADCAST_SPREAD * numel
                    ):
                        return True
                elif user.op in VIEW_OPS:
                    seen.add(out)
                    stack.append(out)
        return False

    def _full_size_operands(self, value: Value) -> int:
        """How many values in memory of ``value``'s own size its inlined expression reads
        (per-channel statistics and weights broadcast to it do not count: they are small)."""
        numel = math.prod(shape_of(value))
        found: set[int] = set()  # buffers (a broadcast view of a small one does not count)
        stack, seen = [value], {value}
        while stack:
            current = stack.pop()
            layout = self.layouts.get(current)
            if layout is not None:
                if layout.buffer.numel >= numel:
                    found.add(id(layout.buffer))
                continue
            if current.node is None:
                continue
            for operand in current.node.input_values():
                if operand not in seen:
                    seen.add(operand)
                    stack.append(operand)
        return len(found)


def values_needing_memory(graph: Graph, outputs: Sequence[Value]) -> set[Value]:
    """The values that must be stored: ``outputs``, the operands of work no kernel computes
    (externs), and the bases of views among them."""
    needed = set(outputs)
    for node in graph.nodes:
        if not in_kernels(node):
            needed.update(node.input_values())
    for node in reversed(graph.nodes):  # a needed view needs its base in memory
        if node.op in VIEW_OPS and node.output in needed:
            needed.update(node.input_values())
    return needed


def read_sites(
    graph: Graph, users: dict[Value, list[Node]], needs_memory: set[Value]
) -> tuple[dict[Value, frozenset[object]], dict[Value, int]]:
    """For each value, where its inlined work would end up and how often it is computed.

    ``sinks``: the consumers that are not inlined further (values needing memory,
    reductions, externs), at most two of them (only "one" or "several" matters). ``reads``:
    positions of the value one sink element reads, counted as distinct routes to the sink
    through reindexing ops (views, pad, cat, gather): elementwise users read their operand
    where they are computed, so users computed at one position share one computation
    (``where(gt(b, a), b, a)`` reads ``a`` once), while users read at different positions
    each compute it again. A 3x3 max-pool window reads 9 positions; its backward reads each
    window mask through another padding, so the forward's values there add up to far more
    than the 9 a count per user would give. One reverse walk; values downstream are
    assumed inlined."""
    sinks: dict[Value, frozenset[object]] = {}
    routes: dict[Value, frozenset[int]] = {}
    here = frozenset({0})  # read at the position its consumer computes
    for node in reversed(graph.nodes):
        for value in node.outputs:
            if value in needs_memory:  # stored: readers load it, whatever they are
                sinks[value], routes[value] = frozenset({value}), here
                continue
            ends, found = _sites_through_users(users.get(value, ()), sinks, routes)
            sinks[value] = frozenset(sorted(ends, key=_sink_order)[:2])
            routes[value] = frozenset(found) if found else here
    reads = {value: min(len(found), COST_CAP) for value, found in routes.items()}
    return sinks, reads


def _sink_order(sink: object) -> tuple[int, str]:
    """Stored values first (``broadcast_costs_too_much`` asks whether one is among the two
    kept), then nodes, each by name: the same two every run (picked from a set, they had
    varied between processes, and so had the factors stored and the kernels of a backward)."""
    if isinstance(sink, Value):
        return 0, sink.name
    outputs = getattr(sink, "outputs", ())
    return 1, outputs[0].name if outputs else ""


def _sites_through_users(
    readers: Sequence[Node],
    sinks: dict[Value, frozenset[object]],
    routes: dict[Value, frozenset[int]],
) -> tuple[set[object], set[int]]:
    """The sinks a value's ``readers`` end in and the routes by which they read it, given
    the ``sinks`` and ``routes`` of the values downstream (see :func:`read_sites`)."""
    ends: set[object] = set()
    found: set[int] = set()
    for user in readers:
        out = user.outputs[0] if len(user.outputs) == 1 else None
        inlined = user.op in VIEW_OPS or (in_kernels(user) and user.op not in REDUCE_KINDS)
        if out is None or out not in sinks or not inlined:
            ends.add(user)
            found.add(0)
        elif user.op in REINDEXING_OPS:
            ends |= sinks[out]
            found.update(hash((route, id(user))) for route in routes[out])
        else:
            ends |= sinks[out]
            found |= routes[out]
        if len(found) > COST_CAP:
            break
    return ends, found


def _own_cost(node: Node) -> int:
    return op_cost(node.op)


def op_cost(op: Op) -> int:
    """Ops per element of one node inlined: none for views and index generators, several for
    transcendental functions (``Tag.TRANSCENDENTAL`` on the registry row)."""
    if op in VIEW_OPS or op in (Op.FULL, Op.IOTA):
        return 0
    return 3 if Tag.TRANSCENDENTAL in op_def(op).tags else 1
