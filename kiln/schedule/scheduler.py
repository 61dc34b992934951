"""Fusion: group a graph's work into kernels and extern calls, in an order that runs.

The scheduler walks the graph once, in order. For each node it decides:

- **view** (permute, slice, most reshapes, ...) of a value in memory: no work, a new strided
  :class:`~kiln.schedule.program.View` of the same buffer;
- **extern** (matmul, convolution, attention, sort, scatter, ...): an
  :class:`~kiln.schedule.program.ExternCall` whose operands must be in memory;
- **reduction**: joins a kernel over the same rows (same operand shape and reduced dims) when
  its body can be computed there, so softmax, layer norm and variance are one kernel, or
  starts a new one;
- **pointwise** values that must be in memory (graph outputs, extern operands, values reused
  by several consumers that cost too much to recompute) join a kernel that already touches
  the same data (vertical and horizontal fusion; the epilogue of a row kernel) or start one.
  Every other pointwise value is inlined into the kernels that read it.

A value may join an earlier kernel only when everything it reads from memory is produced
before that kernel, so the step order stays valid. After grouping, stores nobody reads are
dropped (a softmax's max never reaches memory) and a buffer plan reuses dead buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.ir.graph import Graph, InputKind, Node, Origin, Value
from kiln.ir.op import Op, Tag, op_def, registered_ops
from kiln.ops.attrs import ConvertAttrs
from kiln.ops.externs import convolution_backward
from kiln.schedule import index as ix
from kiln.schedule.combine import combine_kernels
from kiln.schedule.index import Index
from kiln.schedule.layouts import (
    channels_last_strides,
    extern_strides,
    memory_order,
    strides_in_order,
)
from kiln.schedule.loops import Buffer, BufferKind, Kernel, Load, R, Store, X, walk
from kiln.schedule.lowering import (
    EXTERN_OPS,
    REDUCE_KINDS,
    REINDEXING_OPS,
    Lowering,
    MultiIndex,
    NotFusable,
    RowSpace,
    lowerable,
    reduced_dims,
    shape_of,
)
from kiln.schedule.program import ExternCall, Program, Step, View
from kiln.schedule.views import VIEW_OPS, is_dense, view_of

RECOMPUTE_LIMIT = 6  # a value several kernels read is stored once it costs more ops than this
# Ops per element one kernel may recompute reading a value at many positions (CPU, GPU). The GPU
# has compute to spare in memory-bound kernels: ResNet-50's BatchNorm, ReLU and 3x3 max pool
# are one kernel there. A CPU recomputing the BatchNorm 9 times was 1.5x slower than storing it.
STENCIL_LIMIT = (32, 128)
# Ops per element a value read by several kernels may cost and still be recomputed in each
# when that reads no more memory than storing it would (CPU, GPU): on the CPU a transcendental
# recomputed costs about what the saved write and read do, so only cheap arithmetic goes.
TRAFFIC_RECOMPUTE_LIMIT = (8, 128)
COST_CAP = 1 << 12  # costs and read counts saturate here
TRANSCENDENTAL = frozenset(d.op for d in registered_ops() if Tag.TRANSCENDENTAL in d.tags)
MAX_MEMBERS = 16  # values one kernel may compute and store
SEARCH_DEPTH = 6  # how many recent kernels a value tries to join


# Independent reductions over the same rows share a kernel when it visits at most this many
# elements: there a launch costs more than the extra loads.
SMALL_KERNEL_ELEMENTS = 1 << 16


@dataclass(eq=False)
class Group:
    """A kernel being formed: the values it computes, over ``numel`` elements or ``rows``."""

    position: int
    numel: int
    device: torch.device
    rows: RowSpace | None = None
    members: list[Value] = field(default_factory=list)
    reductions: set[Value] = field(default_factory=set)
    touched: set[Value] = field(default_factory=set)
    # A pointwise kernel walks ``shape`` in memory order of its first stored value: dims in
    # ``order``, outermost first, so stores (and loads of like-laid-out inputs) are contiguous.
    shape: tuple[int, ...] = ()
    order: tuple[int, ...] = ()

    def index_of(self, value: Value, x: Index, r: Index) -> MultiIndex | None:
        """The multi-index of ``value`` at the group's loop position, if it fits the loops."""
        shape = shape_of(value)
        numel = _numel(shape)
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


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


