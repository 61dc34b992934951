"""Table-driven test of every registry row x every dtype it supports, on CPU.

For each sample: the op's meta must predict the shape and dtype eager torch produces; a
one-node graph built through the prims must verify, interpret to eager's result, and print as
Python that runs to the same result.
"""

from __future__ import annotations

import pytest
import torch

import kiln.ops  # noqa: F401  (registers rows)
from kiln.ir import (
    Graph,
    GraphBuilder,
    Op,
    Tag,
    TensorType,
    Value,
    interpret,
    load_printed,
    op_def,
    registered_ops,
    verify,
)
from kiln.ops import prims
from kiln.ops.attrs import RandomAttrs
from kiln.ops.externs import extern_call

ROWS = [(row.op, dtype) for row in registered_ops() for dtype in sorted(row.dtypes, key=str)]


def test_every_op_has_a_row_with_samples() -> None:
    missing = [op.name for op in Op if op not in {row.op for row in registered_ops()}]
    assert not missing, f"ops without registry rows: {missing}"
    for row in registered_ops():
        assert row.samples is not None and row.dtypes, f"{row.op.name} has no samples"


def _graph_of(
    op: Op, inputs: tuple[object, ...], attrs: object
) -> tuple[Graph, list[torch.Tensor]]:
    graph = Graph(name="one_op")
    tensors: list[torch.Tensor] = []
    operands: list[object] = []
    with GraphBuilder(graph):
        for index, item in enumerate(inputs):
            if isinstance(item, torch.Tensor):
                operands.append(graph.add_input(TensorType.of(item), name=f"x{index}"))
                tensors.append(item)
            elif isinstance(item, list | tuple) and item and isinstance(item[0], torch.Tensor):
                raise AssertionError("prims take flat operands")
            else:
                operands.append(item)
        kwargs = {}
        if attrs is not None:
            kwargs = {name: getattr(attrs, name) for name in attrs.__dataclass_fields__}
        result = prims.call(op, *operands, **kwargs)
        graph.outputs = list(result) if isinstance(result, tuple) else [result]
    return graph, tensors


def _same(actual: torch.Tensor, expected: torch.Tensor, random: bool) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    if not random:
        torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize(("op", "dtype"), ROWS, ids=[f"{o.name.lower()}-{d}" for o, d in ROWS])
def test_row(op: Op, dtype: torch.dtype) -> None:
    row = op_def(op)
    assert row.samples is not None
    samples = row.samples(dtype, torch.device("cpu"))
    assert samples, f"{op.name} has no samples for {dtype}"
    random = Tag.RANDOM in row.tags
    for sample in samples:
        expected = row.impl(sample.attrs, *sample.inputs)
        expected_list = list(expected) if isinstance(expected, tuple) else [expected]
        graph, tensors = _graph_of(op, sample.inputs, sample.attrs)
        verify(graph)
        for value, tensor in zip(graph.outputs, expected_list, strict=True):
            assert isinstance(value, Value)
            assert value.type.shape == tuple(tensor.shape), sample.note
            assert value.type.dtype == tensor.dtype, sample.note
        for actual, want in zip(interpret(graph, tensors), expected_list, strict=True):
            _same(actual, want, random)
        for actual, want in zip(load_printed(graph)(*tensors), expected_list, strict=True):
            _same(actual, want, random)


# ---------------------------------------------------------------------------------------------
# rows whose contract the table cannot check: random streams, extern_call


