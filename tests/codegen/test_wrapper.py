"""The host program (kiln/codegen/wrapper.py): how the graph's seed reaches the kernels that
draw random numbers. C++ kernels take it as an int; Triton kernels load it from a tensor on
their device (which a CUDA graph's runner can refresh in place before each replay). And when
it drops inputs handed over to it (:class:`~kiln.ir.graph.Donated`)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.backends.kernels import build_kernels
from kiln.codegen.wrapper import Wrapper
from kiln.frontends.trace import graph_inputs
from kiln.ir.graph import Donated
from kiln.passes import optimize
from kiln.runtime.cpp_build import cpp_compiler_available
from kiln.schedule.program import Program
from kiln.schedule.scheduler import schedule


def two_dropouts(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two kernels drawing from the graph's one seed."""
    return F.dropout(x, 0.5, training=True), F.dropout(y.relu(), 0.3, training=True)


def _program() -> tuple[Program, list[torch.Tensor]]:
    """The scheduled program of ``two_dropouts`` and its inputs (the seed last)."""
    x, y = torch.randn(4096), torch.randn(8, 50)
    graph = optimize(kiln.trace(two_dropouts, x, y))
    inputs = graph_inputs(graph, two_dropouts, x, y)
    return schedule(graph, inputs), inputs


AS_INT = SimpleNamespace()  # a launcher taking the seed as an int (C++, the evaluator)
AS_TENSOR = SimpleNamespace(seed_as_tensor=True)  # a Triton launcher


def test_each_kernel_gets_the_seed_in_its_launchers_form() -> None:
    """One int for the C++ kernels, one copy per device for the Triton kernels, made once a
    call; without launchers (the debug listing) CUDA kernels get a tensor, CPU ones an int."""
    program, _ = _program()
    first, second = program.kernels()
    launchers = {first.name: AS_TENSOR, second.name: AS_INT}
    source = Wrapper(program, launchers).source()
    assert "    seed_cpu = in_rng_seed.to('cpu', non_blocking=True)\n" in source
    assert "    seed = int(in_rng_seed)\n" in source
    assert f"{first.name}(buf_t4, in_x, seed_cpu)" in source
    assert f"{second.name}(buf_t11, in_y, seed)" in source
    assert Wrapper(program, {}).source().count("seed = int(in_rng_seed)") == 1

    second.device = torch.device("cuda", 0)  # printed only: a program mixing devices
    source = Wrapper(program, {first.name: AS_INT}).source()
    assert "    seed = int(in_rng_seed)\n" in source
    assert "    seed_cuda_0 = in_rng_seed.to('cuda:0', non_blocking=True)\n" in source
    assert f"{second.name}(buf_t11, in_y, seed_cuda_0)" in source


def _run(program: Program, codegen: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    launchers, _ = build_kernels(program.kernels(), codegen)
    return Wrapper(program, launchers).compile()(inputs)


def test_triton_draws_cpps_numbers_from_the_same_seed() -> None:
    """The Triton kernels (seed loaded through a pointer, in the interpreter) keep the masks
    of the C++ kernels (seed as an int) bit for bit; a fresh seed draws other masks."""
    pytest.importorskip("triton")
    if not cpp_compiler_available():
        pytest.skip("no C++ compiler")
    program, inputs = _program()
    triton = _run(program, "triton", inputs)
    cpp = _run(program, "cpp", inputs)
    for mine, theirs in zip(triton, cpp, strict=True):
        assert torch.equal(mine, theirs)
    assert 0.4 < float((triton[0] == 0).float().mean()) < 0.6
    again = _run(program, "triton", inputs)
    assert all(torch.equal(a, b) for a, b in zip(again, triton, strict=True))
    fresh = [*inputs[:-1], inputs[-1] + 1]
    other = _run(program, "triton", fresh)
    assert not torch.equal(other[0] == 0, triton[0] == 0)


def scaled_sum(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` read by the first kernel alone; ``y`` also returned as a view."""
    return (x * 2).sum(0) + y, y[1:]


def test_a_donated_input_is_dropped_after_the_step_that_reads_it_last() -> None:
    """Given a :class:`Donated` list (a CUDA-graph runner's static copies while it records),
    the host program empties it and drops each input after its last reader: nothing holds it
    once the program no longer needs it, so the recording's later steps may take its memory.
    An input an output views is kept; an ordinary list is left as it was."""
    x, y = torch.randn(6, 5), torch.randn(5)
    graph = optimize(kiln.trace(scaled_sum, x, y))
    inputs = graph_inputs(graph, scaled_sum, x, y)
    program = schedule(graph, inputs)
    source = Wrapper(program, {}).source()
    lines = source.splitlines()
    assert lines[2] == "    if inputs.__class__ is Donated: inputs.clear()"
    (drop,) = [n for n, line in enumerate(lines) if line.strip().startswith("del in_")]
    (reader,) = [n for n, line in enumerate(lines) if line.startswith("    k") and "in_x" in line]
    assert lines[drop] == "    del in_x" and drop == reader + 1
    assert "del in_y" not in source

    launchers, _ = build_kernels(program.kernels(), "")
    run = Wrapper(program, launchers).compile()
    expected = scaled_sum(x, y)
    given = [x.clone(), y.clone()]
    dropped = weakref.ref(given[0])
    kept = weakref.ref(given[1])
    donated = Donated(given)
    del given
    results = run(donated)
    assert donated == [] and dropped() is None and kept() is not None
    torch.testing.assert_close(results[0], expected[0])
    ordinary = [x, y]
    torch.testing.assert_close(run(ordinary)[0], expected[0])
    assert ordinary[0] is x and ordinary[1] is y
