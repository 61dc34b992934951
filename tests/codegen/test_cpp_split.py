"""The C++ generator splits ``x`` as ``lanes*xb + xl`` when it enumerates ``(n, c)`` of a
tensor through ``x // C`` and ``x % C`` (``kiln/codegen/cpp_split.py``): BatchNorm statistics
over channels-last data reduce as columns, per-channel math runs once per lane or per block.
Each kernel is checked for the form it takes (in its source) and against the evaluator (the
scheduler's oracle) or eager PyTorch on random inputs."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.codegen.cpp import cpp_library, generate_cpp
from kiln.ir.op import Op
from kiln.recording import listen, unlisten
from kiln.runtime import cpp_build
from kiln.schedule.evaluate import evaluate_kernel
from kiln.schedule.index import Index, var
from kiln.schedule.loops import Expr, Kernel, Reduce, ReduceKind, Store
from kiln.schedule.program import kernel_arguments
from tests.codegen.ir_builders import F32, apply, buffer, const, load

pytestmark = pytest.mark.skipif(
    not cpp_build.cpp_compiler_available(), reason="no C++ compiler on PATH"
)

THREADS = 2
EPS = 1e-5


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kiln-cpp-split")


def run_both(
    kernel: Kernel, inputs: dict[str, torch.Tensor], cache: Path, threads: int = THREADS
) -> dict[str, torch.Tensor]:
    """Run ``kernel`` compiled and through the evaluator on ``inputs``; check that every
    buffer it writes agrees and return the compiled run's tensors."""
    results = []
    for compiled in (True, False):
        tensors = {name: tensor.clone() for name, tensor in inputs.items()}
        for out in kernel.writes():
            tensors.setdefault(out.name, torch.full(out.shape, 7.0))
        arguments = [tensors[b.name] for b in kernel_arguments(kernel)]
        if compiled:
            source = generate_cpp([kernel], threads)
            library = cpp_library([kernel], source=source)
            cpp_build.load_kernels(library, cache)[kernel.name](*arguments)
        else:
            evaluate_kernel(kernel, arguments)
        results.append(tensors)
    for out in kernel.writes():
        torch.testing.assert_close(results[0][out.name], results[1][out.name])
    return results[0]


def channel_scale_shift(channel: Index, count: int) -> tuple[Expr, Expr]:
    """A BatchNorm's per-channel ``scale = w * rsqrt(var + eps)`` and ``shift = b - mean *
    scale`` from the sums ``total`` and ``squares`` over ``count`` values."""
    mean = apply(Op.DIV, load(buffer("total", (C,), F32), channel), const(float(count)))
    variance = apply(Op.DIV, load(buffer("squares", (C,), F32), channel), const(float(count)))
    rstd = apply(Op.RSQRT, apply(Op.ADD, variance, const(EPS)))
    scale = apply(Op.MUL, rstd, load(buffer("weight", (C,), F32), channel))
    shift = apply(Op.SUB, load(buffer("bias", (C,), F32), channel), apply(Op.MUL, mean, scale))
    return scale, shift


def channel_inputs(count: int) -> dict[str, torch.Tensor]:
    return {
        "total": torch.randn(C) * count,
        "squares": torch.rand(C) * count + 0.5,
        "weight": torch.randn(C),
        "bias": torch.randn(C),
    }


def expected_scale_shift(t: dict[str, torch.Tensor], count: int) -> tuple[Any, Any]:
    scale = t["weight"] * torch.rsqrt(t["squares"] / count + EPS)
    return scale, t["bias"] - t["total"] / count * scale


C = 32


# ---------------------------------------------------------------------------------------------
# row kernels over (n, c) of channels-last data


