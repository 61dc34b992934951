"""The layout eager PyTorch gives a graph's results, so that the caller sees eager's strides.

Kiln lays values out for its kernels (channels-last around convolutions, a producer's dim
order), but a result the caller receives is an eager tensor to them: ``out.view(n, -1)``, a C
extension or the next graph's guards see its strides. Eager's layout of each result is derived
from the inputs' real strides by eager's own rules, where they are simple:

- a view (permute, slice, expand, reshape without a copy) of a value: the view of its layout;
- elementwise work (TensorIterator): the dim order of its first dense operand of the result's
  shape, else contiguous;
- a convolution: channels-last when its input is (``suggest_memory_format``), else contiguous;
  a matmul: contiguous; a cat: channels-last when every operand is, else contiguous.

Other results (attention, reductions, externs) are left as the schedule lays them out. The
scheduler stores a result whose eager layout is known and dense in that layout, and copies one
an extern or a view left in another (``Scheduler._eager_results``).
"""

from __future__ import annotations

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.op import Op, Tag, op_def
from kiln.ir.symbolic import Dim
from kiln.schedule import index as ix
from kiln.schedule.layouts import channels_last_strides, memory_order, strides_in_order
from kiln.schedule.lowering import in_kernels, shape_of
from kiln.schedule.program import View
from kiln.schedule.views import VIEW_OPS, is_dense, view_of

Strides = tuple[Dim, ...]
CONTIGUOUS_EXTERNS = frozenset({Op.MM, Op.BMM, Op.ADDMM, Op.BADDBMM})


def eager_result_strides(graph: Graph, layouts: dict[Value, View]) -> dict[Value, Strides]:
    """The strides eager gives each of the first ``graph.user_outputs`` outputs, where the
    rules above know them (``layouts``: the graph inputs, as the caller laid them out)."""
    if not graph.user_outputs:
        return {}
    known: dict[Value, Strides | None] = {v: layouts[v].strides for v in graph.inputs}
    for node in graph.nodes:  # (in topological order: operands before their users)
        if len(node.outputs) == 1:
            known[node.output] = _strides(node, known)
    results: dict[Value, Strides] = {}
    for value in graph.outputs[: graph.user_outputs]:
        strides = known.get(value)
        if strides is not None and 0 not in strides:
            results[value] = strides
    return results


def storable(shape: Strides, strides: Strides) -> Strides:
    """Strides a kernel can store a result in: eager's when they are dense, else dense ones in
    eager's dim order (a slice of a view: the copy keeps its order, not its gaps)."""
    dense = is_dense(View(None, shape, strides, 0))  # type: ignore[arg-type]
    return strides if dense else strides_in_order(shape, memory_order(strides))


def as_eager(shape: Strides, actual: Strides, eager: Strides) -> bool:
    """Whether a result laid out with ``actual`` strides looks as eager's (``eager``): the same
    strides, or for a result eager returns with gaps, the same dim order."""
    if storable(shape, eager) != eager:
        big = [d for d, n in enumerate(shape) if n > 1]
        return [d for d in memory_order(actual) if d in big] == [
            d for d in memory_order(eager) if d in big
        ]
    return all(a == b for a, b, n in zip(actual, eager, shape, strict=True) if n > 1)


def _strides(node: Node, known: dict[Value, Strides | None]) -> Strides | None:
    """Eager's strides of ``node``'s result (None: no rule knows them), its operands' in
    ``known``."""
    shape = shape_of(node.output)
    operands = [v for v in node.inputs if isinstance(v, Value)]
    if node.op in VIEW_OPS:
        base = known.get(operands[0])
        if base is None:
            return None
        view = view_of(View(None, shape_of(operands[0]), base, 0), node)  # type: ignore[arg-type]
        return view.strides if view is not None else None
    if node.op in CONTIGUOUS_EXTERNS:
        return ix.contiguous_strides(shape)
    if node.op is Op.CONVOLUTION or node.op is Op.CAT:
        # (a convolution follows its input, operand 0; a cat, all its operands)
        sources = operands[:1] if node.op is Op.CONVOLUTION else operands
        last = len(shape) == 4 and all(_channels_last(v, known) for v in sources)
        return channels_last_strides(shape) if last else ix.contiguous_strides(shape)
    if in_kernels(node) and Tag.ELEMENTWISE in op_def(node.op).tags:
        # The first operand of the result's shape that is not expanded decides; one of unknown
        # layout (a pooled value) makes the result's unknown too.
        for operand in (v for v in operands if shape_of(v) == shape):
            strides = known.get(operand)
            if strides is None:
                return None
            if 0 not in strides:
                return strides_in_order(shape, memory_order(strides))
        return ix.contiguous_strides(shape)
    return None


def _channels_last(value: Value, known: dict[Value, Strides | None]) -> bool:
    strides = known.get(value)
    shape = shape_of(value)
    return (
        strides is not None
        and len(shape) == 4
        and strides != ix.contiguous_strides(shape)
        and all(
            a == b
            for a, b, n in zip(strides, channels_last_strides(shape), shape, strict=True)
            if n > 1
        )
    )
