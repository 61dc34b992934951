"""The Triton code generator and runtime, on CPU tensors through ``TRITON_INTERPRET=1``.

Kernels are built by hand from the loop-level IR, generated for the interpreter, written to a
per-run cache and launched on CPU tensors; results are compared with the registry rows'
reference implementations (eager PyTorch) on fresh random inputs. Shapes stay small and blocks
big: the interpreter costs milliseconds per program instance.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kiln  # noqa: F401  (registers the op rows)
from kiln.codegen.triton import (
    Blocks,
    Form,
    TritonSource,
    UnsupportedKernel,
    choose_blocks,
    generate_triton,
)
from kiln.config import config
from kiln.errors import BackendError
from kiln.ir.op import Op, Tag, op_def, registered_ops
from kiln.ops.attrs import ArgReduceAttrs, ConvertAttrs, ReduceAttrs
from kiln.schedule.index import Index, decompose, indirect, linear, var
from kiln.schedule.loops import (
    Apply,
    Buffer,
    BufferKind,
    Const,
    Expr,
    IndexValue,
    Kernel,
    Load,
    Rand,
    Reduce,
    ReduceKind,
    Store,
)
from kiln.schedule.program import kernel_arguments

triton = pytest.importorskip("triton")
from kiln.runtime import triton_build  # noqa: E402  (needs triton)

CPU = torch.device("cpu")
F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
I8, U8, I32, I64, BOOL = torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool


@pytest.fixture(autouse=True, scope="module")
def _cache_dir() -> Iterator[None]:
    """Generated modules go to a per-run directory, not the user's cache."""
    previous = config.cache_dir
    with tempfile.TemporaryDirectory(prefix="kiln-test-triton-") as directory:
        config.cache_dir = directory
        yield
    config.cache_dir = previous


# ---------------------------------------------------------------------------------------------
# building and running kernels by hand


def buffer(name: str, shape: Sequence[int], dtype: torch.dtype) -> Buffer:
    return Buffer(name, tuple(shape), dtype, CPU, BufferKind.TEMP)


def apply(op: Op, *args: Expr, dtype: torch.dtype | None = None) -> Apply:
    return Apply(dtype or args[-1].dtype, op, tuple(args))


def const(value: bool | int | float, dtype: torch.dtype = F32) -> Const:
    return Const(dtype, value)


def load(source: Buffer, offset: Index, mask: Expr | None = None, other: Any = 0) -> Load:
    return Load(source.dtype, source, offset, mask, other)


def pointwise(name: str, x: Index, values: dict[str, Expr]) -> Kernel:
    """A kernel over ``x`` storing each value into a new buffer named by its key."""
    n = max(1, *(atom.size for atom, _ in x.terms)) if x.terms else 1
    return Kernel(name, n, 1, [Store(buffer(k, (n,), v.dtype), x, v) for k, v in values.items()])


def outputs(kernel: Kernel) -> dict[str, torch.Tensor]:
    """Uninitialized tensors for the buffers ``kernel`` stores to."""
    return {s.buffer.name: torch.empty(s.buffer.shape, dtype=s.buffer.dtype) for s in kernel.stores}


def run(
    kernel: Kernel,
    tensors: dict[str, torch.Tensor],
    seed: int | None = None,
    blocks: Blocks | None = None,
) -> TritonSource:
    """Generate ``kernel`` for the interpreter and run it on tensors named like its buffers."""
    source = generate_triton(kernel, interpret=True, blocks=blocks)
    launch = triton_build.build_triton(source)
    arguments = [tensors[b.name] for b in kernel_arguments(kernel)]
    launch(*arguments, seed=seed)
    return source


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if not actual.dtype.is_floating_point:
        assert torch.equal(actual, expected), (actual, expected)
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# every elementwise op x every dtype of its row

TRANSCENDENTAL = {
    Op.EXP, Op.EXP2, Op.EXPM1, Op.LOG, Op.LOG1P, Op.LOG2, Op.SIN, Op.COS, Op.TAN, Op.TANH,
    Op.ASIN, Op.ACOS, Op.ATAN, Op.SINH, Op.COSH, Op.ERF, Op.ERFINV, Op.SIGMOID, Op.POW,
    Op.ATAN2, Op.RSQRT,
}  # fmt: skip
DRAWS = 4  # samples drawn per case, concatenated: 4 x 15 elements
ELEMENTWISE = [row for row in registered_ops() if Tag.ELEMENTWISE in row.tags]
CASES = [(row.op, dtype) for row in ELEMENTWISE for dtype in sorted(row.dtypes, key=str)]


def _draw(op: Op, dtype: torch.dtype, attrs: Any) -> list[torch.Tensor]:
    """Fresh operands from the row's first sample (or the one with ``attrs``), drawn DRAWS
    times and concatenated."""
    draws = []
    for _ in range(DRAWS):
        samples = op_def(op).samples(dtype, CPU)  # type: ignore[misc]
        sample = next((s for s in samples if s.attrs == attrs), samples[0])
        draws.append([t.reshape(-1) for t in sample.inputs])
    return [torch.cat(parts) for parts in zip(*draws, strict=True)]


def _scalar(op: Op, dtype: torch.dtype) -> bool | int | float:
    if dtype == BOOL:
        return True
    return 1.5 if dtype.is_floating_point else (2 if op in {Op.SHIFT_LEFT, Op.SHIFT_RIGHT} else 3)


def _tolerance(op: Op, dtype: torch.dtype) -> tuple[float, float]:
    if dtype in {BF16, F16}:
        return (1e-2, 1e-2) if dtype == BF16 else (1e-3, 1e-3)
    return (1e-4, 1e-6) if op in TRANSCENDENTAL else (1e-5, 1e-6)


def _targets(op: Op, dtype: torch.dtype) -> list[Any]:
    if op is Op.CONVERT:
        return [s.attrs for s in op_def(op).samples(dtype, CPU)] + [ConvertAttrs(F64)]  # type: ignore[misc]
    return [None]


