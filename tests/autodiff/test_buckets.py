"""Training graphs split at DDP's gradient buckets (``kiln/autodiff/buckets.py``), in one
process: where the cuts fall, and a split graph trains exactly like the whole one, its backward
in one autograd node per piece. (The two-process DDP tests are in ``tests/distributed``.)"""

from __future__ import annotations

import types

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import kiln
from kiln.autodiff.buckets import bucket_cuts, split
from kiln.ir.graph import InputKind


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip


LAYER_BYTES = (32 * 4 + 4) * 4  # the last layer's weight and bias: the smallest bucket


def test_cuts_fall_before_each_buckets_first_reader() -> None:
    graph = kiln.trace(mlp(), torch.randn(2, 8))
    cuts = bucket_cuts(graph, LAYER_BYTES)
    assert len(cuts) == 2, cuts
    for cut in cuts:
        read = {v.source for v in graph.nodes[cut].input_values() if v.kind is InputKind.PARAMETER}
        assert read, f"cut {cut} is before {graph.nodes[cut].op.name}, which reads no parameter"
    assert bucket_cuts(graph, 10**9) == []
    pieces = split(graph, cuts)
    assert sum(len(p.graph.nodes) for p in pieces) == len(graph.nodes)
    assert pieces[-1].writes == graph.outputs


class _ActiveDDP:
    """DDP marks itself active around its module's forward; a stand-in with a bucket size."""

    def __init__(self, bucket_bytes: int) -> None:
        self.module = types.SimpleNamespace(bucket_bytes_cap=bucket_bytes)

    def __enter__(self) -> None:
        DDP._active_ddp_module = self.module  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        DDP._active_ddp_module = None


def _backward_nodes(root: torch.autograd.graph.Node) -> int:
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_ for next_, _ in node.next_functions)
    return sum(type(node).__name__ == "_FunctionBackward" for node in seen)


@pytest.mark.parametrize(("bucket_bytes", "pieces"), [(LAYER_BYTES, 3), (10**9, 1)])
def test_split_graph_trains_like_eager(bucket_bytes: int, pieces: int) -> None:
    model = mlp()
    compiled = kiln.compile(mlp())
    compiled.load_state_dict(model.state_dict())
    kiln.reset()
    for _ in range(2):
        x = torch.randn(5, 8)
        with _ActiveDDP(bucket_bytes):
            loss = compiled(x).square().mean()
        expected = model(x).square().mean()
        assert _backward_nodes(loss.grad_fn) == pieces
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected)
        for p, q in zip(compiled.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    assert kiln.counters.graphs == 1 and kiln.counters.fallbacks == []
