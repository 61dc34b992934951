"""Fusion decisions of the scheduler: what becomes one kernel, what stays a view, what runs as
an extern; every program is also run (through the loop-level IR's evaluator) against the
reference interpreter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir.interpreter import interpret
from kiln.passes import optimize
from kiln.schedule.loops import Kernel, Reduce, walk
from kiln.schedule.program import Program
from kiln.schedule.scheduler import schedule
from tests.backends.op_table import run_compiled


def scheduled(fn: Callable[..., Any], *args: Any) -> Program:
    graph = optimize(kiln.trace(fn, *args))
    inputs = graph_inputs(graph, fn, *args)
    program = schedule(graph, inputs)
    for got, want in zip(
        run_compiled(graph, inputs, "evaluate"), interpret(graph, inputs), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return program


def reductions(kernel: Kernel) -> int:
    return sum(isinstance(e, Reduce) for e in walk([s.value for s in kernel.stores]))


def test_pointwise_chain_is_one_kernel() -> None:
    program = scheduled(
        lambda x, b, y: F.gelu(x + b) + y, torch.randn(8, 16), torch.randn(16), torch.randn(8, 16)
    )
    (kernel,) = program.kernels()
    assert kernel.rnumel == 1 and len(kernel.stores) == 1
    assert not program.externs()


def test_softmax_is_one_kernel_with_two_reductions() -> None:
    program = scheduled(lambda x: torch.softmax(x, -1), torch.randn(6, 20))
    (kernel,) = program.kernels()
    assert (kernel.xnumel, kernel.rnumel) == (6, 20)
    assert reductions(kernel) == 2 and len(kernel.stores) == 1  # the max and sum stay inside


def test_layer_norm_with_statistics_is_one_kernel() -> None:
    def layer_norm_stats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
        return (x - mean) * rstd, mean, rstd

    program = scheduled(layer_norm_stats, torch.randn(5, 32))
    (kernel,) = program.kernels()
    assert len(kernel.stores) == 3  # normalized rows plus the two per-row statistics


def test_cross_entropy_rows_fuse() -> None:
    program = scheduled(
        lambda x, t: F.cross_entropy(x, t), torch.randn(8, 33), torch.randint(0, 33, (8,))
    )
    row_kernels = [k for k in program.kernels() if k.rnumel == 33]
    assert len(row_kernels) == 1


def test_cross_entropy_per_row_losses_are_the_row_kernels_epilogue() -> None:
    """The target gather and each row's loss run in the row kernel (one stored value per
    row); the mean is one more kernel, whose sum and count share it though they read
    different inputs (it is small), and it reads no logits."""
    logits = torch.randn(64, 33)
    program = scheduled(lambda x, t: F.cross_entropy(x, t), logits, torch.randint(0, 33, (64,)))
    rows, mean = program.kernels()
    assert (rows.xnumel, rows.rnumel, mean.xnumel, mean.rnumel) == (64, 33, 1, 64)
    assert any(store.buffer.shape == (64,) for store in rows.stores)
    assert reductions(mean) == 2
    loaded = {e.buffer.shape for e in walk([s.value for s in mean.stores]) if hasattr(e, "buffer")}
    assert (64, 33) not in loaded


def test_views_of_inputs_cost_nothing() -> None:
    program = scheduled(lambda x: x.t()[1:].unsqueeze(0), torch.randn(4, 6))
    assert not program.steps
    (output,) = program.outputs
    assert output.buffer is program.inputs[0]
    assert output.strides == (0, 1, 6) or output.strides[1:] == (1, 6)


def test_matmul_takes_the_transposed_weight_without_a_copy() -> None:
    program = scheduled(lambda x, w: x @ w.t(), torch.randn(4, 8), torch.randn(16, 8))
    assert not program.kernels()
    (call,) = program.externs()
    weight = call.operands[1]
    assert weight.buffer is program.inputs[1] and weight.strides == (1, 8)


def test_independent_outputs_reading_one_input_share_a_kernel() -> None:
    program = scheduled(lambda x: (x + 1, x * 2, x.exp()), torch.randn(64))
    (kernel,) = program.kernels()
    assert len(kernel.stores) == 3


def test_cat_is_written_by_its_producers() -> None:
    program = scheduled(
        lambda x, y: torch.cat([x + 1, y * 2], 1), torch.randn(3, 4), torch.randn(3, 5)
    )
    (kernel,) = program.kernels()
    assert len(kernel.stores) == 1


def test_reduction_epilogue_and_prologue_fuse() -> None:
    program = scheduled(lambda x: torch.sqrt((x * x).sum(1) + 1.0), torch.randn(7, 9))
    (kernel,) = program.kernels()
    assert reductions(kernel) == 1


def test_dead_buffers_are_reused() -> None:
    def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.relu(x @ w) + 1
        return x

    program = scheduled(chain, torch.randn(16, 16), torch.randn(16, 16))
    assert program.reuses, "a later kernel should take over a dead buffer"


def test_padding_and_flip_and_gather_are_index_arithmetic() -> None:
    def shuffle(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        padded = F.pad(x.flip(1), (2, 1))
        return torch.gather(padded, 1, i) * 2

    program = scheduled(shuffle, torch.randn(4, 5), torch.randint(0, 8, (4, 3)))
    assert len(program.kernels()) == 1 and not program.externs()
