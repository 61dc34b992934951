"""torch.fx interop: ``kiln.to_fx`` and ``kiln.from_fx`` on every registry row's samples, on
symbolic traces of small modules and on aten-level (``make_fx``) graphs, against the reference
interpreter and eager PyTorch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import kiln
from kiln.frontends.fx import PrimCall
from kiln.frontends.trace import graph_inputs
from kiln.ir import (
    Graph,
    GraphBuilder,
    InputKind,
    Op,
    Tag,
    TensorType,
    interpret,
    op_def,
    registered_ops,
)
from kiln.ops import prims

ROWS = [(row.op, dtype) for row in registered_ops() for dtype in sorted(row.dtypes, key=str)]


def _one_node_graph(op: Op, inputs: tuple[Any, ...], attrs: Any) -> tuple[Graph, list[Any]]:
    graph = Graph(name="one_op")
    tensors: list[torch.Tensor] = []
    operands: list[Any] = []
    with GraphBuilder(graph):
        for index, item in enumerate(inputs):
            if isinstance(item, torch.Tensor):
                operands.append(graph.add_input(TensorType.of(item), name=f"x{index}"))
                tensors.append(item)
            else:
                operands.append(item)
        fields = getattr(attrs, "__dataclass_fields__", {})
        result = prims.call(op, *operands, **{name: getattr(attrs, name) for name in fields})
        graph.outputs = list(result) if isinstance(result, tuple) else [result]
    return graph, tensors


def _fx_arguments(graph: Graph, inputs: list[Any]) -> list[Any]:
    """to_fx's calling convention: graph inputs except constants (module attributes)."""
    return [
        t for v, t in zip(graph.inputs, inputs, strict=True) if v.kind is not InputKind.CONSTANT
    ]


def _same(actual: list[Any], expected: list[Any], exact: bool = True) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        tolerance = {"rtol": 0, "atol": 0} if exact else {}
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance)


@pytest.mark.parametrize(("op", "dtype"), ROWS, ids=[f"{o.name.lower()}-{d}" for o, d in ROWS])
def test_op_table_round_trips(op: Op, dtype: torch.dtype) -> None:
    row = op_def(op)
    assert row.samples is not None
    for sample in row.samples(dtype, torch.device("cpu")):
        graph, tensors = _one_node_graph(op, sample.inputs, sample.attrs)
        expected = interpret(graph, tensors)
        gm = kiln.to_fx(graph)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert isinstance(calls[0].target, PrimCall) and calls[0].target.op is op
        _same(list(gm(*tensors)), expected)
        again = kiln.from_fx(gm, tensors)  # each PrimCall emits its node again
        assert [n.op for n in again.nodes] == [n.op for n in graph.nodes]
        _same(interpret(again, graph_inputs(again, gm, *tensors)), expected)


def test_constants_are_attributes_and_mutations_follow_outputs() -> None:
    scale = torch.randn(4)

    def step(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(x.sum(0))
        return torch.tanh(x) * scale

    x, state = torch.randn(3, 4), torch.randn(4)
    graph = kiln.trace(step, x, state)
    gm = kiln.to_fx(graph)
    constant = next(v for v in graph.inputs if v.kind is InputKind.CONSTANT)
    assert torch.equal(getattr(gm, constant.name), scale)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == 2
    output, new_state = gm(x, state)
    _same([output, new_state], [torch.tanh(x) * scale, state + x.sum(0)], exact=False)
    assert "kiln_tanh" in gm.code


def test_multi_output_nodes_use_getitem() -> None:
    x = torch.randn(5, 7)
    graph = kiln.trace(lambda x: torch.topk(x, 3, dim=1), x)
    gm = kiln.to_fx(graph)
    values, indices = gm(x)
    expected = torch.topk(x, 3, dim=1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).log_softmax(-1)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.head(nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        weights = (q @ k.transpose(-1, -2) / 8**0.5).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, 16)) + x


MODULES = {"mlp": (MLP, (4, 12)), "cnn": (CNN, (2, 3, 8, 8)), "attention": (Attention, (2, 6, 16))}


@pytest.mark.parametrize("name", list(MODULES))
def test_from_fx_of_symbolic_trace_matches_eager(name: str) -> None:
    make, shape = MODULES[name]
    torch.manual_seed(0)
    model = make()
    gm = torch.fx.symbolic_trace(model)
    graph = kiln.from_fx(gm, [torch.randn(shape)])
    assert not [n for n in graph.nodes if n.op is Op.EXTERN and "aten" in str(n.attrs.fn)]
    x = torch.randn(shape, requires_grad=True)
    got = kiln.run_traced(graph, gm, x)
    expected = model(x)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(x).sum().backward()
    for parameter_name, parameter in model.named_parameters():
        torch.testing.assert_close(gradients.pop(parameter_name), parameter.grad)


@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_from_fx_of_aten_graph_translates_aten_calls(name: str) -> None:
    make, shape = MODULES[name]
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(shape)
    gm = make_fx(model)(x)
    graph = kiln.from_fx(gm, [x])
    translated = [n for n in graph.nodes if n.op is not Op.EXTERN]
    assert any(n.origin.api == "torch.addmm" for n in translated), graph
    fresh = torch.randn(shape)
    torch.testing.assert_close(kiln.run_traced(graph, gm, fresh), model(fresh))


def test_random_graph_is_a_function_of_the_seed() -> None:
    x = torch.randn(64)
    graph = kiln.trace(lambda x: nn.functional.dropout(x, 0.5, training=True), x)
    gm = kiln.to_fx(graph)
    seed = torch.tensor(1234, dtype=torch.int64)
    inputs = [x if v.kind is InputKind.USER else seed for v in graph.inputs]
    assert any(Tag.RANDOM in op_def(n.op).tags for n in graph.nodes)
    _same(list(gm(*inputs)), interpret(graph, inputs))


def test_symbolic_graph_is_refused() -> None:
    graph = kiln.trace(torch.relu, torch.randn(3))
    graph.symbols = ("s0",)
    with pytest.raises(kiln.KilnError, match="specialize"):
        kiln.to_fx(graph)


def test_from_fx_of_a_dynamo_graph_on_its_example_inputs() -> None:
    captured: list[Graph] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graph = kiln.from_fx(gm, example_inputs)
        captured.append(graph)
        return lambda *args: kiln.run_traced(graph, gm, *args)  # real inputs, same order

    torch.manual_seed(0)
    model = MLP()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(4, 12))
    assert len(captured) == 1 and not [n for n in captured[0].nodes if n.op is Op.EXTERN]
    x = torch.randn(4, 12)
    torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()