@pytest.mark.parametrize(("op", "dtype"), CASES, ids=[f"{o.printed_name}-{d}" for o, d in CASES])
def test_elementwise_op_matches_its_row(op: Op, dtype: torch.dtype) -> None:
    """out0 = op(in0, ...) and, for binary ops, out1 = op(in0, scalar) and out2 = op(scalar,
    in1): one kernel per (op, dtype, convert target)."""
    for attrs in _targets(op, dtype):
        inputs = _draw(op, dtype, attrs)
        n = inputs[0].numel()
        x = var("x", n)
        loads = [load(buffer(f"in{i}", (n,), t.dtype), x) for i, t in enumerate(inputs)]
        expected = [op_def(op).impl(attrs, *inputs)]
        out_dtype = expected[0].dtype
        stores = [Store(buffer("out0", (n,), out_dtype), x, apply(op, *loads, dtype=out_dtype))]
        if Tag.BINARY in op_def(op).tags:
            scalar = _scalar(op, dtype)
            expected.append(op_def(op).impl(attrs, inputs[0], scalar))
            value = apply(op, loads[0], const(scalar, dtype), dtype=out_dtype)
            stores.append(Store(buffer("out1", (n,), out_dtype), x, value))
            expected.append(op_def(op).impl(attrs, scalar, inputs[1]))
            value = apply(op, const(scalar, dtype), loads[1], dtype=out_dtype)
            stores.append(Store(buffer("out2", (n,), out_dtype), x, value))
        kernel = Kernel(
            f"{op.printed_name}_{str(dtype)[6:]}", n, 1, stores, [f"{op.printed_name}  t.py:1"]
        )
        tensors = {f"in{i}": t for i, t in enumerate(inputs)}
        tensors.update({f"out{i}": torch.empty_like(e) for i, e in enumerate(expected)})
        run(kernel, tensors)
        rtol, atol = (0.0, 0.0) if attrs else _tolerance(op, dtype)
        for i, wanted in enumerate(expected):
            assert_close(tensors[f"out{i}"], wanted, rtol, atol)


SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1e-30, 3.0, 100.0]
SPECIAL_RHS = [1.0, math.nan, 2.0, 0.0, 3.0, -0.0, math.inf, -1.5, 2.0, 0.0, -7.0, 1.0]


@pytest.mark.parametrize("dtype", [F32, F64])
def test_float_ops_keep_nan_inf_semantics(dtype: torch.dtype) -> None:
    """Special values through every float unary op, NaN through the binary extrema and the
    rounding divisions, as eager gives them."""
    rhs = torch.tensor(SPECIAL_RHS, dtype=dtype)
    n = rhs.numel()
    x = var("x", n)
    a, b = load(buffer("in0", (n,), dtype), x), load(buffer("in1", (n,), dtype), x)
    unary = [r.op for r in ELEMENTWISE if Tag.UNARY in r.tags and F32 in r.dtypes]
    unary.remove(Op.CONVERT)
    binary = [Op.MAXIMUM, Op.MINIMUM, Op.FLOOR_DIV, Op.REMAINDER, Op.FMOD, Op.POW, Op.DIV, Op.ATAN2]
    bools = {Op.ISNAN, Op.ISINF, Op.LOGICAL_NOT}
    values = {
        f"u{i}": apply(op, a, dtype=BOOL if op in bools else dtype) for i, op in enumerate(unary)
    }
    values.update({f"b{i}": apply(op, a, b) for i, op in enumerate(binary)})
    kernel = pointwise("special_values", x, values)
    tensors = {"in0": torch.tensor(SPECIAL, dtype=dtype), "in1": rhs, **outputs(kernel)}
    run(kernel, tensors)
    for i, op in enumerate(unary):
        rtol, atol = _tolerance(op, F32)
        assert_close(tensors[f"u{i}"], op_def(op).impl(None, tensors["in0"]), rtol, atol)
    for i, op in enumerate(binary):
        assert_close(tensors[f"b{i}"], op_def(op).impl(None, tensors["in0"], rhs), 1e-5, 1e-6)


def test_interpreter_math_is_fp32_accurate_over_wide_ranges() -> None:
    """The interpreter's compositions (Kahan expm1/log1p, Cephes atan, Giles erfinv, ...)
    against eager on wide and tiny arguments."""
    ranges = {
        Op.EXPM1: (-20.0, 20.0), Op.LOG1P: (-0.999, 1e4), Op.TANH: (-12.0, 12.0),
        Op.SINH: (-20.0, 20.0), Op.COSH: (-20.0, 20.0), Op.ATAN: (-1e3, 1e3),
        Op.ASIN: (-1.0, 1.0), Op.ACOS: (-1.0, 1.0), Op.ERFINV: (-0.9999, 0.9999),
        Op.ROUND: (-1e3, 1e3), Op.TAN: (-1.5, 1.5),
    }  # fmt: skip
    n = 4000
    x = var("x", n)
    inputs = {}
    for i, (low, high) in enumerate(ranges.values()):
        values = torch.linspace(low, high, n, dtype=F64).to(F32)
        tiny = torch.logspace(-30, -1, 200) * torch.sign(torch.randn(200))
        values[:200] = tiny.clamp(low, high)
        inputs[f"in{i}"] = values
    loads = [load(buffer(f"in{i}", (n,), F32), x) for i in range(len(ranges))]
    kernel = pointwise(
        "wide_math", x, {f"out{i}": apply(op, loads[i]) for i, op in enumerate(ranges)}
    )
    tensors = {**inputs, **outputs(kernel)}
    run(kernel, tensors)
    for i, op in enumerate(ranges):
        expected = op_def(op).impl(None, inputs[f"in{i}"].double()).float()
        assert_close(tensors[f"out{i}"], expected, 2e-6 if op is not Op.ERFINV else 1e-5, 1e-6)


def test_pow_with_constant_exponents_and_negative_bases() -> None:
    n = 64
    x = var("x", n)
    base = torch.randn(n) * 3
    base[:4] = torch.tensor([0.0, -0.0, -1.0, 1.0])
    exponents = [2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 1.0, 0.0, 2.5, -3.0]
    a = load(buffer("a", (n,), F32), x)
    kernel = pointwise(
        "pows", x, {f"o{i}": apply(Op.POW, a, const(e)) for i, e in enumerate(exponents)}
    )
    tensors = {"a": base, **outputs(kernel)}
    run(kernel, tensors)
    for i, e in enumerate(exponents):
        assert_close(tensors[f"o{i}"], torch.pow(base, e), 1e-5, 1e-6)


def test_integer_division_family_by_zero_does_not_crash() -> None:
    n = 8
    x = var("x", n)
    a, b = (load(buffer(name, (n,), I32), x) for name in ("a", "b"))
    ops = [Op.FLOOR_DIV, Op.REMAINDER, Op.FMOD]
    kernel = pointwise("divide_by_zero", x, {f"o{i}": apply(op, a, b) for i, op in enumerate(ops)})
    tensors = {
        "a": torch.arange(n, dtype=I32) - 4,
        "b": torch.zeros(n, dtype=I32),
        **outputs(kernel),
    }
    run(kernel, tensors)  # any values; the process survives