class Scheduler:
    def __init__(
        self,
        graph: Graph,
        inputs: Sequence[torch.Tensor],
        observed: dict[int, list[tuple[int, ...]]] | None = None,
    ):
        self.graph = graph
        self.observed = observed or {}  # id(node) -> extern output strides seen at run time
        self._node_order = {id(node): i for i, node in enumerate(graph.nodes)}
        self.users = graph.users()
        self.outputs = [*graph.outputs, *(new for _, new in graph.mutations)]
        self.layouts: dict[Value, View] = {}
        self.producer: dict[Value, int] = {}  # value in memory -> step making it (-1: input)
        self.steps: list[Group | ExternCall] = []
        self.buffers: dict[Value, Buffer] = {}  # values a group stores
        self.inputs: list[Buffer] = []
        self._cost: dict[Value, int] = {}
        self._copies: dict[Value, Value] = {}  # graph input -> its channels-last copy
        for value, tensor in zip(graph.inputs, inputs, strict=True):
            buffer = Buffer(
                value.name,
                tuple(tensor.shape),
                tensor.dtype,
                tensor.device,
                BufferKind.INPUT,
                tuple(tensor.stride()),
            )
            self.inputs.append(buffer)
            self.layouts[value] = View(buffer, buffer.shape, buffer.strides, 0)
            self.producer[value] = -1
        self.needs_memory = self._values_needing_memory()
        self.sinks, self.reads = self._read_sites()
        self.in_place = self._in_place_mutations()

    # -- decisions ----------------------------------------------------------------------------

    def _values_needing_memory(self) -> set[Value]:
        needed = set(self.outputs)
        for node in self.graph.nodes:
            if not self._in_kernels(node):
                needed.update(node.input_values())
        for node in reversed(self.graph.nodes):  # a needed view needs its base in memory
            if node.op in VIEW_OPS and node.output in needed:
                needed.update(node.input_values())
        return needed

    def _in_place_mutations(self) -> dict[Value, Value]:
        """New values of mutated inputs that a kernel can store into the input itself (new
        value -> input): when every reader of the old value is elementwise work of the same
        shape that ends only in the new value (a BatchNorm's running mean, ``0.9 * rm + 0.1 *
        mean``), each element is read by the kernel that writes it, at the same position, or
        by an earlier kernel. The write-back copy (159 launches a ResNet-50 training step)
        then has nothing to do."""
        outputs = set(self.graph.outputs)
        result: dict[Value, Value] = {}
        for target, new in self.graph.mutations:
            layout = self.layouts.get(target)
            node = new.node
            if (
                layout is None
                or target in outputs
                or new in outputs
                or node is None
                or not self._in_kernels(node)
                or node.op in REDUCE_KINDS
                or node.op in VIEW_OPS
                or new.type.dtype != target.type.dtype
                or shape_of(new) != shape_of(target)
                or not is_dense(layout)
                or 0 in layout.strides
            ):
                continue
            if self._only_feeds(target, new, outputs):
                result[new] = target
        return result

    def _only_feeds(self, start: Value, end: Value, outputs: set[Value]) -> bool:
        """Whether every path from ``start`` through its readers is same-shaped elementwise
        work reaching ``end`` and nothing else."""
        shape = shape_of(start)
        stack, seen = [start], {start}
        while stack:
            current = stack.pop()
            if current is end:
                continue
            users = self.users.get(current, ())
            if not users or (current is not start and current in outputs):
                return False
            for user in users:
                if (
                    len(user.outputs) != 1
                    or Tag.ELEMENTWISE not in op_def(user.op).tags
                    or not self._in_kernels(user)
                    or shape_of(user.output) != shape
                ):
                    return False
                if user.output not in seen:
                    seen.add(user.output)
                    stack.append(user.output)
        return True

    def _in_kernels(self, node: Node) -> bool:
        if node.op in EXTERN_OPS or not lowerable(node.op):
            return False
        devices = {v.type.device for v in node.outputs}
        devices |= {v.type.device for v in node.input_values() if v.kind is not InputKind.RNG_SEED}
        return len(devices) == 1  # a kernel runs on one device; a transfer is an extern

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

    def _read_sites(self) -> tuple[dict[Value, frozenset[object]], dict[Value, int]]:
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
        for node in reversed(self.graph.nodes):
            for value in node.outputs:
                if value in self.needs_memory:  # stored: readers load it, whatever they are
                    sinks[value], routes[value] = frozenset({value}), here
                    continue
                ends: set[object] = set()
                found: set[int] = set()
                for user in self.users.get(value, ()):
                    out = user.outputs[0] if len(user.outputs) == 1 else None
                    inlined = user.op in VIEW_OPS or (
                        self._in_kernels(user) and user.op not in REDUCE_KINDS
                    )
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
                sinks[value] = frozenset(list(ends)[:2])
                routes[value] = frozenset(found) if found else here
        reads = {value: min(len(found), COST_CAP) for value, found in routes.items()}
        return sinks, reads

    def run(self) -> None:
        # Outputs are views of what computed them, gapped ones too (a padded matmul's columns:
        # torch.compile returns those strides as well); a dense copy doubled GPT-2's logits.
        self._walk()

    def _walk(self) -> None:
        for node in self.graph.nodes:
            if node.op in VIEW_OPS and self._try_view(node):
                continue
            if not self._in_kernels(node):
                self._extern(node)
            elif node.op in REDUCE_KINDS:
                self._place_reduction(node.output)
            else:
                value = node.output
                if value in self.needs_memory or self._costs_too_much_inlined(value):
                    self._place_pointwise(value)
                elif self._feeds_other_rows(value):
                    self._place_as_row_epilogue(value)

    def _costs_too_much_inlined(self, value: Value) -> bool:
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
        traffic_limit = TRAFFIC_RECOMPUTE_LIMIT[value.type.device.type == "cuda"]
        if (
            several
            and cost > RECOMPUTE_LIMIT
            and (self._full_size_operands(value) > 1 or cost > traffic_limit)
        ):
            return True
        reads = self.reads[value]
        return reads > 1 and reads * cost > limit

    def _full_size_operands(self, value: Value) -> int:
        """How many values in memory of ``value``'s own size its inlined expression reads
        (per-channel statistics and weights broadcast to it do not count: they are small)."""
        numel = _numel(shape_of(value))
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

    def _feeds_other_rows(self, value: Value) -> bool:
        """Whether every user of ``value`` reduces it over rows of its own (a cross-entropy's
        per-row losses feeding their mean)."""
        users = self.users.get(value, ())
        return bool(users) and all(u.op in REDUCE_KINDS for u in users)

    def _place_as_row_epilogue(self, value: Value) -> None:
        """Compute ``value`` in the row kernel whose rows it is indexed by (as that kernel's
        epilogue), when it reads that kernel's results: the next reduction then reads one
        value per row instead of redoing the per-row work (a cross-entropy's target gather)
        in its few programs. Otherwise it stays inlined into its consumer."""
        numel = _numel(shape_of(value))
        for group in self._groups():
            if group.rows is not None and group.rows.xnumel == numel and self._join(group, value):
                return

    def _try_view(self, node: Node) -> bool:
        operand = node.inputs[0]
        if not isinstance(operand, Value) or operand not in self.layouts:
            return False
        layout = view_of(self.layouts[operand], node)
        if layout is None:
            return False
        self.layouts[node.output] = layout
        self.producer[node.output] = self.producer[operand]
        return True

    # -- externs ------------------------------------------------------------------------------

    def _extern(self, node: Node) -> None:
        operands: list[object] = []
        for position, operand in enumerate(node.inputs):
            if isinstance(operand, Value):
                if operand not in self.layouts:
                    self._place_pointwise(operand)  # e.g. a view that needs a copy
                operands.append(self._convolution_operand(node, position, operand))
            else:
                operands.append(operand)
        position = len(self.steps)
        strides = self.observed.get(id(node)) or extern_strides(node, operands)
        outputs = []
        for value, stride in zip(node.outputs, strides, strict=True):
            shape = shape_of(value)
            if any(step == 0 and size > 1 for size, step in zip(shape, stride, strict=True)):
                # An expanded result (a sum's gradient) may come back dense on another run, and
                # dense values cannot be copied into broadcast memory: lay it out dense.
                stride = ix.contiguous_strides(shape)
            buffer = Buffer(
                value.name, shape, value.type.dtype, value.type.device, BufferKind.EXTERN, stride
            )
            outputs.append(buffer)
            self.layouts[value] = View(buffer, shape, stride, 0)
            self.producer[value] = position
        reason = "" if node.op in EXTERN_OPS else "not handled by the code generator"
        self.steps.append(ExternCall(node, tuple(operands), tuple(outputs), reason))  # type: ignore[arg-type]

    def _convolution_operand(self, node: Node, position: int, operand: Value) -> View:
        """How an extern reads ``operand``, its operand at ``position``: as it is in memory,
        except that a graph input a convolution reads as its input (or its backward as the
        gradient or the input) in the NCHW layout, where convolutions go channels-last
        (``_wants_channels_last``), is copied channels-last first. Else the convolution
        answers NCHW (oneDNN and cuDNN follow the input), and every kernel between it and the
        next convolution converts between the layouts: small_cnn's first BatchNorm read NCHW
        and wrote channels-last, column by column. Weights stay as they are (the libraries
        reorder them anyway). Not for transposed convolutions: oneDNN's channels-last float16
        one accumulates in float16 (4 ulps off on the op table's sample)."""
        view = self.layouts[operand]
        shape = shape_of(operand)
        activations = 1 if node.op is Op.CONVOLUTION else 2  # (x) or (gradient, x)
        if (
            self.producer.get(operand) != -1
            or not _is_convolution(node)
            or position >= activations
            or _transposed(node)
            or len(shape) != 4
            or view.strides == channels_last_strides(shape)
            or view.strides != ix.contiguous_strides(shape)
            or not self._wants_channels_last(operand)
        ):
            return view
        copy = self._copies.get(operand)
        if copy is None:
            attrs = ConvertAttrs(operand.type.dtype)
            copy = Value(f"{operand.name}_channels_last", operand.type)
            copy.node = Node(Op.CONVERT, (operand,), attrs, (copy,), _copy_origin(node))
            self.users[copy] = [node]
            group = self._new_group(_numel(shape), operand.type.device, None)
            group.shape = shape
            group.order = memory_order(channels_last_strides(shape))
            self._join(group, copy, require=True)
            self._copies[operand] = copy
        return self.layouts[copy]

    # -- kernels ------------------------------------------------------------------------------

    def _groups(self) -> list[Group]:
        groups = [s for s in self.steps if isinstance(s, Group)]
        return groups[-SEARCH_DEPTH:][::-1]

    def _place_reduction(self, value: Value) -> None:
        operand = value.node.inputs[0] if value.node else None
        assert isinstance(operand, Value)
        rows = RowSpace(shape_of(operand), tuple(sorted(reduced_dims(value.node))))  # type: ignore[arg-type]
        for group in self._groups():
            if group.rows == rows and self._join(group, value):
                return
        group = self._new_group(rows.xnumel, value.type.device, rows)
        if not self._join(group, value, require=True):
            raise AssertionError(f"a reduction cannot start its own kernel: {value.name}")

    def _place_pointwise(self, value: Value) -> None:
        for group in self._groups():
            if self._join(group, value):
                return
        rows = self._feeding_rows(value)
        if rows is not None:
            group = self._new_group(rows.xnumel, value.type.device, rows)
            if self._join(group, value):
                return
            self.steps.remove(group)
        group = self._new_group(_numel(shape_of(value)), value.type.device, None)
        group.shape = shape_of(value)
        group.order = memory_order(self._strides_for(value))
        self._join(group, value, require=True)

    def _feeding_rows(self, value: Value) -> RowSpace | None:
        """The rows of a reduction ``value`` feeds (through inlined elementwise work) over
        ``value``'s own shape: computing ``value`` in that reduction's kernel saves a re-read."""
        shape = shape_of(value)
        frontier, seen = [value], {value}
        while frontier:
            current = frontier.pop()
            for user in self.users.get(current, ()):
                if user.op in REDUCE_KINDS and shape_of(current) == shape:
                    return RowSpace(shape, tuple(sorted(reduced_dims(user))))
                if user.op in REDUCE_KINDS or user.op in VIEW_OPS or not self._in_kernels(user):
                    continue
                output = user.outputs[0] if len(user.outputs) == 1 else None
                if output is not None and output not in seen and shape_of(output) == shape:
                    seen.add(output)
                    frontier.append(output)
        return None

    def _new_group(self, numel: int, device: torch.device, rows: RowSpace | None) -> Group:
        group = Group(len(self.steps), numel, device, rows)
        self.steps.append(group)
        return group

    def _join(self, group: Group, value: Value, require: bool = False) -> bool:
        if len(group.members) >= MAX_MEMBERS or group.device != value.type.device:
            return False
        x = ix.var(X, group.numel)
        r = ix.var(R, group.rows.rnumel) if group.rows else Index()
        index = group.index_of(value, x, r)
        if index is None:
            return False
        is_reduction = value.node is not None and value.node.op in REDUCE_KINDS
        reductions = group.reductions | {value} if is_reduction else group.reductions
        lowering = Lowering(self.layouts, {*group.members, value}, x, r, group.rows, reductions)
        try:
            lowering.load(value, index)
        except (NotFusable, ValueError):
            if require:
                raise
            return False
        if any(self.producer[v] >= group.position for v in lowering.loaded):
            return False
        # Nothing shared: fusing saves no memory traffic, only a launch, which matters for
        # small kernels (a cross-entropy's final sum and count over its rows).
        small = is_reduction and _elements(group) <= SMALL_KERNEL_ELEMENTS
        if not require and group.members and not lowering.touched & group.touched and not small:
            return False
        group.members.append(value)
        group.touched |= lowering.touched
        if is_reduction:
            group.reductions.add(value)
        self._store_in(group, value)
        return True

    def _strides_for(self, value: Value) -> tuple[int, ...]:
        """The layout of a value a kernel stores: channels-last when it feeds a convolution on
        the GPU (cuDNN's fast path), the layout of a same-shaped dense input it is computed
        from (as eager's elementwise ops keep ``channels_last``), else contiguous."""
        shape = shape_of(value)
        contiguous = ix.contiguous_strides(shape)
        if self._wants_channels_last(value):
            return channels_last_strides(shape)
        layout = self._source_layout(value, shape)
        if layout is not None and is_dense(layout) and 0 not in layout.strides:
            return strides_in_order(shape, memory_order(layout.strides))
        return contiguous

    def _source_layout(self, value: Value, shape: tuple[int, ...]) -> View | None:
        """The layout of the first same-shaped value in memory that ``value``'s inlined
        elementwise work reads (depth-first, operands in order)."""
        stack, seen = [value], {value}
        while stack:
            current = stack.pop()
            node = current.node
            if node is None or node.op in REDUCE_KINDS or node.op in VIEW_OPS:
                continue
            for operand in reversed(list(node.input_values())):
                if operand in seen or shape_of(operand) != shape:
                    continue
                seen.add(operand)
                if operand in self.layouts:
                    return self.layouts[operand]
                stack.append(operand)
        return None

    def _wants_channels_last(self, value: Value) -> bool:
        """Whether ``value`` feeds a convolution (or its backward) on the GPU or the CPU:
        cuDNN's convolutions are fastest on channels-last operands, and so are oneDNN's on the
        CPU (small_cnn inference on two cores: 1.6-1.9x eager against about 1x; training, with
        the C++ generator's split column reductions for the BatchNorm statistics over
        channels-last rows, ``kiln/codegen/cpp_split.py``: see benchmarks/RESULTS.md)."""
        feeds_convolution = any(_is_convolution(u) for u in self.users.get(value, ()))
        if len(shape_of(value)) != 4 or not feeds_convolution:
            return False
        return value.type.device.type in ("cuda", "cpu")

    def _store_in(self, group: Group, value: Value) -> None:
        target = self.in_place.get(value)
        if target is not None:  # the mutated input itself (see _in_place_mutations)
            self.buffers[value] = self.layouts[target].buffer
            self.layouts[value] = self.layouts[target]
            self.producer[value] = group.position
            return
        shape = shape_of(value)
        strides = ix.contiguous_strides(shape)
        if group.rows is None and shape == group.shape:
            strides = strides_in_order(shape, group.order)
        elif group.rows is not None and shape == group.rows.shape:
            # A row kernel's full-size results (a BatchNorm backward's gradients) follow the
            # layout of what they are computed from, channels-last for a convolution's: a
            # contiguous one made the kernel store across the channels-last rows it reads.
            strides = self._strides_for(value)
        buffer = Buffer(
            value.name,
            shape,
            value.type.dtype,
            value.type.device,
            BufferKind.TEMP,
            strides,
        )
        self.buffers[value] = buffer
        self.layouts[value] = View(buffer, shape, buffer.strides, 0)
        self.producer[value] = group.position

    # -- the program --------------------------------------------------------------------------

    def program(self) -> Program:
        built: list[Step] = [
            self._build(step) if isinstance(step, Group) else step for step in self.steps
        ]
        outputs = [self.layouts[v] for v in self.outputs]
        used = _used_buffers(built, outputs)
        steps: list[Step] = []
        for step in built:
            if isinstance(step, Kernel):
                step.stores = [s for s in step.stores if id(s.buffer) in used]
                if not step.stores:
                    continue  # a kernel with xnumel == 0 stays: the wrapper allocates its outputs
            steps.append(step)
        program = Program(self.graph.name, self.inputs, combine_kernels(steps), outputs)
        plan_buffers(program)
        return program

    def _build(self, group: Group) -> Kernel:
        x = ix.var(X, group.numel)
        r = ix.var(R, group.rows.rnumel) if group.rows else Index()
        lowering = Lowering(self.layouts, set(group.members), x, r, group.rows, group.reductions)
        stores = []
        for value in group.members:
            index = group.index_of(value, x, r)
            assert index is not None
            buffer = self.buffers[value]
            offset = ix.linear(index, buffer.strides)
            stores.append(Store(buffer, offset, lowering.load(value, index)))
        order = self._node_order
        nodes = sorted(lowering.nodes.values(), key=lambda n: order.get(id(n), len(order)))
        name = f"k{group.position}_" + "_".join(_short_names(nodes))
        fused = [f"{n.op.printed_name}  {n.origin}".rstrip() for n in nodes]
        # An empty row reduces to the identity (a constant), leaving no loop over r.
        rnumel = max(group.rows.rnumel, 1) if group.rows else 1
        return Kernel(name, group.numel, rnumel, stores, fused, group.device)


