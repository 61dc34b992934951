"""CSE and DCE keep what a graph computes, and remove only repeated or unused work."""

from __future__ import annotations

import torch

import kiln.ops  # noqa: F401  (registers rows)
from kiln.ir import Graph, GraphBuilder, Op, TensorType, interpret, verify
from kiln.ops import prims
from kiln.passes import eliminate_common_subexpressions, eliminate_dead_code, optimize


def _graph() -> Graph:
    graph = Graph(name="g")
    with GraphBuilder(graph):
        x = graph.add_input(TensorType((4,), torch.float32), name="x")
        y = graph.add_input(TensorType((4,), torch.float32), name="y")
        a = prims.mul(x, y)
        b = prims.mul(x, y)  # repeats a
        c = prims.mul(x, 2.0)
        d = prims.mul(x, 3.0)  # differs from c by a scalar: kept
        prims.exp(x)  # unused
        seed = graph.add_input(TensorType((), torch.int64), name="seed")
        r1 = prims.call(
            Op.RANDOM_UNIFORM,
            seed,
            shape=(4,),
            dtype=torch.float32,
            device=torch.device("cpu"),
            offset=0,
        )
        r2 = prims.call(
            Op.RANDOM_UNIFORM,
            seed,
            shape=(4,),
            dtype=torch.float32,
            device=torch.device("cpu"),
            offset=4,
        )
        graph.outputs = [prims.add(a, b), c, d, r1, r2]
    return verify(graph)


def test_optimized_graph_computes_the_same() -> None:
    inputs = [torch.randn(4), torch.randn(4), torch.tensor(5)]
    expected = interpret(_graph(), inputs)
    optimized = verify(optimize(_graph()))
    for got, want in zip(interpret(optimized, inputs), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_cse_merges_repeats_only() -> None:
    graph = verify(eliminate_common_subexpressions(_graph()))
    ops = [node.op for node in graph.nodes]
    assert ops.count(Op.MUL) == 3  # x*y once, x*2 and x*3 kept apart
    assert ops.count(Op.RANDOM_UNIFORM) == 2  # different offsets: different numbers
    added = next(node for node in graph.nodes if node.op is Op.ADD)
    assert added.inputs[0] is added.inputs[1]


def test_dce_drops_unused_nodes() -> None:
    graph = verify(eliminate_dead_code(_graph()))
    assert Op.EXP not in [node.op for node in graph.nodes]


def test_mutations_keep_their_producers() -> None:
    graph = Graph(name="m")
    with GraphBuilder(graph):
        x = graph.add_input(TensorType((3,), torch.float32), name="x")
        updated = prims.add(x, 1.0)
        graph.mutations = [(x, updated)]
        graph.outputs = [prims.mul(x, 2.0)]
    graph = verify(optimize(verify(graph)))
    assert [node.op for node in graph.nodes] == [Op.ADD, Op.MUL]