def test_converts_round_like_eager() -> None:
    """bf16/fp16 round to nearest even (the interpreter's own cast truncates), float -> int
    truncates, int -> bool is != 0, and int8/uint8 load and store."""
    n = 10
    x = var("x", n)
    ties = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 2.5, -2.5, 1e-3, 3e38, -7.9, 0.0, 7.9]
    )
    a = load(buffer("a", (n,), F32), x)
    tripled = apply(Op.MUL, load(buffer("s", (n,), I8), x), const(3, I8))
    values = {
        "bf": apply(Op.CONVERT, a, dtype=BF16),
        "hf": apply(Op.CONVERT, a, dtype=F16),
        "back": apply(Op.CONVERT, apply(Op.CONVERT, a, dtype=BF16), dtype=F32),
        "ints": apply(Op.CONVERT, a, dtype=I32),
        "flags": apply(Op.CONVERT, a, dtype=BOOL),
        "u8": apply(Op.CONVERT, tripled, dtype=U8),
    }
    kernel = pointwise("converts", x, values)
    tensors = {"a": ties, "s": torch.arange(n, dtype=I8) * 20 - 90, **outputs(kernel)}
    run(kernel, tensors)
    assert torch.equal(tensors["bf"], ties.to(BF16))
    assert torch.equal(tensors["hf"], ties.to(F16))
    assert torch.equal(tensors["back"], ties.to(BF16).float())
    assert torch.equal(tensors["ints"][:6], ties[:6].to(I32))
    assert torch.equal(tensors["flags"], ties != 0)
    assert torch.equal(tensors["u8"], (tensors["s"] * 3).to(U8))


# ---------------------------------------------------------------------------------------------
# shapes, layouts, masks, gathers


def _gelu_kernel(n: int, dtype: torch.dtype) -> Kernel:
    """out = gelu(a + b) * 2 + y."""
    x = var("x", n)
    a, b, y = (buffer(name, (n,), dtype) for name in ("a", "b", "y"))
    v = apply(Op.ADD, load(a, x), load(b, x))
    inner = apply(Op.ERF, apply(Op.MUL, v, const(0.7071067811865476, dtype)))
    gelu = apply(
        Op.MUL, apply(Op.MUL, v, const(0.5, dtype)), apply(Op.ADD, inner, const(1.0, dtype))
    )
    value = apply(Op.ADD, apply(Op.MUL, gelu, const(2.0, dtype)), load(y, x))
    fused = ["add  model.py:3", "gelu  model.py:4", "mul  model.py:4", "add  model.py:5"]
    return Kernel(f"gelu_{n}", n, 1, [Store(buffer("out", (n,), dtype), x, value)], fused)


@pytest.mark.parametrize("n", [0, 1, 5, 1000])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_fused_pointwise_on_any_size(n: int, dtype: torch.dtype) -> None:
    kernel = _gelu_kernel(n, dtype)
    tensors = {name: torch.randn(n).to(dtype) for name in ("a", "b", "y")}
    tensors["out"] = torch.full((n,), 7.0, dtype=dtype)
    blocks = Blocks(Form.POINTWISE, 256) if n == 1000 else None  # four programs, a tail
    run(kernel, tensors, blocks=blocks)
    a, b, y = (tensors[k].float() for k in ("a", "b", "y"))
    expected = (torch.nn.functional.gelu(a + b) * 2 + y).to(dtype)
    tol = {F32: 1e-5, BF16: 1e-2, F16: 1e-3}[dtype]
    assert_close(tensors["out"], expected, tol, tol)


def test_transposed_broadcast_and_offset_loads() -> None:
    """out[i, j] = a[j, i] (a transposed view) + bias[j] + b[3 + 2*(i*7 + j)]."""
    rows, cols = 5, 7
    x = var("x", rows * cols)
    i, j = decompose(x, (rows, cols))
    a, bias = buffer("a", (cols, rows), F32), buffer("bias", (cols,), F32)
    b = buffer("b", (3 + 2 * rows * cols,), F32)
    value = apply(
        Op.ADD,
        apply(Op.ADD, load(a, linear((j, i), (rows, 1))), load(bias, j)),
        load(b, linear((i, j), (2 * cols, 2), offset=3)),
    )
    kernel = Kernel(
        "transposed", rows * cols, 1, [Store(buffer("out", (rows, cols), F32), x, value)]
    )
    tensors = {
        "a": torch.randn(cols, rows),
        "bias": torch.randn(cols),
        "b": torch.randn(3 + 2 * rows * cols),
    }
    tensors["out"] = torch.empty(rows, cols)
    run(kernel, tensors)
    expected = tensors["a"].t() + tensors["bias"] + tensors["b"][3::2].reshape(rows, cols)
    assert_close(tensors["out"], expected, 1e-6, 1e-6)


def test_masked_load_pads_and_indirect_load_gathers() -> None:
    """pad: out[i] = a[i - 2] if 2 <= i < n + 2 else -1; gather: g[r, c] = table[idx[r], c]
    with negative indices wrapped."""
    n = 6
    x = var("x", n + 4)
    position = IndexValue(I64, x)
    inside = apply(
        Op.LOGICAL_AND,
        apply(Op.GE, position, const(2, I64), dtype=BOOL),
        apply(Op.LT, position, const(n + 2, I64), dtype=BOOL),
        dtype=BOOL,
    )
    pad = Store(buffer("pad", (n + 4,), F32), x, load(buffer("a", (n,), F32), x - 2, inside, -1.0))
    rows, vocab, width = 5, 9, 3
    g = var("x", rows * width)
    r, c = decompose(g, (rows, width))
    raw = load(buffer("idx", (rows,), I64), r)
    wrapped = apply(
        Op.WHERE,
        apply(Op.LT, raw, const(0, I64), dtype=BOOL),
        apply(Op.ADD, raw, const(vocab, I64)),
        raw,
    )
    gathered = load(buffer("table", (vocab, width), F32), indirect(wrapped, vocab) * width + c)
    gather = Store(buffer("g", (rows, width), F32), g, gathered)
    tensors = {
        "a": torch.randn(n),
        "idx": torch.tensor([3, -1, 0, 8, -9]),
        "table": torch.randn(vocab, width),
        "pad": torch.empty(n + 4),
        "g": torch.empty(rows, width),
    }
    run(Kernel("pad", n + 4, 1, [pad]), tensors)
    run(Kernel("gather", rows * width, 1, [gather]), tensors)
    assert_close(tensors["pad"], torch.nn.functional.pad(tensors["a"], (2, 2), value=-1.0), 0, 0)
    assert_close(tensors["g"], tensors["table"][tensors["idx"]], 0, 0)


