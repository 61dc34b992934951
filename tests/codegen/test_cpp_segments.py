"""The C++ generator prints a split kernel's lane loop as one loop per segment of lanes where
its masks are constant (``kiln/codegen/cpp_segments.py``): a ``cat`` along the last dim and
the padded sum of a ``split``'s backward read each input in its own loop, without masked
loads. Also: a column reduction that reads a per-row value (a LayerNorm's weight gradient)
stays a column reduction, the per-row math once per ``r``. Each kernel is checked for its form
and against the evaluator or eager PyTorch on random inputs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.codegen.cpp import generate_cpp
from kiln.codegen.cpp_segments import lane_segments
from kiln.codegen.cpp_split import LaneSplit
from kiln.ir.op import Op
from kiln.recording import listen, unlisten
from kiln.runtime import cpp_build
from kiln.schedule.index import var
from kiln.schedule.loops import IndexValue, Kernel, Load, Reduce, ReduceKind, Store
from tests.codegen.ir_builders import BOOL, F32, apply, buffer, const, load
from tests.codegen.test_cpp_split import run_both

pytestmark = pytest.mark.skipif(
    not cpp_build.cpp_compiler_available(), reason="no C++ compiler on PATH"
)

I64 = torch.int64


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kiln-cpp-segments")


def padded_sum_kernel(rows: int, widths: tuple[int, ...]) -> Kernel:
    """``out[b, :] = cat(pieces)`` written as the backward of a split writes it: the sum of
    each piece zero-padded to its place, each read under a mask of the column alone."""
    total = sum(widths)
    x = var("x", rows * total)
    column = IndexValue(I64, x % total)
    value = None
    start = 0
    for number, width in enumerate(widths):
        shifted = apply(Op.SUB, column, const(start, I64))
        above = apply(Op.GE, shifted, const(0, I64), dtype=BOOL)
        below = apply(Op.LT, shifted, const(width, I64), dtype=BOOL)
        inside = apply(Op.LOGICAL_AND, above, below)
        piece = buffer(f"piece{number}", (rows, width), F32)
        offset = (x // total) * width + x % total - start
        read = Load(F32, piece, offset, inside, 0.0)
        value = read if value is None else apply(Op.ADD, value, read)
        start += width
    assert value is not None
    out = buffer("out", (rows, total), F32)
    return Kernel(f"padded_{len(widths)}", rows * total, 1, [Store(out, x, value)])


@pytest.mark.parametrize("widths", [(128, 128, 128), (16, 48, 32)])
def test_cat_pieces_run_in_their_own_lane_loops(widths: tuple[int, ...], cache: Path) -> None:
    """Three pieces: three loops over their lanes, masks as constants, no masked load left
    whose mask is computed per lane; the result is the concatenation."""
    rows = 12
    kernel = padded_sum_kernel(rows, widths)
    body = generate_cpp([kernel], 2).split(f"void {kernel.name}")[1]
    starts = [0, widths[0], widths[0] + widths[1]]
    stops = [*starts[1:], sum(widths)]
    for start, stop in zip(starts, stops, strict=True):
        assert f"for (int32_t xl = {start}; xl < {stop}; ++xl)" in body
    assert "lane0" not in body  # no per-lane mask arrays
    assert len(re.findall(r"const uint8_t t\d+ = true;", body)) == 3
    pieces = {f"piece{i}": torch.randn(rows, w) for i, w in enumerate(widths)}
    out = run_both(kernel, pieces, cache)
    torch.testing.assert_close(out["out"].view(rows, -1), torch.cat(list(pieces.values()), 1))


def test_segments_of_divided_lanes() -> None:
    """``(xl + 3) // 4 == 1`` holds for lanes 1..4 and ``xl % 8 < 6`` changes at 6 and 8:
    the segments are where either changes, with each mask's value there."""
    split = LaneSplit(12, 4)
    xl = var("xl", 12)
    quarter = apply(Op.EQ, IndexValue(I64, (xl + 3) // 4), const(1, I64), dtype=BOOL)
    low = apply(Op.LT, IndexValue(I64, xl % 8), const(6, I64), dtype=BOOL)
    segments = lane_segments(split, [quarter, low])
    assert segments is not None
    found = [(s.start, s.stop, s.constants[id(quarter)], s.constants[id(low)]) for s in segments]
    assert found == [
        (0, 1, False, True),
        (1, 5, True, True),
        (5, 6, False, True),
        (6, 8, False, False),
        (8, 12, False, True),
    ]


def test_no_segments_when_masks_change_too_often() -> None:
    """An alternating mask (even lanes) would need a loop per lane: the lane arrays stay."""
    split = LaneSplit(32, 4)
    even = apply(Op.EQ, IndexValue(I64, var("xl", 32) % 2), const(0, I64), dtype=BOOL)
    assert lane_segments(split, [even]) is None
    halves = apply(Op.LT, IndexValue(I64, var("xl", 32) + 0), const(16, I64), dtype=BOOL)
    assert lane_segments(split, [even, halves]) is None
    assert lane_segments(split, [halves]) is not None  # alone: two segments


def test_split_backward_matches_eager() -> None:
    """qkv = linear(x).split(3) through training: the backward's padded sum of the three
    gradients takes three lane loops; loss and gradients match eager."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 96)

    def fn(x: torch.Tensor) -> torch.Tensor:
        q, k, v = linear(x).split(32, dim=-1)
        return (q.tanh() * k.sigmoid() + v.square()).sum(-1)

    x = torch.randn(4, 10, 32, requires_grad=True)
    records: list = []
    listen(records, CompiledProgramRecord)
    try:
        compiled = kiln.compile(fn, options={"codegen": "cpp"})
        mine = compiled(x)
        grads = torch.autograd.grad(mine.sum(), [x, linear.weight, linear.bias])
    finally:
        unlisten(records)
        kiln.reset()
    expected = fn(x)
    want = torch.autograd.grad(expected.sum(), [x, linear.weight, linear.bias])
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)
    for got, wanted in zip(grads, want, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-5)
    sources = [generate_cpp(r.program.kernels()) for r in records if r.program]
    assert any("for (int32_t xl = 64; xl < 96; ++xl)" in s for s in sources)


def test_column_sums_read_per_row_values_once_per_r(cache: Path) -> None:
    """A LayerNorm's weight gradient, ``sum_r(g[r, x] * y[r, x] * rsqrt(var[r] + eps))``:
    ``var[r]`` is contiguous along ``r`` but one value per row of the block, so the sums stay
    columns (contiguous along ``x``) with the ``rsqrt`` once per ``r``, before the lane loop."""
    rows, width = 96, 64
    x, r = var("x", width), var("r", rows)
    grad = load(buffer("grad", (rows, width), F32), r * width + x)
    data = load(buffer("data", (rows, width), F32), r * width + x)
    rstd = apply(Op.RSQRT, apply(Op.ADD, load(buffer("var", (rows,), F32), r), const(1e-5)))
    product = apply(Op.MUL, grad, apply(Op.MUL, data, rstd))
    stores = [
        Store(buffer("weight_grad", (width,), F32), x, Reduce(F32, ReduceKind.SUM, product)),
        Store(buffer("bias_grad", (width,), F32), x, Reduce(F32, ReduceKind.SUM, grad)),
    ]
    kernel = Kernel("layer_norm_weight_grad", width, rows, stores)
    body = generate_cpp([kernel], 2).split(f"void {kernel.name}")[1]
    assert "x0 +=" in body  # blocks of columns
    per_r = body.index(f"for (int32_t r = 0; r < {rows}; ++r)")
    assert per_r < body.index("sqrtf(") < body.index("#pragma omp simd", per_r)
    inputs = {
        "grad": torch.randn(rows, width),
        "data": torch.randn(rows, width),
        "var": torch.rand(rows) + 0.1,
    }
    out = run_both(kernel, inputs, cache)
    scaled = inputs["data"] * torch.rsqrt(inputs["var"] + 1e-5)[:, None]
    expected = (inputs["grad"] * scaled).sum(0)
    torch.testing.assert_close(out["weight_grad"], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["bias_grad"], inputs["grad"].sum(0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [5, 16])
def test_batchnorm_over_a_channel_cat_reads_each_input_in_its_own_row_loop(size: int) -> None:
    """DenseNet's BatchNorm statistics over a ``cat`` of channels-last features: a column
    reduction whose rows (channels) come from one input each. Each run of rows gets its own
    loop with the masks as constants, so no element walks the chain of masked loads: rows
    ``x`` (``row_segments``, 5x5 images), or lanes ``xl`` of rows split as ``(n, c)`` (the
    per-image sums of 16x16 ones, ``lane_segments``). Outputs and every gradient match
    eager."""
    torch.manual_seed(0)
    pieces = [
        torch.randn(2, width, size, size).to(memory_format=torch.channels_last).requires_grad_()
        for width in (24, 40, 16, 48)
    ]
    weight = torch.rand(128, requires_grad=True)
    bias = torch.randn(128, requires_grad=True)

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.batch_norm(torch.cat(xs, 1), None, None, weight, bias, True)
        return torch.relu(out)

    records: list[object] = []
    listen(records, CompiledProgramRecord)
    try:
        mine = kiln.compile(fn, options={"codegen": "cpp"})(*pieces)
        grads = torch.autograd.grad(mine, [*pieces, weight, bias], torch.ones_like(mine))
    finally:
        unlisten(records)
        kiln.reset()
    expected = fn(*pieces)
    want = torch.autograd.grad(expected, [*pieces, weight, bias], torch.ones_like(expected))
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)
    for got, wanted in zip(grads, want, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-4, atol=1e-4)  # (sums of 2*16*16)
    sources = [generate_cpp(r.program.kernels()) for r in records if r.program]  # type: ignore[attr-defined]
    run = "x = (x0 > 24 ? x0 : 24); x < (x1 < 64 ? x1 : 64)" if size == 5 else "xl = 24; xl < 64"
    assert any(run in s for s in sources)
    # Within a run of rows the selects on its constant masks are folded (cpp_segments.folded):
    # the loop reads one input, by one load, and no mask of another run is printed.
    loops = [loop.split("}")[0] for source in sources for loop in source.split("omp simd")[1:]]
    cat_loops = [loop for loop in loops if re.search(r"\? a\d+\[", loop)]
    assert cat_loops
    for loop in cat_loops:
        assert len(set(re.findall(r"\? (a\d+)\[", loop))) == 1, loop
        assert "= false;" not in loop, loop
