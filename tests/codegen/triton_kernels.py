"""Loop-level kernels built by hand for the Triton generator's tests, and how to run them
through Triton's interpreter (shared by ``test_triton.py`` and ``test_triton_runtime.py``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch

import kiln  # noqa: F401  (registers the op rows)
from kiln.codegen.triton import (
    Blocks,
    TritonSource,
    generate_triton,
)
from kiln.config import config
from kiln.ir.op import Op
from kiln.schedule.index import Index, var
from kiln.schedule.loops import (
    Expr,
    Kernel,
    Reduce,
    ReduceKind,
    Store,
)
from kiln.schedule.program import kernel_arguments
from tests.codegen.ir_builders import (  # noqa: F401  (re-exported to the tests)
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

triton = pytest.importorskip("triton")
from kiln.runtime import triton_build  # noqa: E402  (needs triton)


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
    """Generate ``kernel`` for the interpreter and run it on tensors named like its buffers
    (and ``seed``, which the kernel loads from a 0-d int64 tensor)."""
    source = generate_triton(kernel, interpret=True, blocks=blocks)
    launch = triton_build.build_triton(source)
    arguments = [tensors[b.name] for b in kernel_arguments(kernel)]
    seeds = [] if seed is None else [torch.tensor(seed, dtype=torch.int64)]
    launch(*arguments, *seeds)
    return source


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if not actual.dtype.is_floating_point:
        assert torch.equal(actual, expected), (actual, expected)
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def _scalar(op: Op, dtype: torch.dtype) -> bool | int | float:
    if dtype == BOOL:
        return True
    return 1.5 if dtype.is_floating_point else (2 if op in {Op.SHIFT_LEFT, Op.SHIFT_RIGHT} else 3)


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


@pytest.fixture(autouse=True, scope="module")
def _cache_dir() -> Iterator[None]:
    """Generated modules go to a per-run directory, not the user's cache."""
    previous = config.cache_dir
    with tempfile.TemporaryDirectory(prefix="kiln-test-triton-") as directory:
        config.cache_dir = directory
        yield
    config.cache_dir = previous