def test_zero_dim_operands_broadcast_over_blocks() -> None:
    """where(t > threshold, a, 2.5) with a 0-d threshold and flag: scalar comparisons meet
    blocks (the interpreter needs its 0-d bools rebuilt to broadcast them)."""
    n = 12
    x = var("x", n)
    threshold = load(buffer("t", (), F32), Index())
    flag = load(buffer("f", (), BOOL), Index())
    above = apply(Op.GT, threshold, const(0.0), dtype=BOOL)
    both = apply(Op.LOGICAL_AND, above, flag, dtype=BOOL)
    a = load(buffer("a", (n,), F32), x)
    positive = apply(Op.GT, a, const(0.0), dtype=BOOL)
    values = {
        "o": apply(Op.WHERE, above, a, const(2.5)),
        "p": apply(Op.WHERE, both, const(-1.0), a),
        "q": apply(Op.ATAN2, threshold, a),
        "r": apply(Op.LOGICAL_AND, above, positive, dtype=BOOL),
    }
    kernel = pointwise("zero_dim", x, values)
    for t, f in ((1.0, True), (-1.0, True), (1.0, False)):
        tensors = {"t": torch.tensor(t), "f": torch.tensor(f), "a": torch.randn(n)}
        tensors.update(outputs(kernel))
        run(kernel, tensors)
        a_ = tensors["a"]
        assert_close(tensors["o"], a_ if t > 0 else torch.full((n,), 2.5), 0, 0)
        assert_close(tensors["p"], torch.full((n,), -1.0) if t > 0 and f else a_, 0, 0)
        assert_close(tensors["q"], torch.atan2(torch.tensor(t), a_), 1e-5, 1e-6)
        assert_close(tensors["r"], (a_ > 0) & (t > 0), 0, 0)


def test_index_values_iota_and_scalar_outputs() -> None:
    """iota as float, a constant stored over a row, and a 0-d output (xnumel == 1)."""
    n = 9
    x = var("x", n)
    iota = Store(
        buffer("iota", (n,), F32), x, apply(Op.CONVERT, IndexValue(I64, x * 2 + 1), dtype=F32)
    )
    fill = Store(buffer("fill", (n,), I64), x, const(-3, I64))
    tensors = {"iota": torch.empty(n), "fill": torch.empty(n, dtype=I64), "s": torch.empty(())}
    run(Kernel("iota", n, 1, [iota, fill]), tensors)
    scalar = Store(buffer("s", (), F32), Index(), apply(Op.EXP, const(1.0)))
    run(Kernel("scalar", 1, 1, [scalar]), tensors)
    assert_close(tensors["iota"], torch.arange(n) * 2.0 + 1, 0, 0)
    assert_close(tensors["fill"], torch.full((n,), -3), 0, 0)
    assert_close(tensors["s"], torch.tensor(math.e), 1e-6, 0)


# ---------------------------------------------------------------------------------------------
# reductions

REDUCE_ROWS = {
    ReduceKind.SUM: Op.SUM,
    ReduceKind.PROD: Op.PROD,
    ReduceKind.MAX: Op.AMAX,
    ReduceKind.MIN: Op.AMIN,
    ReduceKind.ARGMAX: Op.ARGMAX,
    ReduceKind.ARGMIN: Op.ARGMIN,
}
SHAPES = [(3, 5), (4, 1), (1, 7), (6, 33)]
FORMS = {"persistent": None, "looped": Blocks(Form.LOOPED, 2, 8, 4)}


def _reference(kind: ReduceKind, data: torch.Tensor) -> torch.Tensor:
    row = op_def(REDUCE_ROWS[kind])
    if kind in (ReduceKind.ARGMAX, ReduceKind.ARGMIN):
        return row.impl(ArgReduceAttrs(1), data)
    return row.impl(ReduceAttrs((1,)), data)


def _row_data(shape: tuple[int, int], dtype: torch.dtype, kind: ReduceKind) -> torch.Tensor:
    if dtype.is_floating_point:
        data = torch.randn(shape) * (0.9 if kind is ReduceKind.PROD else 3)
        data = data.round(decimals=1) if kind in (ReduceKind.ARGMAX, ReduceKind.ARGMIN) else data
        return data.to(dtype)  # rounding makes ties: argmax must pick the first
    return torch.randint(-4, 5, shape, dtype=dtype)


