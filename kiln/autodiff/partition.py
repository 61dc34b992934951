"""Splitting a joint graph into a forward graph and a backward graph: what to save, what to
recompute.

The backward graph needs some forward values. Each can be *saved* (kept alive from the forward
to the backward: memory traffic and peak memory) or *recomputed* in the backward from other
values. Cheap elementwise and movement work (and random numbers, a pure function of the seed)
may be recomputed; reductions, externs (matmul, convolution, attention) and indexing may not.
The choice is a minimum cut (the reference approach of AOTAutograd's partitioner): each
forward value ``v`` is an edge ``v_in -> v_out`` whose capacity is its size in bytes; the
source feeds graph inputs (free to keep: they are alive anyway) and the outputs of nodes that
may not be recomputed; ``v_out`` feeds the sink when the backward reads ``v``; a use of ``u``
by the node producing ``w`` is an infinite edge ``u_out -> w_in``. The cut's edges are the
values to save; everything the backward needs beyond them is recomputed there. The cut
weighs bytes only, so a value it would recompute from more than ``MAX_RECOMPUTE_READS``
saved values of its size (a residual stream summed again from every branch's output), or
more than ``MAX_WINDOW_READS`` elements of one (a max pool's window), is saved instead, and
the cut is taken again.

For ``gelu(x @ w + b)`` this saves ``x``, ``w``, ``b`` and ``x @ w`` and recomputes the bias
add and gelu's elementwise chain in the backward. Nodes of a ``torch.utils.checkpoint`` region
(``Node.recompute``) are never saved: the backward recomputes them from the region's inputs,
matmuls included, as eager's checkpoint does.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import pairwise

from kiln.autodiff.reverse import Joint
from kiln.ir.graph import Graph, InputKind, Node, Value
from kiln.ir.op import Op, Tag, op_def
from kiln.passes.markers import recomputable_marker

INFINITE = 1 << 62
_RECOMPUTABLE_TAGS = frozenset({Tag.ELEMENTWISE, Tag.MOVEMENT, Tag.CREATION, Tag.RANDOM})
_NOT_RECOMPUTABLE = frozenset({Op.GATHER, Op.SCATTER, Op.SCATTER_ADD, Op.INDEX, Op.INDEX_PUT})
MAX_RECOMPUTE_READS = 3  # stored full-size values one recomputed value may read
MAX_WINDOW_READS = 4  # elements of one stored value an element's recomputation may read
_WINDOW_STATES = 4096  # (value, movement path) pairs visited before giving up: not costly
MAX_CUTS = 4  # rounds of cutting, then saving what recomputes from too much
Producers = dict[Value, Node | None]  # forward values and the nodes making them


@dataclass
class Partition:
    forward: Graph  # outputs: the original outputs, then the saved non-input values
    backward: Graph  # inputs: saved values (inputs first, then the rest), then cotangents
    saved_inputs: list[int]  # positions (in the forward graph's inputs) saved for the backward
    saved_count: int  # saved values that are forward outputs (after the original outputs)
    grad_inputs: list[int]  # forward input positions the backward's outputs are gradients of
    differentiable: list[int]  # positions of the original outputs that carry gradients


def recomputable(node: Node) -> bool:
    """Whether the backward may compute ``node`` again: cheap work, or any work the user
    asked to recompute (a checkpointed region)."""
    if node.recompute or recomputable_marker(node):
        return True
    row = op_def(node.op)
    return bool(row.tags & _RECOMPUTABLE_TAGS) and node.op not in _NOT_RECOMPUTABLE


def _size(value: Value) -> int:
    """Bytes of ``value`` (a symbolic dim counts as 1024 elements: large, not free)."""
    return max(1, _numel(value) * value.type.dtype.itemsize)


def choose_saved(joint: Joint) -> list[Value]:
    """The forward values to save: a minimum cut of the recomputation network, then again
    with each value whose recomputation reads too much (:func:`_costly_recomputations`)
    saved."""
    forward_nodes = joint.graph.nodes[: joint.forward_count]
    backward_nodes = joint.graph.nodes[joint.forward_count :]
    cotangents = set(joint.cotangents)
    forward_values: Producers = {v: None for v in joint.graph.inputs if v not in cotangents}
    for node in forward_nodes:
        for out in node.outputs:
            forward_values[out] = node
    needed = {v for node in backward_nodes for v in node.input_values() if v in forward_values} | {
        g for g in joint.input_grads if g is not None and g in forward_values
    }
    if not needed:
        return []
    kept: set[Value] = set()
    for _ in range(MAX_CUTS):
        saved = _min_cut(forward_values, needed, kept)
        costly = _costly_recomputations(forward_values, needed, set(saved))
        if not costly:
            return saved
        kept |= costly
    return saved


def _min_cut(forward_values: Producers, needed: set[Value], kept: set[Value]) -> list[Value]:
    """The values on a minimum cut between what may not be recomputed (and ``kept``) and
    what the backward reads."""
    flow = _Network()
    for value, producer in forward_values.items():
        if producer is None:
            flow.edge("S", ("in", value), INFINITE)
            flow.edge(("in", value), ("out", value), 1)  # inputs are alive anyway
            continue
        # Scaled, plus one for recomputable values: of two cuts of equal size, keep the one
        # that saves externs' and reductions' outputs and recomputes elementwise work.
        cost = 4 * _size(value) + (1 if recomputable(producer) else 0)
        if producer.recompute:
            cost = INFINITE  # checkpointed: recomputed from the region's inputs, never saved
        flow.edge(("in", value), ("out", value), cost)
        if not recomputable(producer) or value in kept:
            flow.edge("S", ("in", value), INFINITE)
        for operand in producer.input_values():
            flow.edge(("out", operand), ("in", value), INFINITE)
    for value in needed:
        flow.edge(("out", value), "T", INFINITE)
    source_side = flow.min_cut("S", "T")
    return [
        value
        for value in forward_values
        if ("in", value) in source_side and ("out", value) not in source_side
    ]


def _costly_recomputations(values: Producers, needed: set[Value], saved: set[Value]) -> set[Value]:
    """Values the backward reads that the cut recomputes from more than
    ``MAX_RECOMPUTE_READS`` stored values of their own size, taken in forward order, each
    counted as stored once it is found (the next ones recompute from it).

    The cut weighs bytes kept alive only. A residual stream in float32 is four bytes an
    element where each branch's bfloat16 output is two, so the cut saved every branch output
    and recomputed the stream, ``x0 + a1 + ... + an``, once for every LayerNorm backward that
    reads it: MaxViT's backward summed up to 23 saved tensors an element in one kernel, each
    through its own window permutation (a 1.1 MB Triton source)."""
    costly: set[Value] = set()
    stored = set(saved)
    for value, producer in values.items():
        if value not in needed or value in stored or producer is None or producer.recompute:
            continue
        if _recompute_reads(value, values, stored) > MAX_RECOMPUTE_READS:
            costly.add(value)
            stored.add(value)
        elif _window_reads(value, values, stored):
            root = _window_root(value, values, stored)
            costly.add(root)
            stored.add(root)
    return costly


def _recompute_reads(value: Value, values: Producers, stored: set[Value]) -> int:
    """How many stored values (saved, or graph inputs) with at least ``value``'s elements its
    recomputation reads."""
    reads, seen, stack = 0, {value}, [value]
    while stack and reads <= MAX_RECOMPUTE_READS:
        producer = values.get(current := stack.pop())
        if current is not value and (current in stored or producer is None):
            reads += _numel(current) >= _numel(value)
        elif producer is not None:
            operands = [v for v in dict.fromkeys(producer.input_values()) if v not in seen]
            stack += operands
            seen.update(operands)
    return reads


def _window_reads(value: Value, values: Producers, stored: set[Value]) -> bool:
    """Whether recomputing one element of ``value`` reads more than ``MAX_WINDOW_READS``
    elements of one stored value: a window's maximum (max pooling decomposes into strided
    slices of its input combined elementwise) or a stencil. Each distinct path of movement
    nodes (slice, pad, ...) from ``value`` to a stored value reads another element of it.

    A max pool's result and masks recomputed from the convolution output before it read 9
    elements each (a 3x3 window); ResNet's backward recomputed the pool's forward in five
    kernels on the way to its BatchNorm backward."""
    paths: dict[Value, set[tuple[int, ...]]] = {}
    seen: set[tuple[Value, tuple[int, ...]]] = {(value, ())}
    stack: list[tuple[Value, tuple[int, ...]]] = [(value, ())]
    while stack and len(seen) < _WINDOW_STATES:
        current, path = stack.pop()
        producer = values.get(current)
        if current is not value and (current in stored or producer is None):
            found = paths.setdefault(current, set())
            found.add(path)
            if len(found) > MAX_WINDOW_READS:
                return True
            continue
        if producer is None:
            continue
        if Tag.MOVEMENT in op_def(producer.op).tags:
            path = (*path, id(producer))
        for operand in dict.fromkeys(producer.input_values()):
            if (operand, path) not in seen:
                seen.add((operand, path))
                stack.append((operand, path))
    return False


def _window_root(value: Value, values: Producers, stored: set[Value]) -> Value:
    """What to save for ``value``, whose recomputation reads a window: while its producer is
    elementwise with one operand of its size that reads a window itself, and no other operand
    of its size, that operand. A max pool's gradient masks ``eq(position, j)`` save the one
    ``position`` they test, not nine masks; a pooled value summed over window positions,
    ``partial + where(position == 8, x8, 0)``, is saved whole (saving ``partial`` stored a
    second pooled-size tensor and recomputed the last terms in the backward)."""
    while (producer := values.get(value)) is not None:
        if Tag.ELEMENTWISE not in op_def(producer.op).tags:
            break
        operands = [o for o in dict.fromkeys(producer.input_values()) if _numel(o) >= _numel(value)]
        windowed = [
            operand
            for operand in operands
            if operand not in stored
            and values.get(operand) is not None
            and _numel(operand) == _numel(value)
            and _window_reads(operand, values, stored)
        ]
        if len(windowed) != 1 or len(operands) != 1:
            break
        value = windowed[0]
    return value


def _numel(value: Value) -> int:
    return math.prod(d if isinstance(d, int) else 1024 for d in value.type.shape)


class _Network:
    """A flow network with Dinic's maximum flow (graphs of a few thousand nodes)."""

    def __init__(self) -> None:
        self.capacity: dict[object, dict[object, int]] = {}

    def edge(self, a: object, b: object, capacity: int) -> None:
        self.capacity.setdefault(a, {})
        self.capacity.setdefault(b, {})
        self.capacity[a][b] = self.capacity[a].get(b, 0) + capacity
        self.capacity[b].setdefault(a, 0)

    def _levels(self, source: object, sink: object) -> dict[object, int] | None:
        level = {source: 0}
        queue = deque([source])
        while queue:
            a = queue.popleft()
            for b, cap in self.capacity[a].items():
                if cap > 0 and b not in level:
                    level[b] = level[a] + 1
                    queue.append(b)
        return level if sink in level else None

    def _blocking_flow(self, source: object, sink: object, level: dict[object, int]) -> bool:
        """Augment along shortest paths until none is left (iterative: paths can be long)."""
        pointer = {a: list(edges) for a, edges in self.capacity.items()}
        found = False
        while True:
            path = [source]
            while path and path[-1] != sink:
                a = path[-1]
                edges = pointer[a]
                while edges:
                    b = edges[-1]
                    if self.capacity[a][b] > 0 and level.get(b) == level[a] + 1:
                        path.append(b)
                        break
                    edges.pop()
                else:
                    path.pop()  # a dead end: never try it again in this phase
                    if path:
                        pointer[path[-1]].pop()
            if not path:
                return found
            amount = min(self.capacity[a][b] for a, b in pairwise(path))
            for a, b in pairwise(path):
                self.capacity[a][b] -= amount
                self.capacity[b][a] += amount
            found = True

    def min_cut(self, source: object, sink: object) -> set[object]:
        """The nodes on the source side of a minimum cut."""
        while (level := self._levels(source, sink)) is not None:
            self._blocking_flow(source, sink, level)
        reached = {source}
        queue = deque([source])
        while queue:
            a = queue.popleft()
            for b, cap in self.capacity[a].items():
                if cap > 0 and b not in reached:
                    reached.add(b)
                    queue.append(b)
        return reached


