"""CPU host programs keep their internal temporaries from one call to the next
(``kiln/codegen/temp_pool.py``): which buffers are pooled, and that pooled memory never
reaches what a call returns, also across calls and threads."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.codegen import temp_pool
from kiln.codegen.temp_pool import TempPool, pooled_allocations
from kiln.codegen.wrapper import Wrapper
from kiln.ir.graph import Node
from kiln.ir.op import Op
from kiln.recording import listen, unlisten
from kiln.schedule.index import var
from kiln.schedule.loops import Buffer, BufferKind, Kernel, Store
from kiln.schedule.program import ExternCall, Program, Step, View
from tests.codegen.ir_builders import F32, apply, const, load

CPU = torch.device("cpu")


def temp(name: str, numel: int = 64, device: torch.device = CPU) -> Buffer:
    return Buffer(name, (numel,), F32, device, BufferKind.TEMP, (1,))


def copy_kernel(name: str, source: Buffer, target: Buffer) -> Kernel:
    x = var("x", target.numel)
    value = apply(Op.ADD, load(source, x), const(1.0))
    return Kernel(name, target.numel, 1, [Store(target, x, value)])


def whole(buffer: Buffer) -> View:
    return View(buffer, buffer.shape, buffer.strides, 0)


def program_of(steps: Sequence[Step], outputs: list[Buffer], source: Buffer) -> Program:
    return Program("p", [source], list(steps), [whole(b) for b in outputs])


def test_internal_allocations_are_pooled_outputs_are_not() -> None:
    """a -> b -> c (the output): a and b are pooled, c is not."""
    source = Buffer("x", (64,), F32, CPU, BufferKind.INPUT, (1,))
    a, b, c = temp("a"), temp("b"), temp("c")
    steps = [copy_kernel("k0", source, a), copy_kernel("k1", a, b), copy_kernel("k2", b, c)]
    assert pooled_allocations(program_of(steps, [c], source)) == [a, b]


def test_memory_taken_over_by_an_output_is_not_pooled() -> None:
    """c takes over a's memory after a's last reader: a's allocation reaches the output, so
    it is allocated per call; b stays pooled."""
    source = Buffer("x", (64,), F32, CPU, BufferKind.INPUT, (1,))
    a, b, c = temp("a"), temp("b"), temp("c")
    steps = [copy_kernel("k0", source, a), copy_kernel("k1", a, b), copy_kernel("k2", b, c)]
    program = program_of(steps, [c], source)
    program.reuses[id(c)] = a
    assert pooled_allocations(program) == [b]


def test_operands_of_an_extern_that_may_alias_are_not_pooled() -> None:
    """A generic extern may return a view of its operand: the operand's memory escapes.
    A matmul's operands do not."""
    source = Buffer("x", (8, 8), F32, CPU, BufferKind.INPUT, (8, 1))
    a = Buffer("a", (8, 8), F32, CPU, BufferKind.TEMP, (8, 1))
    b = Buffer("b", (8, 8), F32, CPU, BufferKind.TEMP, (8, 1))
    out = Buffer("out", (8, 8), F32, CPU, BufferKind.EXTERN, (8, 1))
    out2 = Buffer("out2", (8, 8), F32, CPU, BufferKind.EXTERN, (8, 1))
    steps: list[Step] = [copy_kernel("k0", source, a), copy_kernel("k1", a, b)]
    steps.append(ExternCall(Node(Op.EXTERN, (), None), (whole(a),), (out,)))
    steps.append(ExternCall(Node(Op.MM, (), None), (whole(b), whole(b)), (out2,)))
    program = Program("p", [source], steps, [whole(out), whole(out2)])
    assert pooled_allocations(program) == [b]


def test_gpu_buffers_and_the_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA buffers have PyTorch's caching allocator; past ``POOL_BYTES`` allocations are
    made per call."""
    source = Buffer("x", (64,), F32, CPU, BufferKind.INPUT, (1,))
    a, big, c = temp("a"), temp("big", 1024), temp("c")
    gpu = temp("gpu", device=torch.device("cuda"))
    steps = [
        copy_kernel("k0", source, a),
        copy_kernel("k1", a, big),
        copy_kernel("k2", a, gpu),
        copy_kernel("k3", a, c),
    ]
    monkeypatch.setattr(temp_pool, "POOL_BYTES", 64 * 4 + 100)  # a fits, big does not
    assert pooled_allocations(program_of(steps, [big, gpu, c], source)) == [a]
    monkeypatch.setattr(temp_pool, "POOL_BYTES", 64 * 4 + 4096)
    assert pooled_allocations(program_of(steps, [c], source)) == [a, big]


def test_pool_lends_one_set_at_a_time() -> None:
    """A second caller while the set is out gets fresh tensors; one set is kept."""
    pool = TempPool([temp_pool.Slot((4, 3), (1, 4), F32)])
    first = pool.take()
    assert first[0].stride() == (1, 4)
    second = pool.take()
    assert second[0].data_ptr() != first[0].data_ptr()
    pool.give(first)
    pool.give(second)
    assert pool.take()[0].data_ptr() == first[0].data_ptr()
    assert pool.take()[0].data_ptr() not in (first[0].data_ptr(), second[0].data_ptr())


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    hidden = torch.tanh(x * 2 + 1) @ w1
    return torch.softmax(torch.relu(hidden).exp() @ w2, dim=-1)


def test_compiled_results_never_share_pooled_memory() -> None:
    """A program with pooled temporaries: results of consecutive calls stay as returned (no
    later call writes into them), match eager, and so do concurrent calls from threads."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(48, 40) / 7, torch.randn(40, 24) / 6
    records: list[CompiledProgramRecord] = []
    listen(records, CompiledProgramRecord)
    try:
        compiled = kiln.compile(_mlp)
        inputs = [torch.randn(32, 48) for _ in range(6)]
        results = [compiled(x, w1, w2) for x in inputs]
        copies = [r.clone() for r in results]
        for x, result, kept in zip(inputs, results, copies, strict=True):
            torch.testing.assert_close(result, _mlp(x, w1, w2), rtol=1e-5, atol=1e-6)
            assert torch.equal(result, kept)
        program = next(r.program for r in records if r.program is not None)
        assert pooled_allocations(program), "the test needs a program with pooled temporaries"
        assert "temps = pool.take()" in Wrapper(program, {}).source()
        outcomes: dict[int, torch.Tensor] = {}

        def work(index: int) -> None:
            for _ in range(20):
                outcomes[index] = compiled(inputs[index], w1, w2)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for index, result in outcomes.items():
            torch.testing.assert_close(result, _mlp(inputs[index], w1, w2), rtol=1e-5, atol=1e-6)
    finally:
        unlisten(records)
        kiln.reset()
