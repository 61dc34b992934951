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

The walk asks ``inlining.py`` which pointwise values cost too much to recompute,
``layout_choice.py`` how to lay out what it stores, and ``mutations.py`` which mutated inputs
a kernel writes in place; ``group.py`` holds the kernels being formed and builds them, and
``buffers.py`` drops the dead stores and plans the buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from kiln.ir.graph import Graph, Node, Origin, Value
from kiln.ir.op import Op
from kiln.ir.symbolic import Dim
from kiln.schedule import index as ix
from kiln.schedule.buffers import drop_dead_stores, plan_buffers
from kiln.schedule.combine import combine_kernels
from kiln.schedule.eager_layouts import as_eager, eager_result_strides, storable
from kiln.schedule.group import Group, build_kernel
from kiln.schedule.inlining import Inlining
from kiln.schedule.layout_choice import LayoutChoice, channels_last_copy, copied
from kiln.schedule.layouts import (
    Observed,
    channels_last_strides,
    extern_strides,
    input_layout,
    memory_order,
    observed_strides,
    strides_in_order,
)
from kiln.schedule.loops import Buffer, BufferKind
from kiln.schedule.lowering import (
    EXTERN_OPS,
    REDUCE_KINDS,
    Lowering,
    NotFusable,
    RowSpace,
    in_kernels,
    reduced_dims,
    shape_of,
)
from kiln.schedule.mutations import in_place_mutations
from kiln.schedule.program import ExternCall, Program, Step, View
from kiln.schedule.views import VIEW_OPS, view_of

MAX_MEMBERS = 16  # values one kernel may compute and store
SEARCH_DEPTH = 6  # how many recent kernels a value tries to join


# Independent reductions over the same rows share a kernel when it visits at most this many
# elements: there a launch costs more than the extra loads.
SMALL_KERNEL_ELEMENTS = 1 << 16