def partition(joint: Joint, forward: Graph) -> Partition:
    """The forward and backward graphs of ``joint`` (``forward`` is the original graph)."""
    saved = choose_saved(joint)
    saved_inputs = [forward.inputs.index(v) for v in saved if v in forward.inputs]
    saved_values = [v for v in saved if v not in forward.inputs]
    fwd = Graph(
        inputs=list(forward.inputs),
        nodes=list(forward.nodes),
        outputs=[*forward.outputs, *saved_values],
        mutations=list(forward.mutations),
        constants=dict(forward.constants),
        name=f"{forward.name}_forward",
    )
    fwd._names, fwd._counter = set(forward._names), forward._counter
    backward, grad_inputs = _backward_graph(
        joint, [forward.inputs[i] for i in saved_inputs], saved_values
    )
    return Partition(
        fwd, backward, saved_inputs, len(saved_values), grad_inputs, joint.differentiable_outputs
    )


def _backward_graph(
    joint: Joint, saved_inputs: list[Value], saved_values: list[Value]
) -> tuple[Graph, list[int]]:
    graph = Graph(name=f"{joint.graph.name.removesuffix('_joint')}_backward")
    mapping: dict[Value, Value] = {}
    for value in [*saved_inputs, *saved_values]:
        kind = value.kind if value.kind is InputKind.RNG_SEED else InputKind.USER
        mapping[value] = graph.add_input(
            value.type.with_(requires_grad=False), name=value.name, kind=kind
        )
    for cotangent in joint.cotangents:
        mapping[cotangent] = graph.add_input(cotangent.type, name=cotangent.name)
    targets = [g for g in joint.input_grads if g is not None]
    needed = _needed(joint.graph.nodes, targets, set(mapping))
    recomputed = set(joint.graph.nodes[: joint.forward_count])
    for node in _schedule(joint.graph.nodes, needed, recomputed):
        if node in recomputed:
            assert recomputable(node), f"{node.op.name} recomputed in the backward"
        operands = tuple(mapping[i] if isinstance(i, Value) else i for i in node.inputs)
        copy = graph.append(
            node.op,
            operands,
            node.attrs,
            tuple(o.type.with_(requires_grad=False) for o in node.outputs),
            node.origin,
        )
        mapping.update(zip(node.outputs, copy.outputs, strict=True))
    grad_inputs = [i for i, g in enumerate(joint.input_grads) if g is not None]
    graph.outputs = [mapping[g] for g in joint.input_grads if g is not None]
    return graph, grad_inputs


