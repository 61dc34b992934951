"""The C++/OpenMP code generator and its build: hand-built kernels against eager PyTorch.

Kernels are built from the loop-level IR by the helpers below, compiled (several kernels per
translation unit, cached on disk and shared by the xdist workers) and compared with the
registry rows' reference implementations on fresh random inputs.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kiln  # noqa: F401  (registers the op rows)
from kiln.codegen.cpp import cpp_library, generate_cpp
from kiln.config import config
from kiln.errors import BackendError, CompilerNotFoundError, KernelBuildError
from kiln.ir.op import Op, Tag, op_def, registered_ops
from kiln.ops.attrs import ArgReduceAttrs, ConvertAttrs, ReduceAttrs
from kiln.ops.sampling import make_tensor
from kiln.runtime import cpp_build
from kiln.schedule.index import decompose, indirect, linear, var
from kiln.schedule.loops import (
    Buffer,
    BufferKind,
    IndexValue,
    Kernel,
    Rand,
    Reduce,
    ReduceKind,
    Store,
)
from kiln.schedule.program import kernel_arguments
from tests.codegen.ir_builders import (  # noqa: F401  (the shared builders)
    BF16,
    BOOL,
    CPU,
    F16,
    F32,
    F64,
    I8,
    I32,
    I64,
    U8,
    apply,
    buffer,
    const,
    load,
)

pytestmark = pytest.mark.skipif(
    not cpp_build.cpp_compiler_available(), reason="no C++ compiler on PATH"
)

THREADS = 2
_CACHE: dict[str, Path] = {}

# ---------------------------------------------------------------------------------------------
# building kernels by hand


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One kernel cache per run, shared by the xdist workers (their tmp dirs' parent): the
    build lock makes one worker compile a translation unit while the other waits for it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    _CACHE["dir"] = shared / "kiln-cpp-cache"


def cache_dir() -> Path:
    return _CACHE["dir"]


def build(kernels: list[Kernel], threads: int = THREADS) -> dict[str, Callable[..., None]]:
    return cpp_build.load_kernels(cpp_library(kernels, threads), cache_dir())


def run(
    kernel: Kernel, inputs: dict[str, torch.Tensor], seed: int | None = None
) -> dict[str, torch.Tensor]:
    """Run ``kernel`` (built alone) on tensors named like its buffers; the buffers it writes
    are allocated here (7 or False, so an unwritten element shows) unless given."""
    tensors = dict(inputs)
    for out in kernel.writes():
        canary = torch.full(out.shape, 7) if out.dtype != BOOL else torch.zeros(out.shape)
        tensors.setdefault(out.name, canary.to(out.dtype))
    build([kernel])[kernel.name](*_arguments(kernel, tensors, seed))
    return tensors


def _arguments(kernel: Kernel, tensors: dict[str, torch.Tensor], seed: int | None) -> list[Any]:
    arguments: list[Any] = [tensors[b.name] for b in kernel_arguments(kernel)]
    return [*arguments, seed] if seed is not None else arguments


def _python(*arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *arguments]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    assert actual.dtype == expected.dtype
    if not actual.dtype.is_floating_point:
        assert torch.equal(actual, expected), (actual, expected)
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# every elementwise op x every dtype of its row

_TRANSCENDENTAL_NAMES = "EXP EXP2 EXPM1 LOG LOG1P LOG2 SIN COS TAN TANH ASIN ACOS ATAN SINH COSH"
TRANSCENDENTAL = {Op[name] for name in f"{_TRANSCENDENTAL_NAMES} ERF ERFINV SIGMOID POW".split()}
TRANSCENDENTAL |= {Op.ATAN2, Op.RSQRT}
DRAWS = 5  # samples drawn per case: 5 x 15 = 75 elements (vector body and tail)
ELEMENTWISE = [row for row in registered_ops() if Tag.ELEMENTWISE in row.tags]


def _dtypes(row: Any) -> list[torch.dtype]:
    dtypes = sorted(row.dtypes, key=str)
    return [*dtypes, F64] if F32 in row.dtypes else dtypes


def _targets(row: Any, dtype: torch.dtype) -> list[Any]:
    """The attrs of each kernel of one (op, dtype): CONVERT has one per target dtype."""
    if row.op is Op.CONVERT:
        return [sample.attrs for sample in row.samples(dtype, CPU)] + [ConvertAttrs(F64)]
    return [None]


CASES = [(row.op, dtype) for row in ELEMENTWISE for dtype in _dtypes(row)]


def _kernel_name(op: Op, dtype: torch.dtype, attrs: Any) -> str:
    suffix = f"_to_{attrs.dtype}" if attrs else ""
    return f"{op.printed_name}_{dtype}{suffix}".replace("torch.", "")


def _draw(op: Op, dtype: torch.dtype, attrs: Any) -> list[torch.Tensor]:
    """Fresh operands from the row's first sample, drawn DRAWS times and concatenated."""
    row = op_def(op)
    draws = []
    for _ in range(DRAWS):
        samples = row.samples(dtype, CPU)
        sample = next((s for s in samples if s.attrs == attrs), samples[0])
        draws.append([t.reshape(-1) for t in sample.inputs])
    return [torch.cat(parts) for parts in zip(*draws, strict=True)]