def _reduce_kernel(
    kind: ReduceKind, shape: tuple[int, int], dtype: torch.dtype, out: torch.dtype
) -> Kernel:
    rows, cols = shape
    x, r = var("x", rows), var("r", cols)
    value = Reduce(out, kind, load(buffer("a", shape, dtype), x * cols + r))
    return Kernel(
        f"{kind.value}_{rows}x{cols}", rows, cols, [Store(buffer("out", (rows,), out), x, value)]
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", list(ReduceKind))
@pytest.mark.parametrize("dtype", [F32, BF16, I32])
def test_reductions_match_their_rows(form: str, kind: ReduceKind, dtype: torch.dtype) -> None:
    for shape in SHAPES:
        data = _row_data(shape, dtype, kind)
        expected = _reference(kind, data)
        tensors = {"a": data, "out": torch.empty_like(expected)}
        run(_reduce_kernel(kind, shape, dtype, expected.dtype), tensors, blocks=FORMS[form])
        tol = 1e-2 if dtype == BF16 else 1e-5
        assert_close(tensors["out"], expected, tol, tol)


@pytest.mark.parametrize("form", FORMS)
def test_reductions_propagate_nan_and_pick_first_extreme(form: str) -> None:
    data = torch.randn(6, 11)
    data[0, 3] = data[0, 7] = math.nan  # max/min NaN; argmax/argmin: the first NaN
    data[1] = -math.inf  # argmax of an all -inf row: 0
    data[2] = math.inf
    data[3, 10] = math.nan
    data[4, :] = 2.0
    for kind in (ReduceKind.MAX, ReduceKind.MIN, ReduceKind.ARGMAX, ReduceKind.ARGMIN):
        expected = _reference(kind, data)
        tensors = {"a": data, "out": torch.empty_like(expected)}
        run(_reduce_kernel(kind, (6, 11), F32, expected.dtype), tensors, blocks=FORMS[form])
        assert_close(tensors["out"], expected, 0, 0)


def test_bool_and_int_sums_count_in_int64_and_empty_rows_give_identities() -> None:
    flags = torch.rand(4, 9) > 0.5
    x, r = var("x", 4), var("r", 9)
    total = Reduce(I64, ReduceKind.SUM, load(buffer("f", (4, 9), BOOL), x * 9 + r))
    kernel = Kernel("count", 4, 9, [Store(buffer("n", (4,), I64), x, total)])
    tensors = {"f": flags, "n": torch.empty(4, dtype=I64)}
    run(kernel, tensors)
    assert_close(tensors["n"], flags.sum(1), 0, 0)
    empty = torch.empty(3, 0)
    for kind, wanted in ((ReduceKind.SUM, 0.0), (ReduceKind.PROD, 1.0)):
        tensors = {"a": empty, "out": torch.empty(3)}
        run(_reduce_kernel(kind, (3, 0), F32, F32), tensors)
        assert_close(tensors["out"], torch.full((3,), wanted), 0, 0)


def test_full_reduction_to_a_scalar_and_zero_rows() -> None:
    """sum over everything (xnumel == 1, store at a constant offset); zero rows launch nothing."""
    n = 50
    data = torch.randn(n)
    total = Reduce(F32, ReduceKind.SUM, load(buffer("a", (n,), F32), var("r", n)))
    tensors = {"a": data, "s": torch.empty(())}
    run(Kernel("total", 1, n, [Store(buffer("s", (), F32), Index(), total)]), tensors)
    assert_close(tensors["s"], data.sum(), 1e-5, 1e-5)
    tensors = {"a": torch.empty(0, 4), "out": torch.empty(0)}
    run(_reduce_kernel(ReduceKind.SUM, (0, 4), F32, F32), tensors)


def _softmax_kernel(rows: int, cols: int, dtype: torch.dtype) -> Kernel:
    x, r = var("x", rows), var("r", cols)
    v = load(buffer("a", (rows, cols), dtype), x * cols + r)
    shifted = apply(Op.SUB, v, Reduce(dtype, ReduceKind.MAX, v))
    e = apply(Op.EXP, shifted)
    value = apply(Op.DIV, e, Reduce(dtype, ReduceKind.SUM, e))
    fused = [
        "amax  model.py:7",
        "sub  model.py:7",
        "exp  model.py:7",
        "sum  model.py:7",
        "div  model.py:7",
    ]
    return Kernel(
        "softmax_0",
        rows,
        cols,
        [Store(buffer("out", (rows, cols), dtype), x * cols + r, value)],
        fused,
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_softmax_nests_reductions(form: str, dtype: torch.dtype) -> None:
    rows, cols = 7, 45
    data = (torch.randn(rows, cols) * 4).to(dtype)
    data[2, 5] = math.nan if form == "looped" else data[2, 5]
    tensors = {"a": data, "out": torch.empty_like(data)}
    source = run(_softmax_kernel(rows, cols, dtype), tensors, blocks=FORMS[form])
    expected = torch.softmax(data.float(), 1).to(dtype)
    tol = 1e-2 if dtype == BF16 else 1e-5
    assert_close(tensors["out"], expected, tol, tol)
    if form == "persistent":  # the row is read once and exp'd once per element
        assert source.source.count("tl.load(") == 1 and source.source.count("tl.exp(") == 1
    else:
        assert source.source.count("for roffset in range(0, rnumel, RBLOCK):") == 3


def _layer_norm_kernel(rows: int, cols: int, dtype: torch.dtype) -> Kernel:
    """mean and rstd stored per row; y = (x - mean) * rstd * w + b stored per element."""
    x, r = var("x", rows), var("r", cols)
    v = load(buffer("a", (rows, cols), dtype), x * cols + r)
    mean = apply(
        Op.DIV, Reduce(F32, ReduceKind.SUM, apply(Op.CONVERT, v, dtype=F32)), const(float(cols))
    )
    centered = apply(Op.SUB, apply(Op.CONVERT, v, dtype=F32), mean)
    variance = apply(
        Op.DIV, Reduce(F32, ReduceKind.SUM, apply(Op.MUL, centered, centered)), const(float(cols))
    )
    rstd = apply(Op.RSQRT, apply(Op.ADD, variance, const(1e-5)))
    w, b = load(buffer("w", (cols,), F32), r), load(buffer("b", (cols,), F32), r)
    y = apply(Op.ADD, apply(Op.MUL, apply(Op.MUL, centered, rstd), w), b)
    stores = [
        Store(buffer("y", (rows, cols), dtype), x * cols + r, apply(Op.CONVERT, y, dtype=dtype)),
        Store(buffer("mean", (rows,), F32), x, mean),
        Store(buffer("rstd", (rows,), F32), x, rstd),
    ]
    return Kernel("layer_norm_0", rows, cols, stores, ["layer_norm  model.py:9"])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_layer_norm_stores_rows_and_elements(form: str, dtype: torch.dtype) -> None:
    rows, cols = 5, 37
    data = (torch.randn(rows, cols) * 2 + 1).to(dtype)
    w, b = torch.randn(cols), torch.randn(cols)
    tensors = {
        "a": data,
        "w": w,
        "b": b,
        "y": torch.empty_like(data),
        "mean": torch.empty(rows),
        "rstd": torch.empty(rows),
    }
    run(_layer_norm_kernel(rows, cols, dtype), tensors, blocks=FORMS[form])
    ref = data.float()
    var_, mean = torch.var_mean(ref, 1, correction=0)
    expected = torch.nn.functional.layer_norm(ref, (cols,), w, b).to(dtype)
    tol = 1e-2 if dtype == BF16 else 1e-5
    assert_close(tensors["mean"], mean, 1e-5, 1e-5)
    assert_close(tensors["rstd"], torch.rsqrt(var_ + 1e-5), 1e-5, 1e-5)
    assert_close(tensors["y"], expected, tol, tol)


def test_column_sums_over_a_strided_dim() -> None:
    """sum over dim 0 of a [R, C] tensor: rows are strided, so the kernel loops along x-tiles."""
    rows, cols = 300, 6
    x, r = var("x", cols), var("r", rows)
    total = Reduce(F32, ReduceKind.SUM, load(buffer("a", (rows, cols), F32), r * cols + x))
    kernel = Kernel("column_sum", cols, rows, [Store(buffer("out", (cols,), F32), x, total)])
    assert choose_blocks(kernel, interpret=False).form is Form.LOOPED
    data = torch.randn(rows, cols)
    tensors = {"a": data, "out": torch.empty(cols)}
    run(kernel, tensors, blocks=choose_blocks(kernel, interpret=False))
    assert_close(tensors["out"], data.sum(0), 1e-5, 1e-5)


def test_gpu_spelling_runs_in_the_interpreter() -> None:
    """Kernels generated for the GPU (tl.reduce with NaN-propagating combines) compute the same
    results when they use no libdevice call; tiny blocks keep the interpreter's per-element
    combine loop short."""
    data = torch.randn(3, 6)
    data[1, 2] = math.nan
    for kind in (ReduceKind.MAX, ReduceKind.ARGMIN, ReduceKind.PROD):
        expected = _reference(kind, data)
        kernel = _reduce_kernel(kind, (3, 6), F32, expected.dtype)
        for blocks in (Blocks(Form.PERSISTENT, 1, 8, 1), Blocks(Form.LOOPED, 1, 4, 1)):
            source = generate_triton(kernel, interpret=False, blocks=blocks)
            assert "libdevice" not in source.source and "tl.reduce(" in source.source
            interpreted = dataclasses.replace(source, interpret=True)
            tensors = {"a": data, "out": torch.empty_like(expected)}
            triton_build.build_triton(interpreted)(tensors["out"], tensors["a"])
            assert_close(tensors["out"], expected, 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# random numbers


def _philox_uniform(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Philox-4x32-10 keyed by the seed's halves with counter (offset, 0, 0, 0): the contract
    both code generators follow (Triton's tl.rand)."""
    mask = np.uint64(0xFFFFFFFF)
    c0, c1 = offsets.astype(np.uint64), np.zeros_like(offsets, dtype=np.uint64)
    c2, c3 = c1.copy(), c1.copy()
    k0 = np.full_like(c0, seed & 0xFFFFFFFF)
    k1 = np.full_like(c0, (seed >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (
            (p2 >> np.uint64(32)) ^ c1 ^ k0,
            p2 & mask,
            (p0 >> np.uint64(32)) ^ c3 ^ k1,
            p0 & mask,
        )
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    signed = c0.astype(np.uint32).view(np.int32)
    signed = np.where(signed < 0, ~signed, signed)
    return signed.astype(np.float32) * np.float32(4.6566127342e-10)


def test_rand_follows_the_philox_contract_and_randn_is_normal() -> None:
    n, seed = 4096, 2**40 + 12345
    x = var("x", n)
    seed_buffer = buffer("seed", (), I64)
    stores = [
        Store(buffer("u", (n,), F32), x, Rand(F32, seed_buffer, x + 7)),
        Store(buffer("z", (n,), F32), x, Rand(F32, seed_buffer, x, normal=True)),
    ]
    kernel = Kernel("dropout_rng", n, 1, stores)
    tensors = {"u": torch.empty(n), "z": torch.empty(n)}
    run(kernel, tensors, seed=seed)
    expected = _philox_uniform(seed, np.arange(7, n + 7, dtype=np.int64))
    assert np.array_equal(tensors["u"].numpy(), expected)
    assert tensors["u"].min() >= 0.0 and tensors["u"].max() < 1.0
    assert abs(tensors["z"].mean()) < 0.1 and abs(tensors["z"].std() - 1) < 0.1
    again = {"u": torch.empty(n), "z": torch.empty(n)}
    run(kernel, again, seed=seed)
    assert torch.equal(again["u"], tensors["u"]) and torch.equal(again["z"], tensors["z"])
    run(kernel, again, seed=seed + 1)
    assert not torch.equal(again["u"], tensors["u"])


# ---------------------------------------------------------------------------------------------
# source text, heuristics and the runtime


def test_source_is_readable_and_names_what_it_fuses() -> None:
    source = generate_triton(_gelu_kernel(4096, BF16), interpret=False)
    text = source.source
    assert "def gelu_4096(out_ptr, y_ptr, b_ptr, a_ptr, XBLOCK: tl.constexpr):" in text
    assert "# fused:\n#   add  model.py:3\n#   gelu  model.py:4" in text
    assert "xmask" not in text  # 4096 % 1024 == 0: no predication
    assert ".to(tl.float32)" in text and ".to(tl.bfloat16)" in text
    assert source.arguments == ("out", "y", "b", "a") and source.grid == (4, 1, 1)
    assert (source.constexprs, source.num_warps) == ({"XBLOCK": 1024}, 4)
    compile(text, "gelu.py", "exec")  # valid Python


def test_module_docstring_example_is_what_the_generator_prints() -> None:
    import kiln.codegen.triton as module

    doc = module.__doc__ or ""
    example = doc[doc.index("    @triton.jit") : doc.index("with ``XBLOCK")].rstrip()
    expected = "\n".join(line.removeprefix("    ") for line in example.splitlines())
    source = generate_triton(_softmax_kernel(4096, 1000, BF16), interpret=False)
    assert expected in source.source
    assert (source.constexprs, source.num_warps) == ({"XBLOCK": 4, "RBLOCK": 1024}, 8)


def test_libdevice_only_outside_the_interpreter() -> None:
    n = 8
    x = var("x", n)
    a = load(buffer("a", (n,), F32), x)
    kernel = pointwise("tanh_erfinv", x, {"t": apply(Op.TANH, a), "e": apply(Op.ERFINV, a)})
    compiled = generate_triton(kernel, interpret=False).source
    interpreted = generate_triton(kernel, interpret=True).source
    assert "from triton.language.extra import libdevice" in compiled
    assert "libdevice.tanh(" in compiled and "libdevice.erfinv(" in compiled
    assert "libdevice" not in interpreted and "_kiln_tanh(" in interpreted


def test_block_heuristics() -> None:
    softmax = choose_blocks(_softmax_kernel(16384, 4096, BF16), interpret=False)
    assert softmax == Blocks(Form.PERSISTENT, 1, 4096, 8)
    small_rows = choose_blocks(_softmax_kernel(4096, 100, F32), interpret=False)
    assert (small_rows.form, small_rows.rblock, small_rows.xblock) == (Form.PERSISTENT, 128, 32)
    long_rows = choose_blocks(_softmax_kernel(64, 50000, F32), interpret=False)
    assert long_rows.form is Form.LOOPED and long_rows.xblock == 1
    pointwise = choose_blocks(_gelu_kernel(10**6, F32), interpret=False)
    assert pointwise == Blocks(Form.POINTWISE, 1024, 1, 4)
    assert choose_blocks(_gelu_kernel(5, F32), interpret=False) == Blocks(Form.POINTWISE, 8, 1, 1)


def test_64_bit_indexing_when_offsets_reach_2_to_the_31() -> None:
    big = _gelu_kernel(2**31 + 8, F32)
    assert "tl.program_id(0).to(tl.int64)" in generate_triton(big, interpret=False).source
    assert "to(tl.int64)" not in generate_triton(_gelu_kernel(2**20, F32), interpret=False).source
    rows = _softmax_kernel(70000, 40000, F32)
    text = generate_triton(rows, interpret=False).source
    assert "tl.program_id(0).to(tl.int64)" in text and "[None, :].to(tl.int64)" in text


def test_unsupported_dtypes_are_reported() -> None:
    n = 4
    x = var("x", n)
    kernel = Kernel(
        "complex",
        n,
        1,
        [Store(buffer("o", (n,), torch.complex64), x, load(buffer("a", (n,), torch.complex64), x))],
    )
    with pytest.raises(UnsupportedKernel, match="complex64"):
        generate_triton(kernel, interpret=True)


def test_modules_are_cached_by_source_hash_and_dumped(tmp_path: Path) -> None:
    source = generate_triton(_gelu_kernel(16, F32), interpret=True)
    previous = config.debug_dir
    config.debug_dir = str(tmp_path)
    try:
        triton_build.build_triton(source)
    finally:
        config.debug_dir = previous
    path = triton_build.module_path(source)
    assert path.read_text() == source.source and path.stem == triton_build.source_digest(source)
    assert (tmp_path / "triton" / "gelu_16_interpret.py").read_text() == source.source


def test_a_broken_kernel_names_its_source_file() -> None:
    good = generate_triton(_gelu_kernel(16, F32), interpret=True)
    broken = dataclasses.replace(
        good, source=good.source.replace("tl.erf(", "tl.no_such_function(")
    )
    launch = triton_build.build_triton(broken)
    tensors = [torch.zeros(16) for _ in range(4)]
    with pytest.raises(BackendError, match=str(triton_build.module_path(broken))):
        launch(*tensors)
    with pytest.raises(TypeError, match="takes 4 tensors"):
        launch(*tensors[:3])


def test_availability_precompile_and_interpret_mode_restore_state() -> None:
    assert triton_build.triton_available("cpu", interpret=True) is None
    reason = triton_build.triton_available("cpu")
    assert reason is not None and "CUDA" in reason
    triton_build.precompile([generate_triton(_gelu_kernel(16, F32), interpret=True)], [CPU])
    import triton.language as tl

    before = (os.environ.get("TRITON_INTERPRET"), tl.sum, tl.rand)
    with triton_build.interpret_mode(), triton_build.interpret_mode():
        assert os.environ["TRITON_INTERPRET"] == "1" and tl.sum is not before[1]
    assert (os.environ.get("TRITON_INTERPRET"), tl.sum, tl.rand) == before


def test_precompile_workers_report_failures_without_raising() -> None:
    """The worker processes import kiln, read their jobs and report each failure (here: no
    CUDA) as one line; the first launch would then compile and raise."""
    source = generate_triton(_gelu_kernel(16, F32), interpret=False)
    jobs = [triton_build._job(source, 0) for _ in range(2)]
    errors = triton_build._compile_in_workers(jobs)
    assert len(errors) == 2 and all(str(triton_build.module_path(source)) in e for e in errors)


class _FakeCompiled:
    """A compiled kernel: ``[grid]`` gives the low-level runner, which records fast launches."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.fail = False

    def __getitem__(self, grid: Any) -> Any:
        def runner(*args: Any) -> None:
            if self.fail:
                raise TypeError("the launcher's signature changed")
            self.log.append(("fast", grid, args))

        return runner


class _FakeJit:
    """A JITFunction: ``fn[grid](*args, **options)`` records the launch, returns the kernel."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compiled = _FakeCompiled(self.log)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **options: Any) -> _FakeCompiled:
            self.log.append(("slow", grid, args, options))
            return self.compiled

        return launch


def test_compiled_launches_take_the_fast_path_while_the_specialization_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first launch goes through ``kernel[grid]`` (constexprs and options by keyword);
    later ones call the compiled kernel's runner with the bound arguments (tensors, seed,
    constexprs) until the alignment changes or the runner fails."""
    aligned = lambda tensors, extra: (tuple(t.data_ptr() % 16 for t in tensors), len(extra))
    monkeypatch.setattr(triton_build, "_specialization", aligned)
    monkeypatch.setattr(triton_build, "_fast_launch_supported", lambda: True)
    source = generate_triton(_rand_kernel(), interpret=False)
    fake = _FakeJit()
    launch = triton_build.TritonLauncher(source, Path("dropout.py"), fake)
    tensors = [torch.empty(4096, dtype=d) for d in source.argument_dtypes]
    launch(*tensors, seed=7)
    launch(*tensors, 7)  # the wrapper passes the seed positionally
    options = {"XBLOCK": 1024, "enable_fp_fusion": True, "num_warps": 4}
    assert fake.log == [
        ("slow", (4, 1, 1), (*tensors, 7), options),
        ("fast", (4, 1, 1), (*tensors, 7, 1024)),
    ]
    launch(tensors[0][1:], *tensors[1:], seed=7)  # misaligned: another specialization
    assert [entry[0] for entry in fake.log] == ["slow", "fast", "slow"]
    fake.compiled.fail = True
    launch(*tensors, seed=8)
    assert [entry[0] for entry in fake.log] == [
        "slow",
        "fast",
        "slow",
        "slow",
    ] and not launch.fast_ok


def test_load_triton_kernels_gives_the_backend_interface() -> None:
    kernels = [_gelu_kernel(10, F32), _softmax_kernel(3, 4, F32)]
    launchers = triton_build.load_triton_kernels(kernels, CPU, interpret=True)
    assert set(launchers) == {"gelu_10", "softmax_0"}
    data = torch.randn(3, 4)
    out = torch.empty(3, 4)
    launchers["softmax_0"](out, data)
    assert_close(out, torch.softmax(data, 1), 1e-5, 1e-6)


# ---------------------------------------------------------------------------------------------
# GPU sources compile (to sm_90 PTX and cubin, with Triton's bundled ptxas; no GPU needed)

POINTER_TYPES = {
    F32: "*fp32", F64: "*fp64", F16: "*fp16", BF16: "*bf16", I8: "*i8", U8: "*u8",
    I32: "*i32", I64: "*i64", BOOL: "*i1",
}  # fmt: skip


def compile_for_gpu(source: TritonSource) -> Any:
    """``source`` compiled as the first launch would on an H100 (16-byte aligned pointers)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    function = getattr(triton_build._import(triton_build.write_module(source), False), source.name)
    names = function.arg_names
    pointers = names[: len(source.arguments)]
    signature = {n: POINTER_TYPES[d] for n, d in zip(pointers, source.argument_dtypes, strict=True)}
    if source.has_seed:
        signature["seed"] = "i64"
    signature.update({name: "constexpr" for name in source.constexprs})
    constexprs = {(names.index(k),): v for k, v in source.constexprs.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(source.arguments))}
    ast = ASTSource(function, signature, constexprs=constexprs, attrs=attrs)
    options = {**triton_build.OPTIONS, "num_warps": source.num_warps}
    return triton_compile(ast, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.fixture(scope="module")
def gpu_compiler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    try:
        compile_for_gpu(generate_triton(_gelu_kernel(16, F32), interpret=False))
    except Exception as error:  # no nvidia backend or ptxas here
        pytest.skip(f"cannot compile for sm_90 here: {type(error).__name__}: {error}")
    yield
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous


def _every_op_kernel(dtype: torch.dtype) -> Kernel:
    """One pointwise kernel applying every elementwise op that takes ``dtype`` (libdevice
    spellings included), plus conversions to every dtype."""
    n = 128  # one element per thread keeps the compile short
    x = var("x", n)
    a, b = load(buffer("a", (n,), dtype), x), load(buffer("b", (n,), dtype), x)
    flag = load(buffer("flag", (n,), BOOL), x)
    stores = []
    for row in ELEMENTWISE:
        if dtype not in row.dtypes and not (dtype == F64 and F32 in row.dtypes):
            continue
        if row.op is Op.CONVERT:
            values = [
                apply(Op.CONVERT, a, dtype=t) for t in (F32, F64, F16, BF16, I8, U8, I32, I64, BOOL)
            ]
        elif row.op is Op.WHERE:
            values = [
                apply(Op.WHERE, flag, a, b),
                apply(Op.WHERE, flag, const(True if dtype == BOOL else 2, dtype), b),
            ]
        else:
            arity = 1 if Tag.UNARY in row.tags else 2
            out = row.impl(None, *[torch.ones(1, dtype=dtype)] * arity).dtype
            operands = (a,) if Tag.UNARY in row.tags else (a, b)
            values = [apply(row.op, *operands, dtype=out)]
            if Tag.BINARY in row.tags:
                values.append(apply(row.op, a, const(_scalar(row.op, dtype), dtype), dtype=out))
        for value in values:
            stores.append(Store(buffer(f"o{len(stores)}", (n,), value.dtype), x, value))
    return Kernel(f"every_op_{str(dtype)[6:]}", n, 1, stores)


def _every_reduction_kernel(dtype: torch.dtype) -> Kernel:
    rows, cols = 33, 300
    x, r = var("x", rows), var("r", cols)
    v = load(buffer("a", (rows, cols), dtype), x * cols + r)
    stores = []
    for kind in ReduceKind:
        out = I64 if kind in (ReduceKind.ARGMAX, ReduceKind.ARGMIN) else dtype
        stores.append(Store(buffer(f"o{len(stores)}", (rows,), out), x, Reduce(out, kind, v)))
    return Kernel(f"every_reduction_{str(dtype)[6:]}", rows, cols, stores)


def _rand_kernel() -> Kernel:
    n = 4096
    x = var("x", n)
    seed = buffer("seed", (), I64)
    keep = apply(Op.LT, Rand(F32, seed, x), const(0.9), dtype=BOOL)
    value = apply(
        Op.WHERE,
        keep,
        apply(Op.MUL, load(buffer("a", (n,), BF16), x), const(1 / 0.9, BF16)),
        const(0.0, BF16),
    )
    stores = [
        Store(buffer("o", (n,), BF16), x, value),
        Store(buffer("z", (n,), F32), x, Rand(F32, seed, x, normal=True)),
    ]
    return Kernel("dropout", n, 1, stores)


GPU_KERNELS = {
    **{
        f"every_op_{str(d)[6:]}": (lambda d=d: _every_op_kernel(d))
        for d in (F32, BF16, F16, F64, I32, I64, BOOL)
    },
    **{
        f"every_reduction_{str(d)[6:]}": (lambda d=d: _every_reduction_kernel(d))
        for d in (F32, BF16, I32)
    },
    "layer_norm": lambda: _layer_norm_kernel(4096, 4096, BF16),
    "softmax_long_rows": lambda: _softmax_kernel(64, 50000, BF16),
    "dropout": _rand_kernel,
    "int64_indices": lambda: _gelu_kernel(2**31 + 8, BF16),
}


@pytest.mark.parametrize("name", GPU_KERNELS)
def test_gpu_sources_compile(name: str, gpu_compiler: None) -> None:
    kernel = GPU_KERNELS[name]()
    source = generate_triton(kernel, interpret=False)
    assert "cubin" in compile_for_gpu(source).asm
    if name.startswith("every_reduction"):
        looped = dataclasses.replace(
            choose_blocks(kernel, False), form=Form.LOOPED, xblock=2, rblock=64
        )
        assert (
            "cubin" in compile_for_gpu(generate_triton(kernel, interpret=False, blocks=looped)).asm
        )


def test_persistent_softmax_reads_once_and_exps_once_per_element(gpu_compiler: None) -> None:
    """bf16 [16384, 4096]: one row per program, 8 warps, 16 elements per thread: the PTX has
    two 16-byte loads, 16 ex2 (one exp per element) and two 16-byte stores per thread."""
    source = generate_triton(_softmax_kernel(16384, 4096, BF16), interpret=False)
    assert (source.constexprs, source.num_warps) == ({"XBLOCK": 1, "RBLOCK": 4096}, 8)
    ptx = compile_for_gpu(source).asm["ptx"]
    assert ptx.count("ex2.approx") == 16
    assert ptx.count("ld.global.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 2