def _own_cost(node: Node) -> int:
    """Ops per element of one node inlined: none for views and index generators, several for
    transcendental functions."""
    if node.op in VIEW_OPS or node.op in (Op.FULL, Op.IOTA):
        return 0
    return 3 if node.op in TRANSCENDENTAL else 1


def _origin(value: Value) -> Origin:
    return value.node.origin if value.node is not None else Origin("copy")


def _elements(group: Group) -> int:
    """How many elements a group's loops visit."""
    return group.numel * (group.rows.rnumel if group.rows else 1)


def _transposed(convolution: Node) -> bool:
    """Whether a convolution (or its backward: the forward's attrs are its keywords) is
    transposed."""
    attrs = convolution.attrs
    if convolution.op is Op.CONVOLUTION:
        return bool(attrs.transposed)
    return bool(attrs.kwargs.get("transposed", False))


def _copy_origin(convolution: Node) -> Origin:
    origin = convolution.origin
    return Origin("channels_last", origin.file, origin.line)


def _is_convolution(node: Node) -> bool:
    """A convolution or its backward (whose gradient and input operands cuDNN wants laid out
    like the forward's: a contiguous gradient made it transpose every one, and made the
    kernel writing it store across the channels-last rows it reads)."""
    return node.op is Op.CONVOLUTION or (
        node.op is Op.EXTERN and node.attrs.fn is convolution_backward
    )