def _elementwise_kernel(op: Op, dtype: torch.dtype, attrs: Any) -> Kernel:
    """out0 = op(in0, in1, ...); a binary op also stores out1 = op(in0, 1.5 or 3)."""
    inputs = _draw(op, dtype, attrs)
    expected = op_def(op).impl(attrs, *inputs)
    n = inputs[0].numel()
    x = var("x", n)
    loads = [load(buffer(f"in{i}", (n,), t.dtype), x) for i, t in enumerate(inputs)]
    stores = [
        Store(buffer("out0", (n,), expected.dtype), x, apply(op, *loads, dtype=expected.dtype))
    ]
    if Tag.BINARY in op_def(op).tags:
        scalar = const(_scalar(op, dtype), dtype)
        value = apply(op, loads[0], scalar, dtype=expected.dtype)
        stores.append(Store(buffer("out1", (n,), expected.dtype), x, value))
    return Kernel(_kernel_name(op, dtype, attrs), n, 1, stores, [f"{op.printed_name} test"])


def _scalar(op: Op, dtype: torch.dtype) -> bool | int | float:
    if dtype == BOOL:
        return True
    return 1.5 if dtype.is_floating_point else (2 if op in {Op.SHIFT_LEFT, Op.SHIFT_RIGHT} else 3)


Library = dict[str, tuple[Callable[..., None], Kernel]]


def build_library(kernels: list[Kernel]) -> Library:
    launchers = build(kernels)
    return {k.name: (launchers[k.name], k) for k in kernels}


def launch(library: Library, name: str, tensors: dict[str, torch.Tensor]) -> None:
    launcher, kernel = library[name]
    launcher(*_arguments(kernel, tensors, None))


@functools.cache
def _elementwise_library(dtype: torch.dtype) -> Library:
    """Every elementwise kernel whose operands have ``dtype``, in one translation unit."""
    kernels = [
        _elementwise_kernel(op, case_dtype, attrs)
        for op, case_dtype in CASES
        if case_dtype == dtype
        for attrs in _targets(op_def(op), dtype)
    ]
    return build_library(kernels)


def _tolerance(op: Op, dtype: torch.dtype) -> tuple[float, float]:
    if dtype in {BF16, F16}:
        return (1e-2, 1e-2) if dtype == BF16 else (1e-3, 1e-3)
    if dtype == F64:
        return (1e-9, 1e-12) if op in TRANSCENDENTAL else (1e-12, 1e-12)
    return (1e-4, 1e-6) if op in TRANSCENDENTAL else (1e-5, 1e-6)


@pytest.mark.parametrize(("op", "dtype"), CASES, ids=[f"{o.printed_name}-{d}" for o, d in CASES])
def test_elementwise_op_matches_its_row(op: Op, dtype: torch.dtype) -> None:
    library = _elementwise_library(dtype)
    for attrs in _targets(op_def(op), dtype):
        inputs = _draw(op, dtype, attrs)
        expected = [op_def(op).impl(attrs, *inputs)]
        if Tag.BINARY in op_def(op).tags:
            expected.append(op_def(op).impl(attrs, inputs[0], _scalar(op, dtype)))
        outputs = [torch.empty_like(e) for e in expected]
        tensors = {f"out{i}": t for i, t in enumerate(outputs)}
        tensors.update({f"in{i}": t for i, t in enumerate(inputs)})
        launch(library, _kernel_name(op, dtype, attrs), tensors)
        check_dtype = attrs.dtype if attrs else dtype
        rtol, atol = (0.0, 0.0) if attrs else _tolerance(op, check_dtype)
        for actual, wanted in zip(outputs, expected, strict=True):
            assert_close(actual, wanted, rtol, atol)


SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1e-30, 3.0, 100.0]
FLOAT_UNARY = [row.op for row in ELEMENTWISE if Tag.UNARY in row.tags and F32 in row.dtypes]


