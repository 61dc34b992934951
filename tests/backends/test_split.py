"""The backend partitioner (``kiln/backends/split.py``): a backend that supports elementwise
ops only gets the elementwise subgraphs; the default backend runs the rest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kiln
from kiln.backends import BackendRecord, Capabilities, registry
from kiln.ir import Op, Tag, interpret, op_def
from kiln.recording import recording

# Elementwise ops and broadcasting (which translations put before binary ops).
ELEMENTWISE = frozenset(op for op in Op if Tag.ELEMENTWISE in op_def(op).tags) | {Op.BROADCAST}
NAME = "elementwise-only"


@pytest.fixture
def compiled_graphs() -> Iterator[list[kiln.Graph]]:
    """Registers the elementwise-only backend; yields the graphs it was given."""
    graphs: list[kiln.Graph] = []

    def compile_fn(graph: kiln.Graph, example_inputs: list[torch.Tensor]) -> Any:
        assert all(node.op in ELEMENTWISE for node in graph.nodes)
        graphs.append(graph)
        return lambda inputs: interpret(graph, inputs)

    capabilities = Capabilities(ops=ELEMENTWISE, dtypes=frozenset({torch.float32, torch.bool}))
    kiln.register_backend(NAME, compile_fn, capabilities=capabilities)
    yield graphs
    registry._BACKENDS.pop(NAME)


def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (torch.sin(x) * 2 + 1) @ w
    return torch.tanh(h.sum(-1)) * x.mean()


def test_elementwise_backend_gets_the_elementwise_parts(compiled_graphs: list[Any]) -> None:
    kiln.reset()
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    compiled = kiln.compile(program, backend=NAME, options={"codegen": "evaluate"})
    with recording(BackendRecord) as records:
        torch.testing.assert_close(compiled(x, w), program(x, w))
    assert len(records) == 1 and records[0].pieces == [NAME, "kiln", NAME]
    assert records[0].ops_on[NAME] >= 4 and records[0].ops_on["kiln"] >= 2
    ops = [[node.op for node in graph.nodes] for graph in compiled_graphs]
    assert ops[0][:3] == [Op.SIN, Op.MUL, Op.ADD] and Op.TANH in ops[1], ops
    assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks


def test_explain_shows_the_split_and_why_ops_were_left_out(compiled_graphs: list[Any]) -> None:
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    compiled = kiln.compile(program, backend=NAME, options={"codegen": "evaluate"})
    report = kiln.explain(compiled, x, w)
    text = "\n".join(report.backends)
    assert f"part 0 on {NAME}" in text and "part 1 on kiln" in text and f"part 2 on {NAME}" in text
    assert "left out: " in text and "mm(" in text and "op mm not supported" in text
    assert "op sum not supported" in text and "test_split.py:" in text  # the user's line
    assert "backends:" in str(report)


def test_dtype_not_supported_is_left_out(compiled_graphs: list[Any]) -> None:
    def halves(x: torch.Tensor) -> torch.Tensor:
        return (x.half() * 3).float() + 1

    x = torch.randn(6)
    compiled = kiln.compile(halves, backend=NAME, options={"codegen": "evaluate"})
    report = kiln.explain(compiled, x)
    assert "dtype float16 not supported" in "\n".join(report.backends), report
    torch.testing.assert_close(compiled(x), halves(x))


def test_training_splits_forward_and_backward(compiled_graphs: list[Any]) -> None:
    kiln.reset()
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    x_eager, w_eager = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    compiled = kiln.compile(program, backend=NAME, options={"codegen": "evaluate"})
    with recording(BackendRecord) as records:
        out = compiled(x, w)
        out.backward(torch.ones_like(out))
    expected = program(x_eager, w_eager)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x_eager.grad)
    torch.testing.assert_close(w.grad, w_eager.grad)
    assert len(records) == 2  # the forward graph and the backward graph, each split
    assert all(NAME in r.pieces and "kiln" in r.pieces for r in records), records


def test_work_no_earlier_part_needs_joins_its_readers_part(compiled_graphs: list[Any]) -> None:
    """``exp`` and ``add`` could run before the sum, but run after it, with the ``mul`` that
    reads them: two parts, not three."""

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return (x.exp() + 1) * x.sum()

    x = torch.randn(7)
    compiled = kiln.compile(scaled, backend=NAME, options={"codegen": "evaluate"})
    with recording(BackendRecord) as records:
        torch.testing.assert_close(compiled(x), scaled(x))
    assert records[0].pieces == ["kiln", NAME], records
    assert [node.op for node in compiled_graphs[-1].nodes] == [
        Op.EXP,
        Op.ADD,
        Op.BROADCAST,
        Op.MUL,
    ]
