"""Reduction splitting: BatchNorm-style reductions become two, with the same results."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontends.trace import graph_inputs
from kiln.ir import Op, interpret, verify
from kiln.passes import (
    eliminate_common_subexpressions,
    eliminate_dead_code,
    reduction_split,
    split_reductions,
)


def _reductions(graph: kiln.ir.Graph) -> list[tuple[Op, tuple[int, ...]]]:
    return [(n.op, tuple(n.attrs.dims)) for n in graph.nodes if n.op in (Op.SUM, Op.AMAX)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_statistics_split(dtype: torch.dtype) -> None:
    x = torch.randn(8, 4, 12, 12, dtype=dtype)

    def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum((0, 2, 3)), x.amax((0, 2, 3))

    graph = kiln.trace(stats, x)
    inputs = graph_inputs(graph, stats, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    assert ((Op.SUM, (2, 3)) in _reductions(split)) and ((Op.SUM, (0,)) in _reductions(split))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_trailing_only_or_many_rows_are_left_alone() -> None:
    x = torch.randn(4, 8, 16)
    for fn in (lambda x: x.sum((1, 2)), lambda x: x.sum(0)):
        graph = kiln.trace(fn, x)
        assert _reductions(split_reductions(graph)) == _reductions(graph)


def test_training_batchnorm_gradients_match_after_the_split() -> None:
    bn = torch.nn.BatchNorm2d(4).train()
    x = torch.randn(6, 4, 10, 10, requires_grad=True)
    bn(x).square().mean().backward()
    expected = x.grad
    x.grad = None
    kiln.compile(bn)(x).square().mean().backward()
    assert x.grad is not None and expected is not None
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "dims"), [((4096, 96), (0,)), ((3, 2048, 48), (0, 1)), ((1024, 2, 160), (0,))]
)
def test_column_reductions_are_chunked(
    dtype: torch.dtype,
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the GPU (claimed here: the rewrite is checked on the CPU) long column reductions
    are cut into chunks of rows."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    x = torch.randn(*shape, dtype=dtype)

    def columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum(dims), x.amax(dims)

    graph = kiln.trace(columns, x)
    inputs = graph_inputs(graph, columns, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    reshapes = [n for n in split.nodes if n.op is Op.RESHAPE]
    assert len(reshapes) == 2  # one per reduction: [chunks, rows // chunks, *kept]
    chunks = reshapes[0].attrs.shape[0]
    rows = reshapes[0].attrs.shape[0] * reshapes[0].attrs.shape[1]
    assert chunks > 1 and rows // chunks >= 64
    assert (Op.SUM, (1,)) in _reductions(split) and (Op.SUM, (0,)) in _reductions(split)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_columns_that_are_many_or_short_or_prime_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    for shape in ((4096, 20000), (100, 96), (4099, 96)):
        x = torch.randn(*shape)
        graph = kiln.trace(lambda x: x.sum(0), x)
        assert _reductions(split_reductions(graph)) == [(Op.SUM, (0,))]


def test_linear_bias_gradient_matches_after_the_column_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    linear = torch.nn.Linear(32, 48)
    x = torch.randn(8, 512, 32)
    linear(x).sin().sum().backward()
    expected = [p.grad for p in linear.parameters()]
    linear.zero_grad(set_to_none=True)
    kiln.compile(linear)(x).sin().sum().backward()
    for param, want in zip(linear.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_batchnorm_statistics_are_channels_last_columns(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU ``[N, C, H, W]`` is channels-last: the statistics reduce ``[N*H*W, C]``
    columns in chunks (the rewrite is checked on the CPU, claiming the GPU's layout)."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    x = torch.randn(8, 16, 48, 48, dtype=dtype)

    def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sum((0, 2, 3)), x.amin((0, 2, 3))

    graph = kiln.trace(stats, x)
    inputs = graph_inputs(graph, stats, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    permutes = [n.attrs.dims for n in split.nodes if n.op is Op.PERMUTE]
    assert permutes == [(0, 2, 3, 1)] * 2
    assert (Op.SUM, (1,)) in _reductions(split) and (Op.SUM, (0,)) in _reductions(split)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_spatial_pooling_with_few_outputs_is_chunked(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A squeeze-excitation's mean over ``(2, 3)`` of a channels-last ``[N, C, H, W]`` keeps
    ``N*C`` column outputs: too few programs, so each image's ``H*W`` rows are cut into chunks
    (the rewrite is checked on the CPU, claiming the GPU's layout)."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    x = torch.randn(4, 32, 48, 48, dtype=dtype)

    def pools(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.mean((2, 3)), x.amax((3, 2))

    graph = kiln.trace(pools, x)
    inputs = graph_inputs(graph, pools, x)
    expected = interpret(graph, inputs)
    split = verify(split_reductions(graph))
    assert [n.attrs.dims for n in split.nodes if n.op is Op.PERMUTE] == [(0, 2, 3, 1)] * 2
    chunked = [n.attrs.shape for n in split.nodes if n.op is Op.RESHAPE]
    assert len(chunked) == 2 and chunked[0][:1] + chunked[0][3:] == (4, 32)
    assert chunked[0][1] > 1 and chunked[0][1] * chunked[0][2] == 48 * 48
    assert _reductions(split) == [(Op.SUM, (2,)), (Op.SUM, (1,)), (Op.AMAX, (2,)), (Op.AMAX, (1,))]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(interpret(split, inputs), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_gpu_spatial_pooling_with_many_outputs_or_small_images_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Enough programs already, too little work, or chunks shorter than 128 rows (at
    128x240x14x14 two chunks of 98 rows ran slower than one program per output block)."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    for shape in ((64, 2048, 7, 7), (2, 8, 7, 7), (128, 240, 14, 14)):
        graph = kiln.trace(lambda x: x.sum((2, 3)), torch.randn(*shape))
        assert _reductions(split_reductions(graph)) == [(Op.SUM, (2, 3))]


@pytest.mark.parametrize(("channels", "size", "chunks"), [(96, 56, 7), (144, 56, 4), (240, 28, 4)])
def test_gpu_spatial_pooling_of_long_rows_aims_at_eight_programs_per_sm(
    channels: int, size: int, chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EfficientNet-B0's squeeze-excitations at batch 128 have 192-480 output blocks of 64
    channels: each image's rows are cut towards 1056 programs, in chunks of >= 128 rows."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    graph = kiln.trace(lambda x: x.mean((2, 3)), torch.empty(128, channels, size, size))
    split = split_reductions(graph)
    shapes = [n.attrs.shape for n in split.nodes if n.op is Op.RESHAPE]
    assert shapes[0] == (128, chunks, size * size // chunks, channels)
    assert _reductions(split) == [(Op.SUM, (2,)), (Op.SUM, (1,))]


@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_global_adaptive_average_pooling_is_one_reduction(
    spatial: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``adaptive_avg_pool2d(x, 1)`` (every classifier head, many squeeze-excitations) sums
    every window dim at once, so the 2-d one gets the pooling split like ``x.mean((2, 3))``;
    one dim at a time, MaxViT's head pooled at 9% of copy bandwidth."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    pool = [F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d][spatial - 1]
    x = torch.randn(16, 64, *[56, 48, 5][:spatial], dtype=torch.bfloat16)
    graph = kiln.trace(lambda x: pool(x, 1), x)
    assert _reductions(graph) == [(Op.SUM, tuple(range(2, 2 + spatial)))]
    split = verify(split_reductions(graph))
    if spatial == 2:
        assert _reductions(split) == [(Op.SUM, (2,)), (Op.SUM, (1,))]
    inputs = graph_inputs(graph, lambda x: pool(x, 1), x)
    (got,) = interpret(split, inputs)
    want = pool(x, 1)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_squeeze_excitation_trains_after_the_pooling_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward and every gradient of a squeeze-excitation block equal eager's with its pooling
    (and its backward's pooled sum) split as on the GPU."""
    from kiln.passes import reduction_split

    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    plans: list[tuple[int, int]] = []
    plan = reduction_split._pooling_plan

    def recorded(node: kiln.ir.Node) -> tuple[int, int] | None:
        chosen = plan(node)
        plans.extend([chosen] if chosen is not None else [])
        return chosen

    monkeypatch.setattr(reduction_split, "_pooling_plan", recorded)
    kiln.counters.reset()
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 1)
    squeeze, excite = torch.nn.Conv2d(16, 4, 1), torch.nn.Conv2d(4, 16, 1)
    modules = torch.nn.ModuleList([conv, squeeze, excite]).to(memory_format=torch.channels_last)

    def block(x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.silu(conv(x))
        scale = excite(torch.nn.functional.silu(squeeze(y.mean((2, 3), keepdim=True))))
        return y * scale.sigmoid()

    compiled = kiln.compile(block)
    for _ in range(2):
        x = torch.randn(8, 16, 48, 48).to(memory_format=torch.channels_last)
        x.requires_grad_()
        grad = torch.randn(8, 16, 48, 48)
        block(x).backward(grad)
        expected = [x.grad, *(p.grad for p in modules.parameters())]
        x.grad = None
        modules.zero_grad(set_to_none=True)
        out = compiled(x)
        torch.testing.assert_close(out, block(x), rtol=1e-4, atol=1e-5)
        out.backward(grad)
        got = [x.grad, *(p.grad for p in modules.parameters())]
        for g, want in zip(got, expected, strict=True):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
        modules.zero_grad(set_to_none=True)
    assert {rows for rows, _ in plans} == {48 * 48}  # the mean, and its backward's sum
    assert kiln.counters.graphs == 1 and not kiln.counters.graph_breaks
    assert not kiln.counters.fallbacks


def test_cpu_column_reductions_stay_whole() -> None:
    """The C++ kernels run columns in parallel already: no chunks on the CPU."""
    graph = kiln.trace(lambda x: x.sum(0), torch.randn(4096, 96))
    assert _reductions(split_reductions(graph)) == [(Op.SUM, (0,))]


def test_symbolic_rows_are_split_and_chunked_for_sizes_the_count_divides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a dynamic batch the splits still run: a BatchNorm's trailing-then-leading sums,
    and column sums (a bias gradient's; a channels-last BatchNorm's statistics) in chunks of
    a power of two dividing the hint, guarded: sizes it divides share one program (8192 and
    12288 rows: 128 chunks), others compile their own. Every result and gradient matches
    eager at each size."""
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.recording import recording

    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)
    torch.manual_seed(0)
    weight = torch.randn(32, 128, requires_grad=True)

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = (x @ weight).relu()
        images = y.reshape(-1, 8, 4, 4)
        normed = F.batch_norm(images, None, None, training=True)
        return y.sum(0), normed, images.amax((2, 3)), normed.square().mean()

    kiln.reset()
    compiled = kiln.compile(step, dynamic=True)
    with recording(CompiledProgramRecord) as records:
        for rows in (8192, 12288, 4100, 8192):
            x = torch.randn(rows, 32)
            got, want = compiled(x), step(x)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            (grad,) = torch.autograd.grad(got[-1], weight)
            (expected,) = torch.autograd.grad(want[-1], weight)
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)
    sized = [r for r in records if r.sizes.startswith("any sizes")]
    assert len(sized) == len(records) == 4, [r.sizes for r in records]  # (2 programs x fwd/bwd)
    kernels = "\n".join(line for r in records for line in r.kernel_lines())
    # chunked column sums: the bias-like sum's second step over 128 chunks, a channels-last
    # BatchNorm's over 512 (8192 and 12288 rows) or 64 (4100)
    assert "(x<s2, r<128): sum" in kernels and "(x<8, r<512): sum" in kernels, kernels


def _claim_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split as on the GPU (the rewrite is checked on the CPU)."""
    monkeypatch.setattr(reduction_split, "_chunks_columns", lambda value: True)
    monkeypatch.setattr(reduction_split, "_holds_channels_last", lambda value: True)


def _full_size_means(graph: kiln.ir.Graph, numel: int) -> list[tuple[int, ...]]:
    """The shapes of the means subtracted from full-size values (before their broadcast)."""
    shapes = []
    for node in graph.nodes:
        if node.op is Op.SUB and node.output.type.numel() == numel:
            mean = node.inputs[1]
            while mean.node is not None and mean.node.op in (Op.BROADCAST, Op.UNSQUEEZE):
                mean = mean.node.inputs[0]
            shapes.append(tuple(mean.type.shape))
    return shapes


@pytest.mark.parametrize(
    ("shape", "dims", "gpu", "groups"),
    [
        ((8, 16, 48, 48), (0, 2, 3), True, (288, 16)),  # channels-last columns in 288 chunks
        ((16384, 24), (0,), True, (256, 24)),  # a tall column variance in 256 chunks
        ((8, 16, 144), (0, 2), True, (8, 16)),  # per image first, then across images
        ((8, 16, 12, 12), (0, 2, 3), False, (16,)),  # the CPU: two passes (see below)
    ],
)
@pytest.mark.parametrize("correction", [0, 1])
def test_a_variance_reads_its_values_once(
    shape: tuple[int, ...],
    dims: tuple[int, ...],
    gpu: bool,
    groups: tuple[int, ...],
    correction: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split variance sums each group's values and squares, shifted by the group's first
    value, and adds the groups' spread around the mean of all after (Chan's update): nothing
    waits for a mean, so one kernel reads the values once, in one loop. Far from zero (a mean
    of 1000, spread 0.01) it stays as exact as two passes (unshifted, a sum of squares minus
    the squared sum would lose every digit there)."""
    if gpu:
        _claim_gpu(monkeypatch)
    torch.manual_seed(0)
    x = 1000.0 + 0.01 * torch.randn(*shape)

    def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.var_mean(x, dims, correction=correction)

    graph = kiln.trace(moments, x)
    inputs = graph_inputs(graph, moments, x)
    kept = tuple(s for d, s in enumerate(shape) if d not in dims)
    assert _full_size_means(graph, x.numel()) == [kept]
    split = verify(eliminate_dead_code(eliminate_common_subexpressions(split_reductions(graph))))
    means = _full_size_means(split, x.numel())
    # (On the CPU the C++ kernels read a row twice from cache, and a shift read through a
    # channel cat would cost DenseNet's row segments; the GPU's second read is from memory.)
    assert groups in means and (kept not in means or not gpu), means
    variance, mean = interpret(split, inputs)
    want_variance, want_mean = torch.var_mean(x.double(), dims, correction=correction)
    torch.testing.assert_close(variance.double(), want_variance, rtol=1e-4, atol=0)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("shape", "dims"), [((8, 16, 48, 48), (0, 2, 3)), ((16384, 24), (0,))])
def test_an_outlier_first_in_its_group_keeps_the_variance_exact(
    shape: tuple[int, ...], dims: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's shift is its own first value: one far from the rest (1e4 among values of
    spread 0.01 around 5) costs digits only in its own group's sums. The variance stays
    within 1e-4 of float64's (measured: 2.6e-6 and 1.8e-5; deviations from each group's mean,
    read twice, lost 1e-7 and 4e-7; eager float32 4e-8)."""
    _claim_gpu(monkeypatch)
    torch.manual_seed(0)
    x = 5.0 + 0.01 * torch.randn(*shape)
    x.view(-1)[: x.shape[-1] if len(shape) == 2 else 1] = 1e4
    x.view(-1)[x.numel() // 2] = -3e3

    def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.var_mean(x, dims, correction=0)

    graph = kiln.trace(moments, x)
    split = verify(eliminate_dead_code(eliminate_common_subexpressions(split_reductions(graph))))
    variance, mean = interpret(split, graph_inputs(graph, moments, x))
    want_variance, want_mean = torch.var_mean(x.double(), dims, correction=0)
    torch.testing.assert_close(variance.double(), want_variance, rtol=1e-4, atol=0)
    torch.testing.assert_close(mean.double(), want_mean, rtol=1e-6, atol=0)


def test_batchnorm_training_with_one_read_statistics_matches_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BatchNorm in training, split as on the GPU: outputs, every gradient and the running
    statistics match eager over calls with new inputs, one of them far from zero.
    (288 chunks of 64 rows: the variance takes the one-read form.)"""
    _claim_gpu(monkeypatch)
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(16, momentum=0.2)
    reference = copy.deepcopy(bn)
    compiled = kiln.compile(bn)
    for offset in (0.0, 3.0, 30.0):
        x = offset + torch.randn(8, 16, 48, 48)
        y, want = compiled(x), reference(x)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        grad = torch.randn_like(y)
        y.backward(grad)
        want.backward(grad)
        for got, expected in zip(bn.parameters(), reference.parameters(), strict=True):
            assert got.grad is not None and expected.grad is not None
            # (1e-3: the scale-and-shift form loses digits far from zero, before the split too)
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-3, atol=1e-3)
            got.grad = expected.grad = None
        for got, expected in zip(bn.buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_deviations_from_another_mean_are_left_as_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a sum of squared deviations from the mean over the same dims (divided by their
    count) takes the one-read form: around another value's mean, another dims' mean, a
    mean over N - 1, or squares of two different values, the sum stays as written."""
    _claim_gpu(monkeypatch)
    x, y = torch.randn(8, 16, 48, 48), torch.randn(8, 16, 48, 48)
    dims = (0, 2, 3)

    def others(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        around_y = (x - y.mean(dims, keepdim=True)).square().sum(dims)
        per_image = (x - x.mean((2, 3), keepdim=True)).square().sum(dims)
        unbiased = (x - x.sum(dims, keepdim=True) / (x[:, 0].numel() - 1)).square().sum(dims)
        centered = x - x.mean(dims, keepdim=True)
        mixed = (centered * (y - y.mean(dims, keepdim=True))).sum(dims)
        return around_y, per_image, unbiased, mixed

    graph = kiln.trace(others, x, y)
    sums = [n for n in graph.nodes if n.op is Op.SUM]
    assert sums and all(reduction_split._deviations_of(n) is None for n in sums)
    inputs = graph_inputs(graph, others, x, y)
    split = verify(split_reductions(graph))
    for got, want in zip(interpret(split, inputs), interpret(graph, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)