def _draw(op: Op, seed: int, offset: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    attrs = RandomAttrs((10_000,), dtype, torch.device("cpu"), offset)
    return op_def(op).impl(attrs, torch.tensor(seed, dtype=torch.int64))


@pytest.mark.parametrize("op", [Op.RANDOM_UNIFORM, Op.RANDOM_NORMAL], ids=["uniform", "normal"])
def test_random_is_a_function_of_seed_and_offset(op: Op) -> None:
    torch.manual_seed(0)  # the global generator must play no part
    first = _draw(op, 1234, 7)
    torch.manual_seed(1)
    assert torch.equal(first, _draw(op, 1234, 7))
    assert not torch.equal(first, _draw(op, 1234, 8))
    assert not torch.equal(first, _draw(op, 1235, 7))
    narrow = _draw(op, 1234, 7, torch.bfloat16).float()  # the same numbers, rounded
    torch.testing.assert_close(narrow, first, rtol=2**-8, atol=2**-8)


def test_random_statistics() -> None:
    uniform = _draw(Op.RANDOM_UNIFORM, -99, 3).double()
    assert uniform.min() >= 0 and uniform.max() < 1
    assert abs(uniform.mean() - 0.5) < 0.015 and abs(uniform.std() - 12**-0.5) < 0.01
    normal = _draw(Op.RANDOM_NORMAL, 2**40, 0).double()
    assert abs(normal.mean()) < 0.05 and abs(normal.std() - 1) < 0.03
    assert _draw(Op.RANDOM_UNIFORM, 5, 0, torch.bfloat16).max() < 1  # rounding never reaches 1


def test_extern_call_rebuilds_the_result_structure() -> None:
    graph = Graph(name="externs")
    with GraphBuilder(graph) as builder:
        x = graph.add_input(TensorType((3, 4), torch.float32), name="x")
        pair = extern_call(torch.aminmax, (x,), {"dim": 1})
        cat = extern_call(torch.cat, ([x, x, torch.ones(3, 4)],), {"dim": 0})
        parts = extern_call(torch.split, (cat, 4))
        graph.outputs = [pair.min, pair.max, cat, *parts]
        with pytest.raises(TypeError, match="only tensors"):
            extern_call(torch.Tensor.size, (x,))
        assert builder.graph is graph
    verify(graph)
    assert [len(node.inputs) for node in graph.nodes] == [1, 2, 1]  # a repeated value: one slot
    assert isinstance(parts, tuple) and len(parts) == 3
    x_value = torch.randn(3, 4)
    inputs = [x_value, *graph.constants.values()]
    got = interpret(graph, inputs)
    want_cat = torch.cat([x_value, x_value, torch.ones(3, 4)])
    want = [*torch.aminmax(x_value, dim=1), want_cat, *torch.split(want_cat, 4)]
    for actual, expected in zip(got, want, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_extern_runner_calls_like_the_row_impl() -> None:
    # The host program's bound extern call: Slots filled by position (top level) or through
    # the general path (nested), same results and errors as the row's impl.
    from kiln.ops.attrs import ExternAttrs, Slot
    from kiln.ops.externs import extern_runner

    a, b = torch.randn(3, 4), torch.randn(3, 4)
    cases = [
        ExternAttrs(torch.add, (Slot(0), Slot(1)), {"alpha": 2.0}),
        ExternAttrs(torch.add, (Slot(1),), {"other": Slot(0)}),
        ExternAttrs(torch.aminmax, (Slot(0),), {"dim": 1}),
        ExternAttrs(torch.cat, ([Slot(0), Slot(1)],), {"dim": 0}),
    ]
    impl = op_def(Op.EXTERN).impl
    for attrs in cases:
        got, want = extern_runner(attrs)(a, b), impl(attrs, a, b)
        got_list = [got] if isinstance(got, torch.Tensor) else list(got)
        want_list = [want] if isinstance(want, torch.Tensor) else list(want)
        assert len(got_list) == len(want_list)
        for g, w in zip(got_list, want_list, strict=True):
            torch.testing.assert_close(g, w)
    with pytest.raises(IndexError, match="Slot"):
        extern_runner(cases[0])(a)


def test_inlining_cost_reads_transcendentals_from_the_tag() -> None:
    """The scheduler's inlining cost comes from ``Tag.TRANSCENDENTAL`` on the rows."""
    from kiln.schedule.inlining import op_cost

    tagged = {row.op for row in registered_ops() if Tag.TRANSCENDENTAL in row.tags}
    assert tagged == {Op.EXP, Op.LOG, Op.TANH, Op.ERF, Op.POW, Op.SIN, Op.COS}
    assert all(Tag.ELEMENTWISE in op_def(op).tags for op in tagged)
    assert all(op_cost(op) == 3 for op in tagged)
    assert op_cost(Op.ADD) == 1