def _schedule(nodes: list[Node], needed: set[Node], recomputed: set[Node]) -> list[Node]:
    """The backward's order: its own nodes in order, each preceded by the recomputations it
    needs that have not run yet. Recomputing just in time keeps each recomputed activation
    alive briefly, instead of the whole network's at once."""
    producer = {out: node for node in nodes for out in node.outputs}
    order: list[Node] = []
    done: set[Node] = set()
    for node in nodes:
        if node not in needed or node in recomputed:
            continue
        stack: list[tuple[Node, bool]] = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if current in done:
                continue
            if expanded:
                done.add(current)
                order.append(current)
                continue
            stack.append((current, True))
            for value in current.input_values():
                source = producer.get(value)
                if source is not None and source in needed and source not in done:
                    stack.append((source, False))
    order += [node for node in nodes if node in needed and node not in done]  # grads = values
    return order


def _needed(nodes: list[Node], targets: list[Value], available: set[Value]) -> set[Node]:
    """The nodes that compute ``targets`` from ``available`` values."""
    producer = {out: node for node in nodes for out in node.outputs}
    needed: set[Node] = set()
    stack = [t for t in targets if t not in available]
    seen: set[Value] = set()
    while stack:
        value = stack.pop()
        if value in seen or value in available:
            continue
        seen.add(value)
        node = producer[value]
        needed.add(node)
        stack.extend(v for v in node.input_values() if v not in available)
    return needed