def statistics_kernel(n: int, c: int, hw: int) -> Kernel:
    """Per ``(n, c)`` of channels-last ``data`` (``[n, hw, c]`` in memory): the sum, the
    squares about a given per-channel mean (an ``r``-independent value of ``x % c``), the
    squares about the row's own mean (a second phase), and a sum weighted per row (a load at
    ``x``, contiguous but not along ``r``: it must not make the rows look like columns)."""
    x, r = var("x", n * c), var("r", hw)
    value = load(buffer("data", (n, hw, c), F32), r * c + (x // c) * (c * hw) + x % c)
    given = apply(Op.DIV, load(buffer("given", (c,), F32), x % c), const(float(hw)))
    total = Reduce(F32, ReduceKind.SUM, value)
    about_given = apply(Op.SUB, value, given)
    about_own = apply(Op.SUB, value, apply(Op.DIV, total, const(float(hw))))
    weighted = apply(Op.MUL, value, load(buffer("row_weight", (n * c,), F32), x))
    stores = [
        Store(buffer("sums", (n * c,), F32), x, total),
        Store(
            buffer("given_sq", (n * c,), F32),
            x,
            Reduce(F32, ReduceKind.SUM, apply(Op.MUL, about_given, about_given)),
        ),
        Store(
            buffer("own_sq", (n * c,), F32),
            x,
            Reduce(F32, ReduceKind.SUM, apply(Op.MUL, about_own, about_own)),
        ),
        Store(buffer("weighted", (n * c,), F32), x, Reduce(F32, ReduceKind.SUM, weighted)),
    ]
    return Kernel(f"statistics_{n}x{c}x{hw}", n * c, hw, stores)


@pytest.mark.parametrize(("n", "hw", "threads", "lanes"), [(4, 36, 2, 32), (2, 512, 4, 16)])
def test_channels_last_statistics_reduce_as_split_columns(
    n: int, hw: int, threads: int, lanes: int, cache: Path
) -> None:
    """Rows ``(n, c)`` read ``c*r + c*hw*(x // c) + (x % c)``: split as ``xb = n``,
    ``xl = c``, the reads are contiguous along ``xl``. Two images on four threads: blocks of
    half the channels, so that every thread gets one."""
    kernel = statistics_kernel(n, C, hw)
    source = generate_cpp([kernel], threads)
    assert f"// x = {lanes}*xb + xl" in source
    assert f"for (int32_t xl = 0; xl < {lanes}; ++xl)" in source
    assert re.search(rf"\[{C}\*r \+ (\d+\*xb \+ )?xl\b", source)  # contiguous along xl
    assert "lane0[xl] = " in source  # given / hw: once per block, not per element
    data, given = torch.randn(n, hw, C) * 2 + 1, torch.randn(C) * hw
    row_weight = torch.randn(n * C)
    inputs = {"data": data, "given": given, "row_weight": row_weight}
    out = run_both(kernel, inputs, cache, threads)
    torch.testing.assert_close(out["sums"], data.sum(1).flatten(), rtol=1e-4, atol=1e-4)
    about_given = (data - given / hw).square().sum(1).flatten()
    torch.testing.assert_close(out["given_sq"], about_given, rtol=1e-4, atol=1e-3)
    own = (data - data.mean(1, keepdim=True)).square().sum(1).flatten()
    torch.testing.assert_close(out["own_sq"], own, rtol=1e-4, atol=1e-3)
    weighted = data.sum(1).flatten() * row_weight
    torch.testing.assert_close(out["weighted"], weighted, rtol=1e-4, atol=1e-3)


def test_stores_along_r_without_reduction_take_split_columns(cache: Path) -> None:
    """A channels-last BatchNorm-apply scheduled as rows ``(n, c)`` storing along ``r``
    (no reduction): blocks of channels side by side, scale and shift once per block."""
    n, hw = 2, 49
    x, r = var("x", n * C), var("r", hw)
    at = r * C + (x // C) * (C * hw) + x % C
    scale, shift = channel_scale_shift(x % C, n * hw)
    value = apply(Op.ADD, apply(Op.MUL, load(buffer("data", (n, hw, C), F32), at), scale), shift)
    relu = apply(Op.MAXIMUM, value, const(0.0))
    kernel = Kernel("apply_rows", n * C, hw, [Store(buffer("out", (n, hw, C), F32), at, relu)])
    source = generate_cpp([kernel], THREADS).split("void apply_rows")[1]
    assert "for (int32_t xl = 0; xl < 32; ++xl)" in source
    assert f"[{C}*r + {C * hw}*xb + xl]" in source and "lane1[xl] = " in source
    assert source.count("sqrtf(") == 1  # in the per-block loop only
    inputs = {"data": torch.randn(n, hw, C), **channel_inputs(n * hw)}
    out = run_both(kernel, inputs, cache)
    expected_scale, expected_shift = expected_scale_shift(inputs, n * hw)
    expected = torch.relu(inputs["data"] * expected_scale + expected_shift)
    torch.testing.assert_close(out["out"], expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# flat kernels


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_pointwise_batchnorm_apply_computes_channel_math_once(layout: str, cache: Path) -> None:
    """The per-channel scale and shift of a flat BatchNorm-apply: per-lane arrays filled once
    when the channel is ``x % C`` (channels-last), scalars once per block of ``H*W`` when it
    is ``(x // HW) % C`` (NCHW). 4*32*256 elements: the blocks run on two threads."""
    n, hw = 4, 256
    x = var("x", n * C * hw)
    channel = x % C if layout == "channels_last" else (x // hw) % C
    scale, shift = channel_scale_shift(channel, n * hw)
    value = apply(Op.ADD, apply(Op.MUL, load(buffer("data", (n * C * hw,), F32), x), scale), shift)
    relu = apply(Op.MAXIMUM, value, const(0.0))
    out = buffer("out", (n * C * hw,), F32)
    kernel = Kernel(f"apply_{layout}", n * C * hw, 1, [Store(out, x, relu)])
    body = generate_cpp([kernel], THREADS).split(f"void apply_{layout}")[1]
    assert "omp parallel for" in body and body.count("sqrtf(") == 1
    if layout == "channels_last":
        assert "float lane0[32];" in body and "= lane0[xl];" in body
        assert body.index("sqrtf(") < body.index("for (int64_t xb")  # once per kernel
    else:
        assert "a2[((xb) % 32)]" in body  # the channel of a block of H*W elements
        assert body.index("for (int64_t xb") < body.index("sqrtf(") < body.index("xl = 0")
    inputs = {"data": torch.randn(n * C * hw), **channel_inputs(n * hw)}
    result = run_both(kernel, inputs, cache)
    expected_scale, expected_shift = expected_scale_shift(inputs, n * hw)
    shape = (n, hw, C) if layout == "channels_last" else (n, C, hw)
    if layout == "nchw":
        expected_scale, expected_shift = expected_scale[:, None], expected_shift[:, None]
    expected = torch.relu(inputs["data"].view(shape) * expected_scale + expected_shift)
    torch.testing.assert_close(result["out"], expected.flatten(), rtol=1e-5, atol=1e-5)


def test_bias_read_by_modulo_splits_into_contiguous_reads(cache: Path) -> None:
    """``gelu(x + b) + y`` over ``[rows, C]``: the bias read at ``x % C`` is a gather in the flat
    loop; split as ``C*xb + xl`` every read is contiguous and no division is left."""
    rows, cols = 6, 80
    x = var("x", rows * cols)
    data = load(buffer("data", (rows * cols,), F32), x)
    biased = apply(Op.ADD, data, load(buffer("bias", (cols,), F32), x % cols))
    erf = apply(Op.ERF, apply(Op.MUL, biased, const(0.7071067811865476)))
    gelu = apply(Op.MUL, apply(Op.MUL, biased, const(0.5)), apply(Op.ADD, erf, const(1.0)))
    value = apply(Op.ADD, gelu, load(buffer("other", (rows * cols,), F32), x))
    out = buffer("out", (rows * cols,), F32)
    kernel = Kernel("bias_gelu", rows * cols, 1, [Store(out, x, value)])
    body = generate_cpp([kernel], THREADS).split("void bias_gelu")[1]
    assert f"for (int32_t xl = 0; xl < {cols}; ++xl)" in body
    assert re.search(r"= a\d\[xl\];", body)  # the bias, contiguous along the lanes
    assert "%" not in body and "/ " not in body.replace("// ", "")
    inputs = {
        "data": torch.randn(rows * cols),
        "bias": torch.randn(cols),
        "other": torch.randn(rows * cols),
    }
    result = run_both(kernel, inputs, cache)
    biased_ref = inputs["data"].view(rows, cols) + inputs["bias"]
    expected = torch.nn.functional.gelu(biased_ref) + inputs["other"].view(rows, cols)
    torch.testing.assert_close(result["out"], expected.flatten(), rtol=1e-5, atol=1e-5)


def test_no_split_when_lanes_do_not_fit(cache: Path) -> None:
    """Eight channels are too few lanes; 1000 elements are no whole number of 48-lane blocks:
    both kernels keep the flat forms and their results."""
    x, r = var("x", 2 * 8), var("r", 20)
    narrow = load(buffer("data", (2, 20, 8), F32), r * 8 + (x // 8) * 160 + x % 8)
    sums = Kernel(
        "narrow_sums",
        16,
        20,
        [Store(buffer("sums", (16,), F32), x, Reduce(F32, ReduceKind.SUM, narrow))],
    )
    flat = var("x", 1000)
    weight = apply(Op.EXP, load(buffer("weight", (48,), F32), flat % 48))
    product = apply(Op.MUL, load(buffer("values", (1000,), F32), flat), weight)
    scaled = Kernel("ragged_scale", 1000, 1, [Store(buffer("out", (1000,), F32), flat, product)])
    for kernel in (sums, scaled):
        assert "xl" not in generate_cpp([kernel], THREADS)
    data = torch.randn(2, 20, 8)
    out = run_both(sums, {"data": data}, cache)
    torch.testing.assert_close(out["sums"], data.sum(1).flatten(), rtol=1e-5, atol=1e-5)
    values, weights = torch.randn(1000), torch.randn(48)
    out = run_both(scaled, {"values": values, "weight": weights}, cache)
    expected = values * torch.exp(weights).repeat(21)[:1000]
    torch.testing.assert_close(out["out"], expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# end to end


class ConvNet(nn.Module):
    """small_cnn's shape (conv, BatchNorm, ReLU stages, mean, linear) at test size."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for inputs, outputs, stride in ((3, 16, 1), (16, 32, 2)):
            conv = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            layers += [conv, nn.BatchNorm2d(outputs), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_batchnorm_training_matches_eager(channels_last: bool) -> None:
    """Training steps of a conv/BatchNorm/ReLU net compiled for the CPU, in both layouts: the
    loss, every parameter's gradient and the running statistics match eager."""
    torch.manual_seed(0)
    eager = ConvNet().train()
    images, labels = torch.randn(2, 3, 12, 12), torch.randint(0, 10, (2,))
    if channels_last:
        eager = eager.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    model = copy.deepcopy(eager)
    records: list = []
    listen(records, CompiledProgramRecord)
    try:
        compiled = kiln.compile(model, options={"codegen": "cpp"})
        for _ in range(2):
            for net, run in ((eager, eager), (model, compiled)):
                net.zero_grad()
                loss = nn.functional.cross_entropy(run(images), labels)
                loss.backward()
                if net is eager:
                    expected = loss.detach()
            torch.testing.assert_close(loss.detach(), expected, rtol=1e-4, atol=1e-5)
            for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None, name
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        unlisten(records)
        kiln.reset()
    for mine, theirs in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    sources = [generate_cpp(record.program.kernels()) for record in records if record.program]
    assert any("xb" in source for source in sources)  # the split kernels ran