def test_float_ops_keep_nan_inf_and_signed_zero_semantics() -> None:
    """Special values through every float unary op and NaN through the binary extrema, as
    eager gives them (no -ffast-math: NaN stays NaN, inf stays inf)."""
    values = torch.tensor(SPECIAL, dtype=F32)
    n = values.numel()
    x = var("x", n)
    a, b = load(buffer("in0", (n,), F32), x), load(buffer("in1", (n,), F32), x)
    unary = [op for op in FLOAT_UNARY if op is not Op.CONVERT]
    binary = [Op.MAXIMUM, Op.MINIMUM, Op.FLOOR_DIV, Op.REMAINDER, Op.FMOD, Op.POW, Op.DIV]
    stores = []
    for i, op in enumerate(unary):
        dtype = BOOL if op in {Op.ISNAN, Op.ISINF, Op.LOGICAL_NOT} else F32
        stores.append(Store(buffer(f"u{i}", (n,), dtype), x, apply(op, a, dtype=dtype)))
    stores += [Store(buffer(f"b{i}", (n,), F32), x, apply(op, a, b)) for i, op in enumerate(binary)]
    rhs = torch.tensor([1.0, math.nan, 2.0, 0.0, 3.0, -0.0, math.inf, -1.5, 2.0, 0.0, -7.0, 1.0])
    tensors = run(Kernel("special_values", n, 1, stores), {"in0": values, "in1": rhs})
    for i, op in enumerate(unary):
        expected = op_def(op).impl(None, values)
        rtol, atol = _tolerance(op, F32)
        assert_close(tensors[f"u{i}"], expected, rtol, atol)
    for i, op in enumerate(binary):
        expected = op_def(op).impl(None, values, rhs)
        assert_close(tensors[f"b{i}"], expected, 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# shapes, layouts, masks, gathers


def _gelu_kernel(n: int, dtype: torch.dtype) -> Kernel:
    """out = gelu(a + b) * 2 + y, every value rounded as its dtype at the store."""
    x = var("x", n)
    a, b, y = (buffer(name, (n,), dtype) for name in ("a", "b", "y"))
    v = apply(Op.ADD, load(a, x), load(b, x))
    erf = apply(Op.ERF, apply(Op.MUL, v, const(0.7071067811865476, dtype)))
    gelu = apply(Op.MUL, apply(Op.MUL, v, const(0.5, dtype)), apply(Op.ADD, erf, const(1.0, dtype)))
    value = apply(Op.ADD, apply(Op.MUL, gelu, const(2.0, dtype)), load(y, x))
    return Kernel(f"gelu_{n}_{dtype.itemsize}", n, 1, [Store(buffer("out", (n,), dtype), x, value)])


@pytest.mark.parametrize("n", [0, 1, 5, 1000, 40000])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_fused_pointwise_on_any_size(n: int, dtype: torch.dtype) -> None:
    kernel = _gelu_kernel(n, dtype)
    tensors = run(kernel, {name: torch.randn(n).to(dtype) for name in ("a", "b", "y")})
    a, b, y = (tensors[k].float() for k in ("a", "b", "y"))
    expected = (torch.nn.functional.gelu(a + b) * 2 + y).to(dtype)
    tol = {F32: 1e-5, BF16: 1e-2, F16: 1e-3}[dtype]
    assert_close(tensors["out"], expected, tol, tol)


def test_transposed_broadcast_and_offset_loads() -> None:
    """out[i, j] = a[j, i] (a transposed view) + bias[j] + b[offset 3 + 2*(i*7 + j)]."""
    rows, cols = 5, 7
    x = var("x", rows * cols)
    i, j = decompose(x, (rows, cols))
    a, bias = buffer("a", (cols, rows), F32), buffer("bias", (cols,), F32)
    strided = buffer("b", (3 + 2 * rows * cols,), F32)
    value = apply(
        Op.ADD,
        apply(Op.ADD, load(a, linear((j, i), (rows, 1))), load(bias, j)),
        load(strided, linear((x,), (2,), offset=3)),
    )
    kernel = Kernel("views", rows * cols, 1, [Store(buffer("out", (rows, cols), F32), x, value)])
    inputs = {"a": torch.randn(cols, rows), "bias": torch.randn(cols)}
    tensors = run(kernel, {**inputs, "b": torch.randn(3 + 2 * rows * cols)})
    strided_view = tensors["b"][3::2].reshape(rows, cols)
    expected = tensors["a"].t() + tensors["bias"] + strided_view
    assert_close(tensors["out"], expected, 1e-6, 1e-6)


def test_masked_load_yields_other_and_stays_in_bounds() -> None:
    """Padding: out[k] = a[k - 4] for 4 <= k < n + 4, else -1.5 (never reading outside a)."""
    n = 37
    x = var("x", n + 8)
    a = buffer("a", (n,), F32)
    position = IndexValue(I64, x)
    inside = apply(
        Op.LOGICAL_AND,
        apply(Op.GE, position, const(4, I64), dtype=BOOL),
        apply(Op.LT, position, const(n + 4, I64), dtype=BOOL),
        dtype=BOOL,
    )
    value = load(a, x - 4 + 0, mask=inside, other=-1.5)
    kernel = Kernel("pad", n + 8, 1, [Store(buffer("out", (n + 8,), F32), x, value)])
    tensors = run(kernel, {"a": torch.randn(n)})
    expected = torch.nn.functional.pad(tensors["a"], (4, 4), value=-1.5)
    assert_close(tensors["out"], expected, 0, 0)


def test_indirect_load_gathers_rows() -> None:
    """out[i, j] = table[index[i], j] (an embedding lookup) and int positions as values."""
    rows, cols, vocab = 9, 6, 11
    x = var("x", rows * cols)
    i, j = decompose(x, (rows, cols))
    table, index = buffer("table", (vocab, cols), F32), buffer("index", (rows,), I64)
    gathered = load(table, indirect(load(index, i), vocab) * cols + j)
    positions = IndexValue(I64, i * cols + j)
    flipped = IndexValue(I64, i * -1 + (rows - 1))
    scattered = indirect(apply(Op.ADD, flipped, const(0, I64)), rows) * cols + j
    stores = [
        Store(buffer("out", (rows, cols), F32), x, gathered),
        Store(buffer("pos", (rows, cols), I64), x, positions),
        Store(buffer("scattered", (rows, cols), F32), scattered, gathered),  # a computed row
    ]
    kernel = Kernel("gather", rows * cols, 1, stores)
    index = torch.randint(0, vocab, (rows,))
    tensors = run(kernel, {"table": torch.randn(vocab, cols), "index": index})
    assert_close(tensors["out"], tensors["table"][index], 0, 0)
    assert_close(tensors["scattered"], tensors["table"][index].flip(0), 0, 0)
    assert torch.equal(tensors["pos"].reshape(-1), torch.arange(rows * cols))


def test_int64_indexing_when_offsets_do_not_fit_int32() -> None:
    x = var("x", 8)
    huge = buffer("huge", (2**40,), F32)
    kernel = Kernel("wide", 8, 1, [Store(buffer("out", (8,), F32), x, load(huge, x * 2**37))])
    source = generate_cpp([kernel], threads=2)
    assert "int64_t x = 0" in source and "137438953472*x" in source
    small = Kernel("narrow", 8, 1, [Store(buffer("out", (8,), F32), x, const(1.0))])
    assert "int32_t x = 0" in generate_cpp([small], threads=2)


# ---------------------------------------------------------------------------------------------
# reductions

REDUCE_OPS = dict(
    zip(ReduceKind, (Op.SUM, Op.PROD, Op.AMAX, Op.AMIN, Op.ARGMAX, Op.ARGMIN), strict=True)
)
REDUCE_DTYPES = [F32, F64, F16, BF16, I32, I64, BOOL]
REDUCE_SHAPES = [(3, 5), (1, 1), (7, 1), (0, 4), (5, 300), (300, 200), (1, 50000)]


def _reduce_kernel(
    kind: ReduceKind, dtype: torch.dtype, rows: int, cols: int, by_column: bool
) -> Kernel:
    """out[x] = reduce(in[x, r]) (or over the column: in[r, x])."""
    x, r = var("x", rows), var("r", cols)
    source = buffer("in", (cols, rows) if by_column else (rows, cols), dtype)
    offset = r * rows + x if by_column else x * cols + r
    out_dtype = I64 if kind in {ReduceKind.ARGMAX, ReduceKind.ARGMIN} else dtype
    value = Reduce(out_dtype, kind, load(source, offset))
    name = (
        f"{kind.value}_{dtype.itemsize}{str(dtype)[6]}_{rows}x{cols}{'_col' if by_column else ''}"
    )
    return Kernel(name, rows, cols, [Store(buffer("out", (rows,), out_dtype), x, value)])


def _reduce_cases() -> list[tuple[ReduceKind, torch.dtype, tuple[int, int]]]:
    """Every kind x dtype x shape; large shapes for a few dtypes only, and a product over at
    most 300 numbers (more is 0 or inf)."""
    return [
        (kind, dtype, shape)
        for kind, op in REDUCE_OPS.items()
        for dtype in REDUCE_DTYPES
        if dtype in op_def(op).dtypes or (dtype == F64 and F32 in op_def(op).dtypes)
        for shape in REDUCE_SHAPES
        if not (kind is ReduceKind.PROD and shape[1] > 300)
        and (shape[0] * shape[1] <= 1000 or dtype in {F32, BF16, I64})
    ]


REDUCE_CASES = _reduce_cases()


@functools.cache
def _reduce_library(kind: ReduceKind) -> Library:
    kernels = [
        _reduce_kernel(kind, dtype, *shape, by_column=by_column)
        for case_kind, dtype, shape in REDUCE_CASES
        if case_kind is kind
        for by_column in (False, True)
    ]
    return build_library(kernels)


@pytest.mark.parametrize(
    ("kind", "dtype", "shape"),
    REDUCE_CASES,
    ids=[f"{k.value}-{d}-{s[0]}x{s[1]}" for k, d, s in REDUCE_CASES],
)
def test_reduction_matches_its_row(
    kind: ReduceKind, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    library = _reduce_library(kind)
    op = REDUCE_OPS[kind]
    for by_column in (False, True):
        kernel = _reduce_kernel(kind, dtype, *shape, by_column=by_column)
        low, high = (
            ((0.5, 1.5) if dtype.is_floating_point else (-2, 3)) if op is Op.PROD else (None, None)
        )
        data = make_tensor(shape, dtype, low=low, high=high)
        if dtype.is_floating_point and shape[0] * shape[1] > 10 and kind is not ReduceKind.SUM:
            data.view(-1)[3] = math.nan  # NaN propagates through max/min/argmax (and prod)
        stored = data.t().contiguous() if by_column else data
        if kind in {ReduceKind.ARGMAX, ReduceKind.ARGMIN}:
            expected = op_def(op).impl(ArgReduceAttrs(1), data)
        elif kind is ReduceKind.PROD and dtype in {F16, BF16}:  # eager accumulates in 16 bits
            expected = op_def(op).impl(ReduceAttrs((1,)), data.float()).to(dtype)
        else:
            expected = op_def(op).impl(ReduceAttrs((1,)), data)
        out = torch.full((shape[0],), 5, dtype=expected.dtype)
        launch(library, kernel.name, {"in": stored, "out": out})
        rtol = {F32: 1e-5, F64: 1e-12, BF16: 1e-2, F16: 1e-3}.get(dtype, 0.0)
        scale = data.float().abs().nan_to_num(0).sum(1).clamp(min=1)  # sums: relative to sum|x|
        atol = rtol * scale.max().item() if kind is ReduceKind.SUM and scale.numel() else rtol
        assert_close(out, expected, rtol, atol)


def test_generated_source_parallelizes_and_vectorizes() -> None:
    """Chunks per thread only for big pointwise work; simd reduction clauses (NaN flag for
    max); few long rows run each r loop in parallel; ARGMAX loops stay scalar."""
    source = generate_cpp([_gelu_kernel(40000, F32), _gelu_kernel(1000, F32)], threads=2)
    big = source[source.index("kernel gelu_40000") : source.index("kernel gelu_1000")]
    small = source[source.index("kernel gelu_1000") :]
    assert "#pragma omp parallel for num_threads(2)" in big and "#pragma omp simd" in big
    assert "omp parallel" not in small and "#pragma omp simd" in small
    assert "const float* a1" in big and "float* a0" in big
    assert "omp parallel" not in generate_cpp([_gelu_kernel(40000, F32)], threads=1)
    kernel = _reduce_kernel(ReduceKind.MAX, F32, 300, 200, by_column=False)
    source = generate_cpp([kernel], threads=2)
    assert "#pragma omp simd reduction(max:acc0) reduction(|:nan_acc0)" in source
    assert "#pragma omp parallel for num_threads(2)" in source
    long_row = generate_cpp([_reduce_kernel(ReduceKind.SUM, F32, 1, 50000, False)], threads=2)
    assert "#pragma omp parallel for simd num_threads(2)" in long_row
    argmax = generate_cpp([_reduce_kernel(ReduceKind.ARGMAX, F32, 3, 5, False)], threads=2)
    assert "omp simd" not in argmax.split("extern", 1)[1].split("{", 1)[1]


def test_bool_sum_counts_and_integer_sum_accumulates_in_int64() -> None:
    rows, cols = 6, 45
    x, r = var("x", rows), var("r", cols)
    flags, ints = buffer("flags", (rows, cols), BOOL), buffer("ints", (rows, cols), I32)
    count = Reduce(I64, ReduceKind.SUM, apply(Op.CONVERT, load(flags, x * cols + r), dtype=I64))
    any_set = Reduce(BOOL, ReduceKind.MAX, load(flags, x * cols + r))
    wide = Reduce(I64, ReduceKind.SUM, apply(Op.CONVERT, load(ints, x * cols + r), dtype=I64))
    stores = [
        Store(buffer("count", (rows,), I64), x, count),
        Store(buffer("any", (rows,), BOOL), x, any_set),
        Store(buffer("wide", (rows,), I64), x, wide),
    ]
    kernel = Kernel("counts", rows, cols, stores)
    flags = torch.rand(rows, cols) > 0.7
    flags[0] = False
    ints = torch.randint(2**30, 2**31 - 1, (rows, cols), dtype=I32)
    tensors = run(kernel, {"flags": flags, "ints": ints})
    assert torch.equal(tensors["count"], tensors["flags"].sum(1))
    assert torch.equal(tensors["any"], tensors["flags"].any(1))
    assert torch.equal(tensors["wide"], tensors["ints"].sum(1, dtype=I64))


def _softmax_kernel(rows: int, cols: int, dtype: torch.dtype) -> Kernel:
    """Nested reductions: max, then the sum of exp(x - max), then the normalized row."""
    x, r = var("x", rows), var("r", cols)
    value = apply(Op.CONVERT, load(buffer("in", (rows, cols), dtype), x * cols + r), dtype=F32)
    peak = Reduce(F32, ReduceKind.MAX, value)
    shifted = apply(Op.EXP, apply(Op.SUB, value, peak))
    total = Reduce(F32, ReduceKind.SUM, shifted)
    result = apply(Op.CONVERT, apply(Op.DIV, shifted, total), dtype=dtype)
    store = Store(buffer("out", (rows, cols), dtype), x * cols + r, result)
    fused = ["amax", "sub", "exp", "sum", "div"]
    return Kernel(f"softmax_{rows}x{cols}_{dtype.itemsize}", rows, cols, [store], fused)


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (4, 1), (13, 37), (64, 1000), (1, 40000)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_softmax_nested_reductions(rows: int, cols: int, dtype: torch.dtype) -> None:
    kernel = _softmax_kernel(rows, cols, dtype)
    data = (torch.randn(rows, cols) * 3).to(dtype)
    out = run(kernel, {"in": data})["out"]
    expected = torch.softmax(data.float(), dim=1).to(dtype)
    tol = 1e-5 if dtype == F32 else 1e-2
    assert_close(out, expected, tol, 1e-6 if dtype == F32 else 1e-3)


def _layer_norm_kernel(rows: int, cols: int, dtype: torch.dtype) -> Kernel:
    """mean and rstd per row (per-row stores) and the normalized, scaled row; also y = 2x,
    a row-shaped store that needs no reduction (it runs in the first loop)."""
    x, r = var("x", rows), var("r", cols)
    at = x * cols + r
    value = apply(Op.CONVERT, load(buffer("in", (rows, cols), dtype), at), dtype=F32)
    weight = apply(Op.CONVERT, load(buffer("w", (cols,), dtype), r), dtype=F32)
    bias = apply(Op.CONVERT, load(buffer("b", (cols,), dtype), r), dtype=F32)
    mean = apply(Op.DIV, Reduce(F32, ReduceKind.SUM, value), const(float(cols)))
    centered = apply(Op.SUB, value, mean)
    squares = Reduce(F32, ReduceKind.SUM, apply(Op.MUL, centered, centered))
    variance = apply(Op.DIV, squares, const(float(cols)))
    rstd = apply(Op.RSQRT, apply(Op.ADD, variance, const(1e-5)))
    normalized = apply(Op.ADD, apply(Op.MUL, apply(Op.MUL, centered, rstd), weight), bias)
    twice = apply(Op.MUL, value, const(2.0))
    stores = [
        Store(buffer("out", (rows, cols), dtype), at, apply(Op.CONVERT, normalized, dtype=dtype)),
        Store(buffer("mean", (rows,), F32), x, mean),
        Store(buffer("rstd", (rows,), F32), x, rstd),
        Store(buffer("twice", (rows, cols), dtype), at, apply(Op.CONVERT, twice, dtype=dtype)),
        Store(buffer("ones", (rows, cols), BOOL), at, const(True, BOOL)),  # per (x, r)
    ]
    return Kernel(f"layer_norm_{rows}x{cols}_{dtype.itemsize}", rows, cols, stores)


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (9, 33), (200, 256)])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_layer_norm_multi_output(rows: int, cols: int, dtype: torch.dtype) -> None:
    kernel = _layer_norm_kernel(rows, cols, dtype)
    data = (torch.randn(rows, cols) * 2 + 1).to(dtype)
    w, b = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
    tensors = run(kernel, {"in": data, "w": w, "b": b})
    source = generate_cpp([kernel], threads=2)
    loops = source.count("for (int32_t r = 0;")
    assert loops == (3 if cols > 1 else 2)  # sum, sum of squares, normalized row
    expected = torch.nn.functional.layer_norm(data.float(), (cols,), w.float(), b.float(), 1e-5)
    tol = {F32: 1e-4, BF16: 2e-2, F16: 2e-3}[dtype]
    assert_close(tensors["out"], expected.to(dtype), tol, tol)
    assert_close(tensors["mean"], data.float().mean(1), 1e-5, 1e-5)
    rstd = torch.rsqrt(data.float().var(1, unbiased=False) + 1e-5)
    assert_close(tensors["rstd"], rstd, 1e-4, 1e-5)
    assert_close(tensors["twice"], (data.float() * 2).to(dtype), 0, 0)
    assert tensors["ones"].all()


