"""The IR: printing (golden files), the verifier, hashing, the interpreter and mutations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import kiln
from kiln.errors import VerificationError
from kiln.ir import (
    Graph,
    GraphBuilder,
    InputKind,
    TensorType,
    format_graph,
    graph_hash,
    interpret,
    load_printed,
    verify,
)
from kiln.ops import prims

GOLDEN = Path(__file__).parent / "golden"


def bias_relu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (x + b).relu() * 2


def softmax_rows(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.fc(x)))


PROGRAMS = {
    "bias_relu": (bias_relu, lambda: (torch.randn(2, 3), torch.randn(3))),
    "softmax_rows": (softmax_rows, lambda: (torch.randn(2, 5),)),
    "mlp": (Mlp(), lambda: (torch.randn(2, 4),)),
    "batchnorm_train": (nn.BatchNorm1d(3).train(), lambda: (torch.randn(4, 3),)),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_printed_graph_matches_golden_and_runs(name: str, golden) -> None:  # type: ignore[no-untyped-def]
    program, make_inputs = PROGRAMS[name]
    inputs = make_inputs()
    graph = kiln.trace(program, *inputs)
    text = format_graph(graph)
    golden(GOLDEN / f"{name}.py.txt", text)
    tensors = kiln.frontends.graph_inputs(graph, program, *inputs)
    printed = load_printed(graph)(*tensors)
    for a, b in zip(printed, interpret(graph, tensors), strict=True):
        torch.testing.assert_close(a, b)


def test_batchnorm_train_records_buffer_mutations() -> None:
    module = nn.BatchNorm1d(3).train()
    reference = nn.BatchNorm1d(3).train()
    x = torch.randn(8, 3) * 3 + 1
    graph = kiln.trace(module, x)
    mutated = {target.source for target, _ in graph.mutations}
    assert mutated == {"running_mean", "running_var", "num_batches_tracked"}
    out = kiln.run_traced(graph, module, x)
    torch.testing.assert_close(out, reference(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(module, name), getattr(reference, name))


def _small_graph() -> Graph:
    graph = Graph(name="g")
    with GraphBuilder(graph):
        x = graph.add_input(TensorType((2, 3), torch.float32), name="x")
        y = graph.add_input(TensorType((2, 3), torch.float32), name="y", kind=InputKind.PARAMETER)
        graph.outputs = [prims.exp(prims.add(x, y))]
    return graph


def test_hash_ignores_names_and_origins_but_not_structure() -> None:
    first, second = _small_graph(), _small_graph()
    second.inputs[0].name = "renamed"
    assert graph_hash(first) == graph_hash(second)
    third = _small_graph()
    third.nodes[1].op = kiln.ir.Op.SIN
    assert graph_hash(first) != graph_hash(third)


def test_verifier_rejects_use_before_definition() -> None:
    graph = _small_graph()
    graph.nodes.reverse()
    with pytest.raises(VerificationError, match="used before it is defined"):
        verify(graph)


def test_verifier_rejects_wrong_recorded_type() -> None:
    graph = _small_graph()
    graph.nodes[0].outputs[0].type = TensorType((3, 3), torch.float32)
    with pytest.raises(VerificationError, match="meta gives"):
        verify(graph)


def test_verifier_rejects_undefined_output() -> None:
    graph = _small_graph()
    graph.outputs.append(_small_graph().inputs[0])
    with pytest.raises(VerificationError, match="not defined"):
        verify(graph)


def test_prims_reject_mismatched_shapes_with_runtime_error() -> None:
    graph = Graph()
    with GraphBuilder(graph):
        x = graph.add_input(TensorType((2, 3), torch.float32))
        y = graph.add_input(TensorType((3, 3), torch.float32))
        with pytest.raises(RuntimeError, match="add"):
            prims.add(x, y)


def test_printed_graph_text() -> None:
    text = format_graph(_small_graph(), origins=False)
    assert "t0 = add(x, y)" in text and "t1 = exp(t0)" in text
    assert 'def g(x: "f32[2, 3]", y: "f32[2, 3]"):' in text
