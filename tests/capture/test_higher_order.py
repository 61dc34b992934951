"""Torch functions that take user functions: ``torch.utils.checkpoint``, ``torch.cond`` and the
``torch.func`` transforms inside compiled code.

Checkpointed functions are inlined: their parameters are guarded graph inputs (a reassigned
parameter is seen) and get gradients; their nodes are recomputed in the backward, never saved.
``torch.cond`` on a tensor and the ``torch.func`` transforms break the graph cleanly, with no
frame run uncompiled.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpointing
from torch import nn

import kiln
from kiln.autodiff.runtime import TrainingGraph
from kiln.capture.driver.convert import GraphRunner


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))) + x


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.reentrant = reentrant
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpointing.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _compare(eager: nn.Module, mine: nn.Module, compiled: Any, x: torch.Tensor) -> None:
    x_mine = x.detach().clone().requires_grad_(x.requires_grad)
    expected, actual = eager(x).square().sum(), compiled(x_mine).square().sum()
    torch.testing.assert_close(actual, expected)
    assert actual.requires_grad == expected.requires_grad
    if expected.requires_grad:
        expected.backward()
        actual.backward()
    for (name, p), q in zip(eager.named_parameters(), mine.parameters(), strict=True):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
        p.grad = q.grad = None
    if x.requires_grad:
        torch.testing.assert_close(x_mine.grad, x.grad)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_checkpointed_blocks_train_like_eager(reentrant: bool, input_requires_grad: bool) -> None:
    """Reentrant checkpointing with no input requiring grad gives no parameter gradients in
    eager; every other case gives every gradient. Then parameters are reassigned."""
    kiln.reset()
    eager = Checkpointed(reentrant)
    mine = copy.deepcopy(eager)
    compiled = kiln.compile(mine)
    for batch in (2, 2, 3):
        _compare(eager, mine, compiled, torch.randn(batch, 8, requires_grad=input_requires_grad))
    for model in (eager, mine):  # new Parameter objects, same values in both
        torch.manual_seed(7)
        model.head.weight = nn.Parameter(torch.randn(2, 8))
        model.blocks[0].first.weight = nn.Parameter(torch.randn(8, 8))
    _compare(eager, mine, compiled, torch.randn(2, 8, requires_grad=input_requires_grad))
    assert kiln.counters.fallbacks == []
    assert kiln.counters.graph_breaks == []


def test_checkpointed_work_is_recomputed_not_saved() -> None:
    """The backward recomputes the checkpointed matmuls: nothing inside the region is kept."""

    def program(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        def region(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(t @ w1) @ w2

        return checkpointing.checkpoint(region, x, use_reentrant=False).sum()

    kiln.reset()
    compiled = kiln.compile(program)
    x = torch.randn(4, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    compiled(x, w1, w2).backward()
    head = compiled._kiln_cache.entries[0].head
    graph = next(v for v in head.__globals__.values() if isinstance(v, GraphRunner)).compiled
    assert isinstance(graph, TrainingGraph)
    inputs = {value.name for value in graph.plan.forward.inputs}
    assert set(graph.saved_names) <= inputs, graph.saved_names  # only the region's inputs
    grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    program(x, w1, w2).backward()
    for got, t in zip(grads, (x, w1, w2), strict=True):
        torch.testing.assert_close(got, t.grad)


def test_checkpoint_sequential() -> None:
    def program(x: torch.Tensor, layers: nn.Sequential) -> torch.Tensor:
        return checkpointing.checkpoint_sequential(layers, 2, x, use_reentrant=False)

    kiln.reset()
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    mine = copy.deepcopy(layers)
    compiled = kiln.compile(program)
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        expected, actual = program(x, layers), compiled(x, mine)
        torch.testing.assert_close(actual, expected)
        expected.sum().backward()
        actual.sum().backward()
        for p, q in zip(layers.parameters(), mine.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)
    assert kiln.counters.fallbacks == []


def test_cond_on_a_tensor_runs_the_chosen_branch_compiled() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t.cos() - 1, (x,)) + 1

    kiln.reset()
    compiled = kiln.compile(program)
    for sign in (1, -1, 1, -1):
        x = sign * torch.rand(4)
        torch.testing.assert_close(compiled(x), program(x))
    assert kiln.counters.fallbacks == []
    assert [r.reason for r in kiln.counters.graph_breaks] == [kiln.BreakReason.DATA_DEPENDENT]
    assert kiln.counters.graphs == 4  # the predicate, each branch, the code after


def test_cond_on_a_python_bool_inlines_the_branch() -> None:
    def program(x: torch.Tensor, flag: bool) -> torch.Tensor:
        return torch.cond(flag, lambda t: t * 2, lambda t: t - 1, (x,))

    kiln.reset()
    compiled = kiln.compile(program)
    x = torch.randn(4)
    for flag in (True, False):
        torch.testing.assert_close(compiled(x, flag), program(x, flag))
    assert kiln.counters.graph_breaks == []
    assert kiln.counters.fallbacks == []


def _vmapped(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    scale = y.sum()
    return torch.func.vmap(lambda row: row * scale)(x * 2) + 1


def _jacobian(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.func.jacrev(lambda a: (a.sin() * y[0]).sum())(x * 2) + 1


def _gradient(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.func.grad(lambda a: (a**2 * y[0]).sum())(x) * 3


def _vjp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out, pullback = torch.func.vjp(torch.sin, x * y[0])
    return pullback(torch.ones_like(out))[0] + out


@pytest.mark.parametrize("program", [_vmapped, _jacobian, _gradient, _vjp])
def test_func_transforms_break_cleanly(program: Any) -> None:
    kiln.reset()
    compiled = kiln.compile(program)
    for size in (3, 3, 5):
        x, y = torch.randn(size, 4) if program is _vmapped else torch.randn(size), torch.randn(2)
        torch.testing.assert_close(compiled(x, y), program(x, y))
    assert kiln.counters.fallbacks == []
    reasons = {record.reason for record in kiln.counters.graph_breaks}
    assert reasons == {kiln.BreakReason.UNSUPPORTED_CALL}, kiln.counters.graph_breaks