class Scheduler:
    """The fusion walk over one graph: its steps so far and where each value lives."""

    def __init__(
        self,
        graph: Graph,
        inputs: Sequence[torch.Tensor],
        observed: dict[str, list[Observed]] | None = None,
    ):
        self.graph = graph
        self.observed = observed or {}  # node's first output name -> extern layouts seen
        self._node_order = {id(node): i for i, node in enumerate(graph.nodes)}
        self.users = graph.users()
        self.outputs = [*graph.outputs, *(new for _, new in graph.mutations)]
        self.layouts: dict[Value, View] = {}
        self.producer: dict[Value, int] = {}  # value in memory -> step making it (-1: input)
        self.steps: list[Group | ExternCall] = []
        self.buffers: dict[Value, Buffer] = {}  # values a group stores
        self.inputs: list[Buffer] = []
        self._copies: dict[Value, Value] = {}  # graph input -> its channels-last copy
        for value, tensor in zip(graph.inputs, inputs, strict=True):
            shape, strides = input_layout(value.type.shape, tensor)
            buffer = Buffer(
                value.name, shape, tensor.dtype, tensor.device, BufferKind.INPUT, strides
            )
            self.inputs.append(buffer)
            self.layouts[value] = View(buffer, buffer.shape, buffer.strides, 0)
            self.producer[value] = -1
        self.inlining = Inlining(graph, self.users, self.outputs, self.layouts)
        self.layout = LayoutChoice(self.users, self.layouts)
        self.in_place = in_place_mutations(graph, self.users, self.layouts)
        self.eager = eager_result_strides(graph, self.layouts)  # results' layouts, as eager's

    # -- decisions ----------------------------------------------------------------------------

    def run(self) -> None:
        # Outputs are views of what computed them, gapped ones too (a padded matmul's columns:
        # torch.compile returns those strides as well); a dense copy doubled GPT-2's logits.
        self._walk()
        self._eager_results()

    def _walk(self) -> None:
        self._place_input_factors()
        for node in self.graph.nodes:
            if node.outputs and node.outputs[0] in self.layouts:
                continue  # (placed ahead: see _place_input_factors)
            if node.op in VIEW_OPS and self._try_view(node):
                continue
            if not in_kernels(node):
                self._extern(node)
            elif node.op in REDUCE_KINDS:
                self._place_reduction(node.output)
            else:
                value = node.output
                inlining = self.inlining
                if value in inlining.needs_memory or inlining.costs_too_much_inlined(value):
                    self._place_pointwise(value)
                elif inlining.broadcast_costs_too_much(value):
                    self._place_beside(value)
                elif self._feeds_other_rows(value):
                    self._place_as_row_epilogue(value)

    def _eager_results(self) -> None:
        """Results the caller receives in eager's layout (``eager_layouts.py``): kernels store
        them so already; one an extern or a view left in another layout is copied into it."""
        copies: dict[Value, Value] = {}
        for position in range(self.graph.user_outputs or 0):
            value = self.outputs[position]
            want, view = self.eager.get(value), self.layouts[value]
            if want is None or as_eager(view.shape, view.strides, want):
                continue
            if value not in copies:
                copy = copied(
                    value, "eager_layout", value.node.origin if value.node else Origin("")
                )
                self.users[copy], self.eager[copy] = [], want
                self._start_kernel(copy, storable(view.shape, want))
                copies[value] = copy
            self.outputs[position] = copies[value]

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
        numel = math.prod(shape_of(value))
        for group in self._groups():
            if group.rows is not None and group.rows.xnumel == numel and self._join(group, value):
                return

    def _place_input_factors(self) -> None:
        """Store small work broadcast into large that reads graph inputs only (a backward's
        per-channel factors of the saved BatchNorm statistics) before anything else: their
        kernels, one per size, then share one launch, and no later kernel waits for them."""
        inputs_only: set[Value] = set(self.graph.inputs)  # values computed from inputs alone
        for node in self.graph.nodes:
            if len(node.outputs) != 1 or not in_kernels(node) or node.op in REDUCE_KINDS:
                continue
            if not all(v in inputs_only for v in node.input_values()):
                continue
            value = node.output
            inputs_only.add(value)
            if node.op in VIEW_OPS or value in self.inlining.needs_memory:
                continue
            if self.inlining.broadcast_costs_too_much(value):
                self._place_beside(value)
                for group in self._groups():
                    group.factors = True  # (the walk has placed nothing else yet)
        self.inlining.forget_costs()  # (counted down to the inputs: the walk has more)

    def _place_beside(self, value: Value) -> None:
        """Store ``value`` (small work broadcast into large) from a recent kernel that can
        compute it (the kernel finishing a BatchNorm's statistics), or from a small kernel of
        its own that other such values then join (a backward's per-channel factors of the
        saved statistics)."""
        for group in self._groups():
            if self._join(group, value, loose=group.elements <= SMALL_KERNEL_ELEMENTS):
                return
        self._start_kernel(value, self.layout.strides_for(value))

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
                operands.append(self._extern_operand(node, position, operand))
            else:
                operands.append(operand)
        position = len(self.steps)
        seen = self.observed.get(node.outputs[0].name)
        if seen:
            strides = observed_strides(node, seen, lambda: extern_strides(node, operands))
        else:
            strides = extern_strides(node, operands)
        in_place = self._writes_in_place(node)
        if in_place:
            strides = [self.layouts[node.inputs[0]].strides]  # type: ignore[index]
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
        step = ExternCall(node, tuple(operands), tuple(outputs), reason, in_place)  # type: ignore[arg-type]
        self.steps.append(step)

    def _writes_in_place(self, node: Node) -> bool:
        """Whether index_put ``node`` can write its operand 0 in place, which nothing else
        reads and is a whole buffer of the result's dtype: the graph input it mutates, as
        eager's ``index_copy_`` does (a static key-value cache's update: else PyTorch's
        index_put copies the input and the write-back copies the result into it, two copies
        of a whole cache a layer), or a temporary a kernel stored (an embedding's gradient,
        zeros scattered into: else PyTorch copies them first, 126 us a step for GPT-2's
        50257x768 float32 table on an H200). Its memory is not reused while the result lives
        (``buffers.plan_buffers``)."""
        target = node.inputs[0]
        if node.op is not Op.INDEX_PUT or not isinstance(target, Value):
            return False
        view = self.layouts[target]
        buffer = view.buffer
        if buffer.kind is BufferKind.INPUT:
            mutated = (target, node.output) in self.graph.mutations
            eligible = mutated and not target.type.requires_grad
        else:
            eligible = buffer.kind is BufferKind.TEMP and self.producer.get(target, -1) >= 0
        return (
            eligible
            and (view.shape, view.strides, view.offset) == (buffer.shape, buffer.strides, 0)
            and self.users.get(target) == [node]
            and target not in self.graph.outputs
            and target.type.dtype == node.output.type.dtype
        )

    def _extern_operand(self, node: Node, position: int, operand: Value) -> View:
        """How extern ``node`` reads ``operand``, its operand at ``position``: as it is in
        memory, or, for a graph input layout choice copies channels-last for a convolution
        (``LayoutChoice.copies_channels_last``), through that copy, made once."""
        view = self.layouts[operand]
        from_input = self.producer.get(operand) == -1  # a graph input or a view of one
        if not (from_input and self.layout.copies_channels_last(node, position, operand)):
            return view
        copy = self._copies.get(operand)
        if copy is None:
            copy = channels_last_copy(operand, node)
            self.users[copy] = [node]
            self._start_kernel(copy, channels_last_strides(shape_of(copy)))
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
        self._start_kernel(value, self.layout.strides_for(value))

    def _start_kernel(self, value: Value, strides: tuple[Dim, ...]) -> None:
        """Store ``value`` from a new pointwise kernel, which walks it in the memory order of
        ``strides``."""
        group = self._new_group(ix.product(shape_of(value)), value.type.device, None)
        group.shape = shape_of(value)
        group.order = memory_order(strides)
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
                if user.op in REDUCE_KINDS or user.op in VIEW_OPS or not in_kernels(user):
                    continue
                output = user.outputs[0] if len(user.outputs) == 1 else None
                if output is not None and output not in seen and shape_of(output) == shape:
                    seen.add(output)
                    frontier.append(output)
        return None

    def _new_group(self, numel: Dim, device: torch.device, rows: RowSpace | None) -> Group:
        group = Group(len(self.steps), numel, device, rows)
        self.steps.append(group)
        return group

    def _join(self, group: Group, value: Value, require: bool = False, loose: bool = False) -> bool:
        if len(group.members) >= MAX_MEMBERS or group.device != value.type.device:
            return False
        x, r = group.loop_variables()
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
        small = loose or (is_reduction and group.elements <= SMALL_KERNEL_ELEMENTS)
        if not require and group.members and not lowering.touched & group.touched and not small:
            return False
        group.members.append(value)
        group.touched |= lowering.touched
        if is_reduction:
            group.reductions.add(value)
        self._store_in(group, value)
        return True

    def _store_in(self, group: Group, value: Value) -> None:
        target = self.in_place.get(value)
        if target is not None:  # the mutated input itself (see ``mutations.py``)
            self.buffers[value] = self.layouts[target].buffer
            self.layouts[value] = self.layouts[target]
            self.producer[value] = group.position
            return
        shape = shape_of(value)
        strides = ix.contiguous_strides(shape)
        # A row kernel's full-size results (a BatchNorm backward's gradients) follow the
        # layout of what they are computed from, channels-last for a convolution's: a
        # contiguous one made the kernel store across the channels-last rows it reads. And a
        # convolution's operand is stored channels-last even by a kernel walking another order
        # (beside the contiguous residual stream, in ConvNeXt: cuDNN's NCHW depthwise path is
        # PyTorch's generic kernel, 1.6 ms of the step's forward on the H200).
        rows = group.rows is not None and shape == group.rows.shape
        if rows or self.layout.wants_channels_last(value):
            strides = self.layout.strides_for(value)
        elif group.rows is None and shape == group.shape:
            strides = strides_in_order(shape, group.order)
            # A member computed from a value in memory keeps that value's dim order when the
            # innermost dim is the kernel's (its stores stay contiguous runs): a Llama
            # backward's recomputed q, fused after the repeated k ([B, H, L, E]), kept the
            # [B, L, H, E] order of its projection, as in the forward, so cuDNN's backward
            # reads q laid out as the output it saved (else a copy of both: ops/attention.py).
            source = self.layout.source_strides(value)
            if source and memory_order(source)[-1] == group.order[-1]:
                moved = any(a != b for a, b, n in zip(source, strides, shape, strict=True) if n > 1)
                strides = source if moved else strides
        if value in self.eager:  # a result: as eager lays it out (dense: see storable)
            strides = storable(shape, self.eager[value])
        buffer = Buffer(
            value.name, shape, value.type.dtype, value.type.device, BufferKind.TEMP, strides
        )
        self.buffers[value] = buffer
        self.layouts[value] = View(buffer, shape, buffer.strides, 0)
        self.producer[value] = group.position

    # -- the program --------------------------------------------------------------------------

    def _ready(self, step: Group, mutated: set[Value]) -> Callable[[Value], bool]:
        """Whether a value in memory holds its value when ``step`` runs: a graph input no
        kernel writes in place (``mutated``: those some step writes), or the result of an
        earlier step."""
        position = step.position

        def ready(value: Value) -> bool:
            if value.node is None:
                return value not in mutated
            return self.producer.get(value, position) < position

        return ready

    def program(self) -> Program:
        mutated = {target for target, _ in self.graph.mutations}
        built: list[Step] = [
            build_kernel(
                step, self.layouts, self.buffers, self._node_order, self._ready(step, mutated)
            )
            if isinstance(step, Group)
            else step
            for step in self.steps
        ]
        outputs = [self.layouts[v] for v in self.outputs]
        steps = drop_dead_stores(built, outputs)
        program = Program(self.graph.name, self.inputs, combine_kernels(steps), outputs)
        plan_buffers(program)
        return program


def schedule(
    graph: Graph,
    inputs: Sequence[torch.Tensor],
    observed: dict[str, list[Observed]] | None = None,
) -> Program:
    """The program computing ``graph`` for inputs laid out like ``inputs``. Kernels run on
    one device each (a mixed-device graph gets kernels per device, transfers are externs).
    ``observed``: extern output shapes and strides seen at run time (by the name of the node's first
    output), where PyTorch chose another layout than the meta run predicted."""
    with ix.memo_scope():
        scheduler = Scheduler(graph, inputs, observed)
        scheduler.run()
        return scheduler.program()
