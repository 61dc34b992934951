"""Independent kernels launched together (kiln/schedule/combine.py): which kernels combine,
and that a combined launch computes every part, through each executor, with several
programs per part in Triton's interpreter."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.backends.kiln import CompiledProgramRecord, KilnProgram
from kiln.codegen.signatures import kernel_signature
from kiln.codegen.triton import generate_triton
from kiln.frontends.trace import graph_inputs
from kiln.options import Options
from kiln.passes import optimize
from kiln.recording import listen, unlisten
from kiln.schedule.loops import BufferKind, Load, format_kernel, walk
from kiln.schedule.program import Program
from kiln.schedule.scheduler import schedule


def program_of(fn: Callable[..., Any], *args: torch.Tensor) -> tuple[Program, Any]:
    graph = optimize(kiln.trace(fn, *args))
    return schedule(graph, graph_inputs(graph, fn, *args)), graph


def matches_eager(
    fn: Callable[..., Any],
    graph: Any,
    shapes: list[tuple[int, ...]],
    codegen: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One compiled program through ``codegen``, called twice on fresh random inputs of
    ``shapes``; every output compared with ``fn`` run eagerly."""
    compiled = KilnProgram(graph, Options(codegen=codegen, strict=True))
    for _ in range(2):
        args = [torch.randn(shape) for shape in shapes]
        got = compiled(graph_inputs(graph, fn, *args))
        for mine, theirs in zip(got, fn(*args), strict=True):
            torch.testing.assert_close(mine, theirs)


