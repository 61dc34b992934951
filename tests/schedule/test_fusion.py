"""Fusion decisions of the scheduler: what becomes one kernel, what stays a view, what runs as
an extern; every program is also run (through the loop-level IR's evaluator) against the
reference interpreter."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir.interpreter import interpret
from kiln.ir.op import Op
from kiln.passes import optimize
from kiln.schedule.loops import Apply, Kernel, Load, Reduce, walk
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


def _in_place(program: Program) -> list[Kernel]:
    """The kernels that write over a buffer they read (``schedule/buffers.py``)."""
    return [
        kernel
        for kernel in program.kernels()
        if any(program.reuses.get(id(s.buffer)) in kernel.reads() for s in kernel.stores)
    ]


@pytest.mark.parametrize("codegen", ["evaluate", "cpp", "triton"])
def test_a_residual_writes_over_the_operand_that_dies_in_it(codegen: str) -> None:
    """ResNet's ``relu(conv(x) + identity)``: the matmul's fresh result dies in the add, which
    reads each element where it writes it, so the add writes over it (one buffer less at the
    peak); a second, transposed read or a reduction does not."""
    if codegen == "triton":
        pytest.importorskip("triton")

    def residual(x: torch.Tensor, w: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.tanh(x @ w) + identity) * 2

    def transposed(x: torch.Tensor, w: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        product = torch.tanh(x @ w)  # (read at two places per element: not in place)
        return torch.relu(product + product.t() + identity)

    def reduced(x: torch.Tensor, w: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.tanh(x @ w) + identity, -1)

    args = (torch.randn(24, 24), torch.randn(24, 24), torch.randn(24, 24))
    for fn, in_place in ((residual, True), (transposed, False), (reduced, False)):
        graph = optimize(kiln.trace(fn, *args))
        inputs = graph_inputs(graph, fn, *args)
        program = schedule(graph, inputs)
        assert bool(_in_place(program)) == in_place, fn.__name__
        for _ in range(2):  # (a second call: the program's buffers are taken again)
            got = run_compiled(graph, inputs, codegen)
            for value, want in zip(got, interpret(graph, inputs), strict=True):
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[0], fn(*args), rtol=1e-5, atol=1e-5)


def test_padding_and_flip_and_gather_are_index_arithmetic() -> None:
    def shuffle(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        padded = F.pad(x.flip(1), (2, 1))
        return torch.gather(padded, 1, i) * 2

    program = scheduled(shuffle, torch.randn(4, 5), torch.randint(0, 8, (4, 3)))
    assert len(program.kernels()) == 1 and not program.externs()


def _bn_relu_max_pool(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    y = torch.relu(x * scale[:, None, None] + shift[:, None, None])
    return F.max_pool2d(y, 3, stride=2, padding=1)


def test_max_pool_window_recomputes_its_cheap_producer_in_one_kernel(monkeypatch: Any) -> None:
    # The GPU budget: BatchNorm, ReLU and the 3x3 window (9 positions of the BatchNorm, each
    # step of the separable max read by the next at 3 positions) are one kernel, where they
    # were three with two stored intermediates. Values read by several nodes of one kernel at
    # one position are computed once, whatever they cost.
    import kiln.schedule.inlining as inlining

    monkeypatch.setattr(inlining, "STENCIL_LIMIT", (128, 128))
    args = (torch.randn(2, 4, 11, 12), torch.rand(4) + 0.5, torch.randn(4))
    (kernel,) = scheduled(_bn_relu_max_pool, *args).kernels()
    assert kernel.xnumel == 2 * 4 * 6 * 6


def test_max_pool_on_the_cpu_stores_what_costs_too_much_to_recompute_nine_times() -> None:
    # The CPU budget (32 ops an element): the BatchNorm and ReLU (read at 9 positions) are
    # stored once, the two max steps over them stay one kernel.
    args = (torch.randn(2, 4, 11, 12), torch.rand(4) + 0.5, torch.randn(4))
    kernels = scheduled(_bn_relu_max_pool, *args).kernels()
    assert len(kernels) == 2
    assert kernels[-1].xnumel == 2 * 4 * 6 * 6


def test_a_value_read_by_kernels_of_their_own_is_stored_once_it_costs_enough() -> None:
    # exp(x) * 2 + 1 feeds two reductions over different rows (two kernels): recomputing it
    # in both would redo the exponential; it is stored.
    def two_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(torch.exp(x) * 2 + 1) * 3 - 1
        return y.sum(0), y.sum(1)

    kernels = scheduled(two_sums, torch.randn(6, 10)).kernels()
    exps = [
        e
        for k in kernels
        for e in walk([s.value for s in k.stores])
        if isinstance(e, Apply) and e.op is Op.EXP
    ]
    assert len(kernels) == 2 and len(exps) == 1


def test_probed_extern_strides_are_what_the_call_returns() -> None:
    # On CUDA, attention and convolution layouts come from one real call (the kernel PyTorch
    # picks decides them); the probe itself works on any device.
    from kiln.schedule.layouts import probe_strides
    from kiln.schedule.loops import Buffer, BufferKind
    from kiln.schedule.program import View

    def q(x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x.transpose(2, 3).contiguous().transpose(2, 3), x)

    graph = kiln.trace(q, torch.randn(2, 3, 5, 8))
    (node,) = [n for n in graph.nodes if n.op is Op.SDPA]
    views = []
    for strides in ((120, 40, 8, 1), (120, 40, 1, 5), (120, 40, 8, 1)):
        buffer = Buffer(
            "b", (2, 3, 5, 8), torch.float32, torch.device("cpu"), BufferKind.INPUT, strides
        )
        views.append(View(buffer, buffer.shape, strides, 0))
    expected = F.scaled_dot_product_attention(
        *(torch.empty_strided(v.shape, v.strides) for v in views)
    ).stride()
    assert probe_strides(node, [*views, None]) == [expected]


def _mutated_program(fn: Callable[..., Any], *args: Any) -> Program:
    graph = optimize(kiln.trace(fn, *args))
    return schedule(graph, graph_inputs(graph, fn, *args))


def test_a_running_statistic_is_written_into_its_input() -> None:
    def update(stat: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        stat.mul_(0.9).add_(batch.mean(0), alpha=0.1)
        return batch * 2

    program = _mutated_program(update, torch.randn(6), torch.randn(4, 6))
    written = {id(s.buffer) for k in program.kernels() for s in k.stores}
    (stat_buffer,) = [b for b in program.inputs if b.shape == (6,)]
    assert id(stat_buffer) in written  # the new value is stored into the input itself
    assert program.outputs[-1].buffer is stat_buffer


def test_a_mutation_read_elsewhere_or_shifted_is_not_written_in_place() -> None:
    # The old value feeds a reduction (another kernel) or is read at other positions (flip)
    # in the kernel that writes it: writing in place would let readers see new values.
    def summed(x: torch.Tensor) -> torch.Tensor:
        total = x.sum()
        x.mul_(2)
        return total

    def flipped(x: torch.Tensor) -> torch.Tensor:
        x.add_(x.flip(0))
        return x.sum()

    for fn in (summed, flipped):
        program = _mutated_program(fn, torch.randn(8))
        written = {id(s.buffer) for k in program.kernels() for s in k.stores}
        assert not written & {id(b) for b in program.inputs}, fn.__name__


@pytest.mark.parametrize("codegen", ["cpp", "triton", "evaluate"])
def test_in_place_mutations_match_eager(codegen: str) -> None:
    def step(x: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
        stat.mul_(0.9).add_(x.mean(0), alpha=0.1)
        x.add_(x.flip(0))
        return x.sum(0) + stat

    x, stat = torch.randn(5, 7), torch.randn(7)
    x2, stat2 = x.clone(), stat.clone()
    compiled = kiln.compile(step, options={"codegen": codegen})
    for _ in range(3):
        got, want = compiled(x, stat), step(x2, stat2)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x, x2)
        torch.testing.assert_close(stat, stat2)


def _update_cache(cache: torch.Tensor, position: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(2, position, new)  # a static key-value cache's update
    return (cache * 2).sum(2)


def _read_then_update(cache: torch.Tensor, position: torch.Tensor, new: torch.Tensor) -> Any:
    before = cache.sum(2)  # reads the old value: the put must not write the input first
    cache.index_copy_(2, position, new)
    return before, cache.sum(2)


def test_an_index_copy_into_an_input_writes_it_in_place_when_nothing_reads_the_old_value() -> None:
    args = torch.randn(2, 3, 9, 4), torch.tensor([5]), torch.randn(2, 3, 1, 4)
    (put,) = [e for e in _mutated_program(_update_cache, *args).externs()]
    assert put.in_place and put.node.op is Op.INDEX_PUT
    (put,) = [e for e in _mutated_program(_read_then_update, *args).externs()]
    assert not put.in_place


@pytest.mark.parametrize("fn", [_update_cache, _read_then_update])
def test_an_in_place_index_copy_matches_eager(fn: Callable[..., Any]) -> None:
    compiled = kiln.compile(fn)
    cache = torch.randn(2, 3, 9, 4).transpose(1, 2).contiguous().transpose(1, 2)
    mine = cache.clone()
    for step in range(4):
        position, new = torch.tensor([step + 3]), torch.randn(2, 3, 1, 4)
        torch.testing.assert_close(compiled(mine, position, new), fn(cache, position, new))
        torch.testing.assert_close(mine, cache)
    assert kiln.counters.fallbacks == []


@pytest.mark.parametrize("fn", [_update_cache, _read_then_update])
def test_an_index_copy_raises_where_eager_does(fn: Callable[..., Any]) -> None:
    """index_copy's put runs as ``index_copy`` (``IndexPutAttrs.in_range``: eager raises for
    an index outside ``[0, size)``), in place or not: a negative position raises as eager's
    does (``index_put`` would wrap it and write the last row), and nothing is written."""
    compiled = kiln.compile(fn)
    cache, new = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 1, 4)
    mine = cache.clone()
    position = torch.tensor([4])
    torch.testing.assert_close(compiled(mine, position, new), fn(cache, position, new))
    torch.testing.assert_close(mine, cache)
    for outside in (-1, 9):
        with pytest.raises((RuntimeError, IndexError)):
            fn(cache.clone(), torch.tensor([outside]), new)
        with pytest.raises((RuntimeError, IndexError)):
            compiled(mine, torch.tensor([outside]), new)
    torch.testing.assert_close(mine, cache)


def test_a_value_two_kernels_read_is_recomputed_when_that_moves_no_more_data() -> None:
    # centered feeds sums over rows and over columns: two kernels. Reading one full-size
    # operand (x), recomputing it in the second kernel reads x instead of reading back a
    # stored copy, and saves the copy's write: nothing full-size is stored. With two
    # full-size operands (x and y), recomputing would read more than the copy: stored.
    def one(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        centered = (((x - m) * s * 3 + 1) * 2 - 1) * 5 + 2  # 8 ops
        return centered.sum(0), centered.sum(1)

    def two(x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        centered = (((x - m) * y * 3 + 1) * 2 - 1) * 5 + 2
        return centered.sum(0), centered.sum(1)

    x, y, m, s = torch.randn(6, 10), torch.randn(6, 10), torch.randn(10), torch.randn(10)
    for fn, args, stored in ((one, (x, m, s), 0), (two, (x, y, m), 1)):
        program = scheduled(fn, *args)
        assert len(program.kernels()) == 2, fn.__name__
        full = [st for k in program.kernels() for st in k.stores if st.buffer.shape == (6, 10)]
        assert len(full) == stored, fn.__name__


def test_a_cheap_value_reading_many_full_size_values_is_stored() -> None:
    # A residual stream x + a + b + c + d feeds two kernels (sums over rows and columns): four
    # adds are cheap, but recomputing the stream in the second kernel would read all five
    # full-size operands again. It is stored, and the second kernel reads it back.
    def stream(*branches: torch.Tensor) -> tuple[torch.Tensor, ...]:
        total = branches[0]
        for branch in branches[1:]:
            total = total + branch
        return total.sum(0), total.sum(1)

    program = scheduled(stream, *[torch.randn(6, 10) for _ in range(5)])
    loads = [
        {e.buffer for e in walk([s.value for s in k.stores]) if isinstance(e, Load)}
        for k in program.kernels()
    ]
    assert sorted(len(found) for found in loads) == [1, 5]


@pytest.mark.parametrize("codegen", ["triton", "cpp"])
def test_gpu_fusion_limits_compile_and_match_eager(codegen: str, monkeypatch: Any) -> None:
    # The GPU's budgets (BatchNorm + ReLU + max pool as one kernel; values read by several
    # kernels recomputed up to 128 ops) through the generators CI can run (Triton's
    # interpreter, C++), forward and backward, against eager.
    import kiln.schedule.inlining as inlining

    monkeypatch.setattr(inlining, "STENCIL_LIMIT", (128, 128))
    monkeypatch.setattr(inlining, "TRAFFIC_RECOMPUTE_LIMIT", (128, 128))
    torch.manual_seed(0)
    stem = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1),
        torch.nn.Conv2d(8, 4, 1),
    )
    x = torch.randn(2, 3, 9, 10)
    reference = copy.deepcopy(stem)
    compiled = kiln.compile(stem, options={"codegen": codegen})
    for run in (reference, compiled):
        run(x).square().mean().backward()
    for got, want in zip(stem.parameters(), reference.parameters(), strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    for got, want in zip(stem.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(got, want)


def test_max_pool_backward_does_not_recompute_the_forward_per_window(
    monkeypatch: Any, tmp_path: Any
) -> None:
    # The max pool's backward reads each of its 9 window masks through another padding, so
    # the BatchNorm + ReLU before it is read at about 100 positions an element: counted per
    # user (9), it was inlined, and ResNet-50's training step had one 70 ms kernel with 254
    # loads. Counted by route, it is stored once and the kernels stay small.
    import kiln.schedule.inlining as inlining
    from kiln.config import config

    monkeypatch.setattr(inlining, "STENCIL_LIMIT", (128, 128))
    monkeypatch.setattr(inlining, "TRAFFIC_RECOMPUTE_LIMIT", (128, 128))
    monkeypatch.setattr(config, "debug_dir", str(tmp_path))
    torch.manual_seed(0)
    stem = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 7, 2, 3, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(3, 2, 1),
        torch.nn.Conv2d(8, 8, 1, bias=False),
    )
    x = torch.randn(2, 3, 16, 16)
    reference = copy.deepcopy(stem)
    kiln.compile(stem, options={"codegen": "triton"})(x).square().mean().backward()
    reference(x).square().mean().backward()
    for got, want in zip(stem.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    sources = list((tmp_path / "triton").glob("*.py"))
    assert sources
    loads = {p.name: p.read_text().count("tl.load(") for p in sources}
    assert max(loads.values()) <= 64, loads


@pytest.mark.parametrize("codegen", ["cpp", "evaluate", "triton"])
def test_an_embedding_gradient_is_scattered_into_its_zeros_in_place(codegen: str) -> None:
    """A tied embedding's gradient (GPT-2's table, read by the lookup and the output
    projection): the backward scatters the looked-up rows' gradients into zeros a kernel
    stored, in place (PyTorch's out-of-place index_put copied the whole table first: 126 us
    a step on an H200). The zeros' memory is not reused while the scattered result lives,
    though a later temporary of the table's size dies beside it. Every gradient matches
    eager's over several calls."""
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.recording import listen, unlisten
    from kiln.schedule.loops import BufferKind

    if codegen == "triton":
        pytest.importorskip("triton")

    def tied(tokens: torch.Tensor, table: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(F.embedding(tokens, table))
        spare = (table * scale).sin()  # (a table-sized temporary dying after the scatter)
        return (hidden @ table.t()).logsumexp(-1).sum() + spare.cos().sum()

    records: list[Any] = []
    listen(records, CompiledProgramRecord)
    try:
        compiled = kiln.compile(tied, options={"codegen": codegen})
        for _ in range(3):
            tokens = torch.randint(0, 50, (4, 6))
            tokens[0, :2] = 7  # (a repeated row: the scatter accumulates)
            table, scale = torch.randn(50, 16), torch.rand(1) + 0.5
            mine = [t.clone().requires_grad_() for t in (table, scale)]
            theirs = [t.clone().requires_grad_() for t in (table, scale)]
            got = torch.autograd.grad(compiled(tokens, *mine), mine)
            want = torch.autograd.grad(tied(tokens, *theirs), theirs)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    finally:
        unlisten(records)
    backward = [r.program for r in records if r.graph.endswith("backward")][-1]
    (put,) = [e for e in backward.externs() if e.node.op is Op.INDEX_PUT]
    assert put.in_place and put.operands[0].buffer.kind is BufferKind.TEMP  # type: ignore[union-attr]
    assert kiln.counters.fallbacks == []


def test_an_in_place_extern_operand_is_not_reused_while_its_result_lives() -> None:
    """``plan_buffers``: a temporary an in-place index_put scatters into dies in that call,
    but its memory is the call's result; a later temporary of its size must not take it over
    (it would overwrite the result before the kernel reading both runs)."""
    from types import SimpleNamespace

    from kiln.schedule.buffers import plan_buffers
    from kiln.schedule.index import var
    from kiln.schedule.loops import Buffer, BufferKind, Store
    from kiln.schedule.program import ExternCall, View
    from tests.codegen.ir_builders import F32, apply, buffer, const, load

    x = var("x", 800)
    zeros, later, out = (buffer(name, (50, 16), F32) for name in ("zeros", "later", "out"))
    result = Buffer("scattered", (50, 16), F32, zeros.device, BufferKind.EXTERN)
    rows = buffer("rows", (4, 16), F32)
    whole = View(zeros, (50, 16), (16, 1), 0)
    put = ExternCall(SimpleNamespace(op=Op.INDEX_PUT), (whole,), (result,), in_place=True)  # type: ignore[arg-type]
    steps = [
        Kernel("k0_full", 800, 1, [Store(zeros, x, const(0.0))]),
        Kernel("k1_rows", 64, 1, [Store(rows, var("x", 64), const(1.0))]),
        put,
        Kernel("k2_later", 800, 1, [Store(later, x, load(result, x))]),
        Kernel("k3_out", 800, 1, [Store(out, x, apply(Op.ADD, load(later, x), load(result, x)))]),
    ]
    program = Program("p", [], steps, [View(out, (50, 16), (16, 1), 0)])  # type: ignore[arg-type]
    plan_buffers(program)
    assert program.reuses.get(id(later)) is not zeros
    put.in_place = False  # (an out-of-place call leaves the zeros free to reuse)
    program.reuses.clear()
    plan_buffers(program)
    assert program.reuses.get(id(later)) is zeros