def _short_names(nodes: list[Node]) -> list[str]:
    names: list[str] = []
    for node in nodes:
        api = node.origin.api.rsplit(".", 1)[-1].strip("_") or node.op.printed_name
        api = "".join(ch if ch.isalnum() else "_" for ch in api)[:16]
        if api not in names and node.op not in VIEW_OPS:
            names.append(api)
    return names[:3] or ["copy"]


def _used_buffers(steps: list[Step], outputs: list[View]) -> set[int]:
    used = {id(view.buffer) for view in outputs}
    for step in steps:
        if isinstance(step, ExternCall):
            used |= {id(o.buffer) for o in step.operands if isinstance(o, View)}
            continue
        written = {id(s.buffer) for s in step.stores}
        for expr in walk([s.value for s in step.stores]):
            if isinstance(expr, Load) and id(expr.buffer) not in written:
                used.add(id(expr.buffer))
    return used


def step_reads(step: Step) -> list[Buffer]:
    if isinstance(step, ExternCall):
        return [o.buffer for o in step.operands if isinstance(o, View)]
    return step.reads()


def step_writes(step: Step) -> list[Buffer]:
    return list(step.outputs) if isinstance(step, ExternCall) else step.writes()


def plan_buffers(program: Program) -> None:
    """Free each temporary after its last reader and let later kernels reuse its memory."""
    keep = {id(view.buffer) for view in program.outputs} | {id(b) for b in program.inputs}
    last: dict[int, int] = {}
    buffers: dict[int, Buffer] = {}
    for position, step in enumerate(program.steps):
        for buffer in [*step_writes(step), *step_reads(step)]:
            last[id(buffer)] = position
            buffers[id(buffer)] = buffer
    program.dead_after = [[] for _ in program.steps]
    for key, position in last.items():
        if key not in keep:
            program.dead_after[position].append(buffers[key])
    pool: dict[tuple[object, ...], list[Buffer]] = {}
    for position, step in enumerate(program.steps):
        if isinstance(step, Kernel):
            for buffer in step.writes():
                if buffer.kind is not BufferKind.TEMP:
                    continue
                free = pool.get(_reuse_key(buffer))
                if free:
                    program.reuses[id(buffer)] = free.pop()
        for buffer in program.dead_after[position]:
            if buffer.kind is BufferKind.TEMP:
                pool.setdefault(_reuse_key(buffer), []).append(buffer)


def _reuse_key(buffer: Buffer) -> tuple[object, ...]:
    return (buffer.device, buffer.dtype, buffer.numel)


def schedule(
    graph: Graph,
    inputs: Sequence[torch.Tensor],
    observed: dict[int, list[tuple[int, ...]]] | None = None,
) -> Program:
    """The program computing ``graph`` for inputs laid out like ``inputs``. Kernels run on
    one device each (a mixed-device graph gets kernels per device, transfers are externs).
    ``observed``: extern output strides seen at run time (by node id), where PyTorch chose
    another layout than the meta run predicted."""
    scheduler = Scheduler(graph, inputs, observed)
    scheduler.run()
    return scheduler.program()