def relu_and_cast(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first kernel reads x; the second only the input w: they combine."""
    return (x * 3).relu(), (w * 2 + 1).to(torch.float64)


def dependent(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second kernel reads what the first one writes (through a sum): not combined."""
    y = (x * 3).relu()
    return y, y.sum(1, keepdim=True) * w


def test_a_kernel_reading_only_inputs_joins_the_launch_before() -> None:
    program, _ = program_of(relu_and_cast, torch.randn(300, 70), torch.randn(130, 90))
    (kernel,) = program.kernels()
    (part,) = kernel.parts
    assert all(b.kind is BufferKind.INPUT for b in part.reads())
    assert set(map(id, part.writes())) <= set(map(id, kernel.writes()))
    assert "and, in the same launch:" in format_kernel(kernel)
    assert "and, in the same launch:" in kernel_signature(kernel)


def test_dependent_kernels_stay_apart() -> None:
    program, _ = program_of(dependent, torch.randn(300, 70), torch.randn(300, 1))
    assert all(not k.parts for k in program.kernels())


def test_eval_conv_batchnorm_weights_fold_in_one_launch_per_convolution() -> None:
    """The folded weight and bias of each convolution (they read only parameters) run in the
    launch of the kernel before it: one launch a convolution."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8)
    ).eval()
    with torch.no_grad():
        records: list[Any] = []
        listen(records, CompiledProgramRecord)
        try:
            x = torch.randn(2, 3, 12, 12)
            torch.testing.assert_close(kiln.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
        finally:
            unlisten(records)
    (record,) = records
    # The last convolution runs channels-last; its result goes back NCHW, as eager's (a copy).
    *folding, copy = record.program.kernels()
    assert len(folding) == 2 and all(k.parts for k in folding)
    assert any("eager_layout" in fused for fused in copy.fused), copy.fused


@pytest.mark.parametrize("codegen", ["evaluate", "cpp", "triton"])
def test_combined_launches_match_eager(codegen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """21000 and 11700 elements: several programs each in the interpreter (8192 a block)."""
    program, graph = program_of(relu_and_cast, torch.randn(300, 70), torch.randn(130, 90))
    assert any(k.parts for k in program.kernels())
    matches_eager(relu_and_cast, graph, [(300, 70), (130, 90)], codegen, monkeypatch)


def test_the_triton_launch_gives_each_part_its_programs() -> None:
    program, _ = program_of(relu_and_cast, torch.randn(300, 70), torch.randn(130, 90))
    (kernel,) = program.kernels()
    source = generate_triton(kernel, interpret=True)
    assert source.grid == (3 + 2, 1, 1)  # 21000 / 8192 and 11700 / 8192, rounded up
    text = source.source
    assert "    pid = tl.program_id(0)\n    if pid < 3:" in text
    assert "    else:\n" in text and "pid - 3, 8192)" in text
    assert f"def {kernel.name}_main(" in text


def softmax_and_cast(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reduction kernel (softmax rows) with a pointwise part."""
    return x.softmax(1) * 3, w * 2 + 1


@pytest.mark.parametrize("codegen", ["cpp", "triton"])
def test_a_reduction_kernel_launches_its_part(
    codegen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """700 rows of 300: 22 programs of 32 rows in the interpreter, then the part's 2."""
    args = (torch.randn(700, 300), torch.randn(90, 130))
    program, graph = program_of(softmax_and_cast, *args)
    (kernel,) = program.kernels()
    assert kernel.rnumel == 300 and len(kernel.parts) == 1
    matches_eager(softmax_and_cast, graph, [(700, 300), (90, 130)], codegen, monkeypatch)


def cast_after_matmul(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> Any:
    """The first kernel, ``v * 2 + 1``, reads only an input but follows an extern (it starts
    the program after the matmul): it joins the next kernel's launch instead."""
    y = x @ w
    return (v * 2 + 1).to(torch.float64), (y * 3).relu()


def feeds_the_matmul(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> Any:
    """``w * 2`` reads only an input but the matmul reads it: it stays before the matmul."""
    return ((x @ (w * 2)) * 3).relu(), v + 1


@pytest.mark.parametrize("codegen", ["evaluate", "cpp"])
def test_an_input_only_kernel_after_an_extern_joins_a_later_launch(
    codegen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes = [(40, 30), (30, 20), (50, 60)]
    program, graph = program_of(cast_after_matmul, *(torch.randn(s) for s in shapes))
    (kernel,) = program.kernels()
    (part,) = kernel.parts  # (either may lead: the epilogue reads only what ran before both)
    reads = [[e.buffer for e in walk([s.value for s in k.stores]) if isinstance(e, Load)]
             for k in (kernel, part)]  # fmt: skip
    assert any(all(b.kind is BufferKind.INPUT for b in own) for own in reads)
    matches_eager(cast_after_matmul, graph, shapes, codegen, monkeypatch)
    program, graph = program_of(feeds_the_matmul, *(torch.randn(s) for s in shapes))
    first = program.steps[0]
    assert first in program.kernels() and not first.parts  # type: ignore[union-attr]
    matches_eager(feeds_the_matmul, graph, shapes, codegen, monkeypatch)


def test_batchnorm_counters_join_a_launch_in_training() -> None:
    """``num_batches_tracked += 1`` of each training BatchNorm (an input-only kernel that
    starts the program) runs in another kernel's launch, and still counts every step."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8))
    eager = copy.deepcopy(model)
    records: list[Any] = []
    listen(records, CompiledProgramRecord)
    try:
        compiled = kiln.compile(model)
        for _ in range(3):
            x = torch.randn(2, 3, 10, 10)
            g = torch.randn(2, 8, 8, 8)  # (a plain sum's exact weight gradients are zero)
            (compiled(x) * g).sum().backward()
            (eager(x) * g).sum().backward()
    finally:
        unlisten(records)
    for (name, mine), (_, theirs) in zip(
        model.named_parameters(), eager.named_parameters(), strict=True
    ):
        # (the convolution's bias has an exact gradient of zero under BatchNorm: eager's and
        # Kiln's are both about 1e-5 of rounding)
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-4, msg=name)
    forward = records[0].program
    assert not any(k.name.endswith("_add") and not k.parts for k in forward.kernels())
    for (name, mine), (_, theirs) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=name)
    assert int(model[1].num_batches_tracked) == 3 == int(model[3].num_batches_tracked)