def test_empty_rows_give_identities() -> None:
    rows = 4
    x, r = var("x", rows), var("r", 0)
    source = buffer("in", (rows, 0), F32)
    stores = [
        Store(buffer(k.value, (rows,), F32), x, Reduce(F32, k, load(source, x * 0 + r)))
        for k in (ReduceKind.SUM, ReduceKind.PROD)
    ]
    tensors = run(Kernel("empty_rows", rows, 0, stores), {"in": torch.empty(rows, 0)})
    assert torch.equal(tensors["sum"], torch.zeros(rows))
    assert torch.equal(tensors["prod"], torch.ones(rows))


# ---------------------------------------------------------------------------------------------
# random numbers: Philox-4x32-10 as Triton's tl.rand / tl.randn


def _philox_reference(seed: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Triton's philox (python/triton/language/random.py) in numpy: the first two words."""
    c0 = offsets.astype(np.uint32)
    c1 = c2 = c3 = np.zeros_like(c0)
    k0 = np.uint32(seed & 0xFFFFFFFF)
    k1 = np.uint32((seed >> 32) & 0xFFFFFFFF)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = c0.astype(np.uint64), c2.astype(np.uint64)
        c0 = ((b * p2) >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0
        c2 = ((a * p0) >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1
        c1 = (b * p2).astype(np.uint32)
        c3 = (a * p0).astype(np.uint32)
        k0 = np.uint32((int(k0) + 0x9E3779B9) & 0xFFFFFFFF)
        k1 = np.uint32((int(k1) + 0xBB67AE85) & 0xFFFFFFFF)
    return c0, c1


def _uniform(words: np.ndarray) -> np.ndarray:
    signed = words.view(np.int32)
    return np.where(signed < 0, ~signed, signed).astype(np.float32) * np.float32(4.6566127342e-10)


def _rand_kernel(n: int) -> Kernel:
    seed = Buffer("seed", (), I64, CPU, BufferKind.INPUT)
    x = var("x", n)
    stores = [
        Store(buffer("uniform", (n,), F32), x, Rand(F32, seed, x)),
        Store(buffer("normal", (n,), F32), x, Rand(F32, seed, x * 3 + 5, normal=True)),
    ]
    return Kernel(f"rand_{n}", n, 1, stores)


SEED = 0x1234_5678_9ABC_DEF


def test_rand_and_randn_follow_philox_and_their_distributions() -> None:
    n = 100_000
    kernel = _rand_kernel(n)
    tensors = run(kernel, {}, seed=SEED)
    uniform, normal = tensors["uniform"], tensors["normal"]
    words0, _ = _philox_reference(SEED, np.arange(n))
    assert np.array_equal(uniform.numpy(), _uniform(words0))
    a, b = _philox_reference(SEED, np.arange(n) * 3 + 5)
    u1 = np.maximum(np.float32(1e-7), _uniform(a))
    theta = np.float32(6.283185307179586) * _uniform(b)
    expected = np.sqrt(np.float32(-2.0) * np.log(u1)) * np.cos(theta)
    np.testing.assert_allclose(normal.numpy(), expected, rtol=1e-4, atol=1e-5)
    assert uniform.min() >= 0 and uniform.max() < 1
    assert abs(uniform.mean().item() - 0.5) < 0.01 and abs(uniform.var().item() - 1 / 12) < 0.003
    assert abs(normal.mean().item()) < 0.02 and abs(normal.std().item() - 1) < 0.02
    again = run(kernel, {}, seed=SEED + 1)
    assert not torch.equal(again["uniform"], uniform)


TRITON_SCRIPT = """
import sys, torch, triton, triton.language as tl
@triton.jit
def draw(uniform, normal, seed, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(uniform + offsets, tl.rand(seed, offsets), mask=mask)
    tl.store(normal + offsets, tl.randn(seed, offsets * 3 + 5), mask=mask)
n = int(sys.argv[2])
u, z = torch.empty(n), torch.empty(n)
draw[(triton.cdiv(n, 4096),)](u, z, int(sys.argv[1]), n, BLOCK=4096)
torch.save((u, z), sys.argv[3])
"""


def test_rand_matches_triton_interpreter_bit_for_bit(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    n = 5000
    script = tmp_path / "draw.py"
    script.write_text(TRITON_SCRIPT)
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    result = _python(str(script), str(SEED), str(n), str(tmp_path / "out.pt"), env=environment)
    if result.returncode != 0:
        pytest.skip(f"Triton's interpreter did not run: {result.stderr[-300:]}")
    uniform, normal = torch.load(tmp_path / "out.pt")
    mine = run(_rand_kernel(n), {}, seed=SEED)
    assert torch.equal(mine["uniform"], uniform)
    torch.testing.assert_close(mine["normal"], normal, rtol=1e-4, atol=1e-5)


def test_dropout_in_a_reduction_kernel_uses_r_dependent_offsets() -> None:
    """out[x] = sum_r where(rand(seed, x*R + r) > 0.3, v, 0): the mask regenerates per r."""
    rows, cols = 8, 100
    seed = Buffer("seed", (), I64, CPU, BufferKind.INPUT)
    x, r = var("x", rows), var("r", cols)
    value = load(buffer("in", (rows, cols), F32), x * cols + r)
    keep = apply(Op.GT, Rand(F32, seed, x * cols + r), const(0.3), dtype=BOOL)
    dropped = apply(Op.WHERE, keep, value, const(0.0))
    store = Store(buffer("out", (rows,), F32), x, Reduce(F32, ReduceKind.SUM, dropped))
    tensors = run(Kernel("dropout_sum", rows, cols, [store]), {"in": torch.randn(rows, cols)}, SEED)
    words, _ = _philox_reference(SEED, np.arange(rows * cols))
    mask = torch.from_numpy(_uniform(words) > np.float32(0.3)).reshape(rows, cols)
    assert_close(tensors["out"], torch.where(mask, tensors["in"], 0).sum(1), 1e-5, 1e-5)


# ---------------------------------------------------------------------------------------------
# build and load


def _tiny_kernel(name: str = "tiny") -> Kernel:
    x = var("x", 4)
    value = apply(Op.ADD, load(buffer("a", (4,), F32), x), const(1.0))
    return Kernel(name, 4, 1, [Store(buffer("out", (4,), F32), x, value)])


def test_cache_hit_corrupt_entry_and_compile_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = _tiny_kernel()
    source = generate_cpp([kernel], threads=1)
    launch = cpp_build.load_kernels(cpp_library([kernel], source=source), tmp_path)["tiny"]
    a, out = torch.arange(4.0), torch.empty(4)
    launch(out, a)
    assert torch.equal(out, a + 1)
    (library,) = (tmp_path / "cpp").glob("*.so")
    assert library.with_suffix(".cpp").read_text() == source  # readable next to the library

    compiles: list[Path] = []
    real_compile = cpp_build._compile
    monkeypatch.setattr(
        cpp_build, "_compile", lambda c, s, stem: (compiles.append(stem), real_compile(c, s, stem))
    )
    cpp_build.load_kernels(
        cpp_library([kernel], source=source), tmp_path
    )  # a cache hit: nothing compiles
    assert compiles == []
    damaged = tmp_path / "damaged"
    damaged.write_bytes(b"not a library")
    os.replace(damaged, library)  # a new file: the loaded one stays intact in this process
    launch = cpp_build.load_kernels(cpp_library([kernel], source=source), tmp_path)["tiny"]
    assert len(compiles) == 1  # the damaged entry was rebuilt
    launch(out, a * 2)
    assert torch.equal(out, a * 2 + 1)

    broken = source.replace("const float t0", "const floot t0", 1)
    with pytest.raises(KernelBuildError) as error:
        cpp_build.build(broken, "broken", tmp_path)
    message = str(error.value)
    assert isinstance(error.value, BackendError)
    assert str(tmp_path / "cpp") in message and "broken_" in message and ".cpp" in message
    assert "floot" in message and "error" in message


def test_second_process_loads_from_the_cache(tmp_path: Path) -> None:
    kernel = _tiny_kernel("tiny_shared")
    source = generate_cpp([kernel], threads=1)
    cpp_build.load_kernels(cpp_library([kernel], source=source), tmp_path)
    script = (
        "import sys\nfrom kiln.runtime import cpp_build\n"
        "cpp_build._compile = None  # a compile would fail: the cache must serve it\n"
        "cpp_build.build(open(sys.argv[1]).read(), 'tiny_shared', sys.argv[2], ['tiny_shared'])\n"
        "print('ok')\n"
    )
    (tmp_path / "source.cpp").write_text(source)
    result = _python("-c", script, str(tmp_path / "source.cpp"), str(tmp_path))
    assert result.stdout.strip() == "ok", result.stderr


def test_flag_fallbacks_and_missing_openmp_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = _tiny_kernel("fallback")
    source = generate_cpp([kernel], threads=2)
    monkeypatch.setattr(cpp_build, "FLAG_PLANS", (("-O3", "-fno-such-flag-kiln"), ("-O2",)))
    monkeypatch.setattr(cpp_build, "_warned_no_openmp", False)
    with pytest.warns(UserWarning, match="without OpenMP"):
        launch = cpp_build.load_kernels(cpp_library([kernel], source=source), tmp_path)["fallback"]
    a, out = torch.arange(4.0), torch.empty(4)
    launch(out, a)
    assert torch.equal(out, a + 1)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        launch(out)


def test_missing_compiler_and_debug_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _tiny_kernel("debugged")
    source = generate_cpp([kernel], threads=1)
    monkeypatch.setattr(config, "debug_dir", str(tmp_path / "debug"))
    cpp_build.load_kernels(cpp_library([kernel], source=source), tmp_path)
    assert (tmp_path / "debug" / "debugged.cpp").read_text() == source
    monkeypatch.setattr(cpp_build, "COMPILER", "kiln-no-such-compiler")
    assert not cpp_build.cpp_compiler_available()
    with pytest.raises(CompilerNotFoundError, match="not on PATH"):
        cpp_build.build(source, "debugged", tmp_path)


@pytest.mark.parametrize(("rows", "cols"), [(40, 33), (300, 77), (4096, 20)])
def test_column_reductions_vectorize_across_rows(rows: int, cols: int) -> None:
    """Sums over a leading dim (bias gradients): rows x are contiguous in memory, so blocks of
    rows are reduced side by side; a row-shaped store (g * 2) rides in the same loop."""
    x, r = var("x", rows), var("r", cols)
    at = r * rows + x  # g is [cols, rows]: reducing its dim 0
    g = load(buffer("g", (cols, rows), F32), at)
    y = load(buffer("y", (cols, rows), F32), at)
    total = Reduce(F32, ReduceKind.SUM, g)
    peak = Reduce(F32, ReduceKind.MAX, apply(Op.MUL, g, y))
    stores = [
        Store(buffer("total", (rows,), F32), x, total),
        Store(buffer("mean", (rows,), F32), x, apply(Op.DIV, total, const(float(cols)))),
        Store(buffer("peak", (rows,), F32), x, peak),
        Store(buffer("twice", (cols, rows), F32), at, apply(Op.MUL, g, const(2.0))),
    ]
    kernel = Kernel(f"columns_{rows}x{cols}", rows, cols, stores)
    assert "acc0[x - x0] += t" in generate_cpp([kernel], threads=2)
    g_tensor = torch.randn(cols, rows)
    g_tensor[3, 5] = math.nan
    tensors = run(kernel, {"g": g_tensor, "y": torch.randn(cols, rows)})
    g_, y_ = tensors["g"], tensors["y"]
    assert_close(tensors["total"], g_.sum(0), 1e-5, 1e-5)
    assert_close(tensors["mean"], g_.mean(0), 1e-5, 1e-5)
    assert_close(tensors["peak"], (g_ * y_).amax(0), 0, 0)
    assert_close(tensors["twice"], g_ * 2, 0, 0)


@pytest.mark.parametrize(("rows", "cols"), [(20, 7), (300, 77)])
def test_column_reductions_with_phases(rows: int, cols: int) -> None:
    """Normalization along columns (a BatchNorm's statistics over channels-last ``[N*H*W, C]``):
    the sum, then the centered sum of squares that reads the mean, then the normalized
    values, each phase one ``r`` loop over a block of rows side by side."""
    x, r = var("x", rows), var("r", cols)
    at = r * rows + x  # "in" is [cols, rows]: the rows x are contiguous
    value = load(buffer("in", (cols, rows), F32), at)
    mean = apply(Op.DIV, Reduce(F32, ReduceKind.SUM, value), const(float(cols)))
    centered = apply(Op.SUB, value, mean)
    squares = Reduce(F32, ReduceKind.SUM, apply(Op.MUL, centered, centered))
    rstd = apply(Op.RSQRT, apply(Op.ADD, apply(Op.DIV, squares, const(float(cols))), const(1e-5)))
    stores = [
        Store(buffer("out", (cols, rows), F32), at, apply(Op.MUL, centered, rstd)),
        Store(buffer("mean", (rows,), F32), x, mean),
        Store(buffer("rstd", (rows,), F32), x, rstd),
        Store(buffer("twice", (cols, rows), F32), at, apply(Op.MUL, value, const(2.0))),
    ]
    kernel = Kernel(f"column_norm_{rows}x{cols}", rows, cols, stores)
    source = generate_cpp([kernel], threads=2)
    assert "x0 += " in source and source.count("for (int32_t r = 0;") == 3
    data = torch.randn(cols, rows) * 2 + 1
    tensors = run(kernel, {"in": data})
    assert_close(tensors["mean"], data.mean(0), 1e-5, 1e-5)
    rstd = torch.rsqrt(data.var(0, unbiased=False) + 1e-5)
    assert_close(tensors["rstd"], rstd, 1e-4, 1e-5)
    assert_close(tensors["out"], (data - data.mean(0)) * rstd, 1e-4, 1e-4)
    assert_close(tensors["twice"], data * 2, 0, 0)
