"""The Triton code generator and runtime, on CPU tensors through ``TRITON_INTERPRET=1``.

Kernels are built by hand from the loop-level IR, generated for the interpreter, written to a
per-run cache and launched on CPU tensors; results are compared with the registry rows'
reference implementations (eager PyTorch) on fresh random inputs. Shapes stay small and blocks
big: the interpreter costs milliseconds per program instance.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch

import kiln  # noqa: F401  (registers the op rows)
from kiln.codegen.triton import (
    Blocks,
    Form,
    choose_blocks,
    generate_triton,
)
from kiln.ir.op import Op, Tag, op_def, registered_ops
from kiln.ops.attrs import ArgReduceAttrs, ConvertAttrs, ReduceAttrs
from kiln.schedule.index import Index, decompose, indirect, linear, var
from kiln.schedule.loops import (
    IndexValue,
    Kernel,
    Rand,
    Reduce,
    ReduceKind,
    Store,
)

triton = pytest.importorskip("triton")
from kiln.runtime import triton_build  # noqa: E402  (needs triton)
from tests.codegen.ir_builders import BF16, BOOL, CPU, F16, F32, F64, I8, I32, I64, U8  # noqa: E402
from tests.codegen.triton_kernels import (  # noqa: E402, F401  (_cache_dir: an autouse fixture)
    _cache_dir,
    _gelu_kernel,
    _layer_norm_kernel,
    _scalar,
    _softmax_kernel,
    apply,
    assert_close,
    buffer,
    const,
    load,
    outputs,
    pointwise,
    run,
)

# ---------------------------------------------------------------------------------------------
# building and running kernels by hand


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


def _draw_kernel(n: int) -> Kernel:
    x = var("x", n)
    seed_buffer = buffer("seed", (), I64)
    stores = [
        Store(buffer("u", (n,), F32), x, Rand(F32, seed_buffer, x + 7)),
        Store(buffer("z", (n,), F32), x, Rand(F32, seed_buffer, x, normal=True)),
    ]
    return Kernel("dropout_rng", n, 1, stores)


# seeds that fit int32 (a scalar seed of that width was an i32 argument), negative, int64-wide
@pytest.mark.parametrize("seed", [7, -3, 2**40 + 12345, 2**63 - 1])
def test_rand_follows_the_philox_contract_and_randn_is_normal(seed: int) -> None:
    n = 4096
    kernel = _draw_kernel(n)
    tensors = {"u": torch.empty(n), "z": torch.empty(n)}
    run(kernel, tensors, seed=seed)
    expected = _philox_uniform(seed, np.arange(7, n + 7, dtype=np.int64))
    assert np.array_equal(tensors["u"].numpy(), expected)
    assert tensors["u"].min() >= 0.0 and tensors["u"].max() < 1.0
    assert abs(tensors["z"].mean()) < 0.1 and abs(tensors["z"].std() - 1) < 0.1
    again = {"u": torch.empty(n), "z": torch.empty(n)}
    run(kernel, again, seed=seed)
    assert torch.equal(again["u"], tensors["u"]) and torch.equal(again["z"], tensors["z"])
    run(kernel, again, seed=seed - 1)
    assert not torch.equal(again["u"], tensors["u"])


def test_the_seed_is_read_at_each_launch() -> None:
    """The kernel loads its seed (a 0-d or 1-element int64 tensor) when it runs, so a value
    written in place before a launch (as a CUDA graph's runner does before a replay) takes
    effect, while the same value draws the same numbers."""
    n = 1024
    kernel = _draw_kernel(n)
    launch = triton_build.build_triton(generate_triton(kernel, interpret=True))
    seed = torch.tensor([2**40], dtype=torch.int64)
    draws = []
    for value in (2**40, 2**40 + 1, 2**40):
        seed.fill_(value)
        u, z = torch.empty(n), torch.empty(n)
        launch(u, z, seed)
        draws.append(u)
    first, fresh, again = draws
    assert torch.equal(first, again) and not torch.equal(first, fresh)
    expected = _philox_uniform(2**40 + 1, np.arange(7, n + 7, dtype=np.int64))
    assert np.array_equal(fresh.numpy(), expected)
    u, z = torch.empty(n), torch.empty(n)
    launch(u, z, seed=torch.tensor(2**40))  # 0-d, by keyword
    assert torch.equal(u, first)
    assert "seed = tl.load(seed_ptr)" in generate_triton(kernel, interpret=False).source
