"""``mode="max-autotune"``'s matmul templates under Triton's interpreter: which products pair
with their reading kernel, the fused kernel's results against eager (forward and every
gradient, several calls), the choice between the library and the templates (a fake timer picks
the winner), the disk cache, failing candidates, random epilogues, and explain's lines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.capture.driver.explain import report_of
from kiln.config import config
from kiln.recording import recording
from kiln.schedule.templates import matmul_pairs

pytest.importorskip("triton")
from kiln.runtime import autotune

TRITON = {"codegen": "triton", "strict": True}
MODE = "max-autotune-no-cudagraphs"


class FakeTimer:
    """Runs each candidate once (so failures surface); ``fast`` (a label predicate) takes
    1 us, the others 5 us."""

    def __init__(self, fast: Callable[[str], bool]) -> None:
        self.fast = fast
        self.calls: list[str] = []

    def __call__(self, name: str, run: Callable[[], None], device: torch.device) -> float:
        self.calls.append(name)
        run()
        return 1.0 if self.fast(name) else 5.0


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeTimer]:
    """Templates win, and the cache of choices is this test's alone."""
    fake = FakeTimer(lambda name: name.startswith("template"))
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(autotune, "tuning", autotune.Tuning(timer=fake))
    kiln.reset()
    yield fake
    kiln.reset()


def _pairs(records: list[CompiledProgramRecord]) -> list[autotune.TuningRecord]:
    return [t for r in records for t in r.tuned if " with " in t.kernel]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(48, 80), torch.nn.GELU(), torch.nn.Linear(80, 36), torch.nn.Tanh()
    )


@pytest.mark.parametrize("winner", ["template", "library"])
def test_a_bf16_mlp_trains_like_eager_whichever_wins(timer: FakeTimer, winner: str) -> None:
    timer.fast = lambda name: name.startswith(winner)
    torch.manual_seed(0)
    model = _mlp()
    compiled = kiln.compile(model, mode=MODE, options=TRITON)
    with recording(CompiledProgramRecord) as records:
        for _ in range(3):  # new values each call: nothing stale, nothing measured again
            x = torch.randn(37, 48, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                result, expected = compiled(x), model(x)
            torch.testing.assert_close(result, expected)
            g = torch.randn_like(expected)
            wrt = [x, *model.parameters()]
            got = torch.autograd.grad(result, wrt, g)
            want = torch.autograd.grad(expected, wrt, g)
            for name, a, b in zip(["x", *dict(model.named_parameters())], got, want, strict=True):
                torch.testing.assert_close(a, b, atol=0.1, rtol=0.02, msg=name)
    choices = _pairs(records)
    # addmm -> gelu and addmm -> tanh forward; three products feed pointwise gradients
    assert len(choices) >= 4, [c.line() for c in choices]
    assert all(c.chosen.startswith(winner) for c in choices)
    assert {c.kernel.split(" with ")[1] for c in choices} == {"addmm", "mm"}
    measured = len(timer.calls)
    x = torch.randn(37, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x), model(x))
    assert len(timer.calls) == measured


def _products(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> Any:
    """A product kept for a later reduction, a residual written over the product, and a
    scaled ``addmm``."""
    h = x @ w
    kept = torch.relu(h) * 2
    total = h.sum(dim=0)  # (a later reader: the template stores h too)
    residual = torch.sigmoid(torch.addmm(b, x, w, beta=0.5, alpha=-2.0) + r)
    return kept, total, residual


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_with_kept_results_residuals_and_scaling(timer: FakeTimer, dtype: Any) -> None:
    for m, k, n in ((37, 45, 29), (64, 32, 48)):  # ragged tiles, and whole ones
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype) / 4
        b, r = torch.randn(n, dtype=dtype), torch.randn(m, n, dtype=dtype)
        compiled = kiln.compile(_products, mode=MODE, options=TRITON)
        with recording(CompiledProgramRecord) as records:
            for _ in range(2):  # (measured, then the template alone)
                got = compiled(x, w, b, r)
                for a, e in zip(got, _products(x, w, b, r), strict=True):
                    torch.testing.assert_close(a, e, atol=0.05, rtol=0.02)
                x = torch.randn_like(x)
        assert sum(c.chosen.startswith("template") for c in _pairs(records)) == 2
        kiln.reset()


def test_addmm_with_beta_zero_ignores_a_nan_bias(timer: FakeTimer) -> None:
    def fn(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.addmm(b, x, w, beta=0).exp()

    b = torch.full((24,), float("nan"), dtype=torch.bfloat16)
    x, w = torch.randn(20, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16)
    compiled = kiln.compile(fn, mode=MODE, options=TRITON)
    with recording(CompiledProgramRecord) as records:
        for _ in range(2):  # (measured, then the template alone)
            result = compiled(b, x, w)
            assert not result.isnan().any()
            torch.testing.assert_close(result, fn(b, x, w), atol=0.05, rtol=0.02)
    assert _pairs(records)[0].chosen.startswith("template")


def test_batched_products_with_transposed_operands(timer: FakeTimer) -> None:
    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.bmm(q, k.transpose(1, 2)).mul(0.125).sigmoid()

    q, k = (
        torch.randn(3, 40, 24, dtype=torch.bfloat16),
        torch.randn(3, 33, 24, dtype=torch.bfloat16),
    )
    compiled = kiln.compile(fn, mode=MODE, options=TRITON)
    with recording(CompiledProgramRecord) as records:
        for _ in range(2):
            torch.testing.assert_close(compiled(q, k), fn(q, k))
            q = torch.randn_like(q)
    (choice,) = _pairs(records)
    assert choice.kernel.endswith("with bmm") and choice.chosen.startswith("template")


def test_a_random_epilogue_draws_the_same_numbers_either_way(timer: FakeTimer) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(x @ w, p=0.5, training=True)

    x, w = torch.randn(40, 32, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
    results = []
    for winner in ("template", "library"):
        kiln.reset()
        config.cache_dir = str(Path(config.cache_dir) / winner)  # (a new search each)
        timer.fast = lambda name, winner=winner: name.startswith(winner)  # type: ignore[misc]
        compiled = kiln.compile(fn, mode=MODE, options=TRITON)
        with recording(CompiledProgramRecord) as records:
            torch.manual_seed(3)
            results.append(torch.cat([compiled(x, w), compiled(x, w)]))  # (measured, then not)
        assert _pairs(records)[0].chosen.startswith(winner)
    torch.testing.assert_close(results[0], results[1])
    x = torch.cat([x, x])
    kept = results[0] != 0
    assert 0.3 < kept.float().mean() < 0.7
    assert not torch.equal(kept[:40], kept[40:])  # (each call draws its own mask)
    torch.testing.assert_close(results[0][kept], ((x @ w) * 2)[kept], atol=0.1, rtol=0.02)


def test_the_disk_cache_spares_a_second_process_the_search(timer: FakeTimer) -> None:
    model = _mlp()
    x = torch.randn(16, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with recording(CompiledProgramRecord) as first:
            kiln.compile(model, mode=MODE, options=TRITON)(x)
        measured = len(timer.calls)
        kiln.reset()
        with recording(CompiledProgramRecord) as second:
            result = kiln.compile(model, mode=MODE, options=TRITON)(x)
        torch.testing.assert_close(result, model(x))
    assert len(timer.calls) == measured
    cached = _pairs(second)
    assert cached and all(c.cached and "(2 of 2 tried)" in c.line() for c in cached)
    assert [c.chosen for c in cached] == [c.chosen for c in _pairs(first)]


def test_failing_templates_leave_the_library(timer: FakeTimer) -> None:
    def failing(name: str, run: Callable[[], None], device: torch.device) -> float:
        if name.startswith("template"):
            raise RuntimeError("out of shared memory")
        run()
        return 3.0

    autotune.tuning.timer = failing
    x, w = torch.randn(20, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16)
    with recording(CompiledProgramRecord) as records:
        result = kiln.compile(lambda a, b: (a @ b).cos(), mode=MODE, options=TRITON)(x, w)
    torch.testing.assert_close(result, (x @ w).cos())
    (choice,) = _pairs(records)
    assert choice.chosen == "library" and "1 failed" in choice.line()


def test_what_pairs(timer: FakeTimer) -> None:
    """A product pairs with a pointwise reader at its own elements only: not a reader of
    other elements too, not a reduction, not float32 (a template's product would be tf32), not
    in the default mode; explain says why a product has no template."""
    x, w = torch.randn(20, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16)
    cases: list[tuple[Callable[..., Any], tuple[torch.Tensor, ...], str | None, int, str]] = [
        (lambda a, b: (h := a @ b) + h.flip(1), (x, w), MODE, 0, "at other elements"),
        (lambda a, b: (a @ b).softmax(-1), (x, w), MODE, 0, "reduces"),
        (lambda a, b: (a @ b).exp(), (x.float(), w.float()), MODE, 0, "torch.float32"),
        (lambda a, b: a @ b, (x, w), MODE, 0, "no later step"),
        (lambda a, b: (a @ b, (a @ b).exp()), (x, w), MODE, 1, ""),  # (kept: one product)
        (lambda a, b: (a @ b).exp(), (x, w), None, 0, ""),
        (lambda a, b: (a @ b).exp(), (x, w), MODE, 1, ""),
    ]
    for fn, args, mode, count, reason in cases:
        kiln.reset()
        with recording(CompiledProgramRecord) as records:
            result = kiln.compile(fn, mode=mode, options=TRITON)(*args)
        torch.testing.assert_close(result, fn(*args), atol=0.05, rtol=0.02)
        assert len(_pairs(records)) == count
        refused = [line for line in records[-1].kernel_lines() if "no template:" in line]
        assert [reason in line for line in refused] == ([True] if reason else []), refused
        if mode is None:  # (a pair there, left alone: the default mode does not search)
            program = records[-1].program
            assert program is not None and len(matmul_pairs(program, frozenset({"cpu"}))) == 1


def test_explain_names_the_choice_and_its_alternative(timer: FakeTimer) -> None:
    x, w = torch.randn(20, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16)
    with recording() as events:
        kiln.compile(lambda a, b: (a @ b).relu(), mode=MODE, options=TRITON)(x, w)
    records = [e for e in events if isinstance(e, CompiledProgramRecord)]
    lines = [line for line in report_of(events).kernels if " with mm: " in line]
    assert len(lines) == 1
    assert ": template 32x32x16 w4 s1 1.0 us, runner-up library 5.0 us" in lines[0]
    from kiln.bench.worker import _kiln_notes  # (the bench's summary of the same)

    assert "kiln: max-autotune: 1 of 1 products as templates" in _kiln_notes("kiln", records)


def _conv_block(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: torch.Tensor, geometry: dict
) -> torch.Tensor:
    y = F.conv2d(x, w, b, **geometry)
    return F.relu(y + r) if r.shape == y.shape else F.hardswish(y)


@pytest.mark.parametrize(
    "case",
    [
        # (input NCHW, out channels, window, geometry, bias, depthwise)
        ((2, 19, 9, 11), 24, 3, {"padding": 1}, True, False),
        ((2, 3, 15, 13), 16, 7, {"stride": 2, "padding": 3}, False, False),
        ((1, 32, 8, 8), 40, 1, {}, True, False),
        ((2, 24, 10, 9), 24, 3, {"stride": 2, "padding": 1, "groups": 24}, True, True),
        ((1, 40, 7, 7), 40, 5, {"padding": 4, "dilation": 2, "groups": 40}, False, True),
    ],
    ids=["3x3", "stem-7x7-s2", "1x1", "depthwise-s2", "depthwise-5x5-dilated"],
)
def test_channels_last_convolutions_with_their_epilogue(timer: FakeTimer, case: Any) -> None:
    shape, out, window, geometry, with_bias, depthwise = case
    per_group = 1 if depthwise else shape[1]
    x = torch.randn(shape, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(out, per_group, window, window, dtype=torch.bfloat16) / window
    b = torch.randn(out, dtype=torch.bfloat16) if with_bias else None
    expected_shape = F.conv2d(x, w, b, **geometry).shape
    r = torch.randn(expected_shape, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    if depthwise:
        r = torch.randn(1)  # (the hard-swish epilogue)
    compiled = kiln.compile(_conv_block, mode=MODE, options=TRITON)
    with recording(CompiledProgramRecord) as records:
        for _ in range(3):  # (the first call measures: later ones run the template alone)
            result = compiled(x, w, b, r, geometry)
            expected = _conv_block(x, w, b, r, geometry)
            torch.testing.assert_close(result, expected, atol=0.05, rtol=0.02)
            x = torch.randn_like(x)
    (choice,) = _pairs(records)
    assert choice.kernel.endswith("with convolution") and choice.chosen.startswith("template")
    tile = choice.chosen.split()[1]  # (a depthwise tile has no BLOCK_K: 32x32)
    assert tile.count("x") == (1 if depthwise else 2)


class _Bottleneck(torch.nn.Module):
    """ResNet's downsampling block: its last kernel reads two convolutions' results."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(channels, width, 1, bias=False)
        self.conv2 = nn.Conv2d(width, width, 3, 2, 1, bias=False)
        self.conv3 = nn.Conv2d(width, 4 * width, 1, bias=False)
        self.down = nn.Conv2d(channels, 4 * width, 1, 2, bias=False)
        self.norms = nn.ModuleList(nn.BatchNorm2d(n) for n in (width, width, 4 * width, 4 * width))
        for norm in self.norms:
            assert isinstance(norm, nn.BatchNorm2d)
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn1, bn2, bn3, bn4 = self.norms
        out = F.relu(bn1(self.conv1(x)))
        out = F.relu(bn2(self.conv2(out)))
        return F.relu(bn3(self.conv3(out)) + bn4(self.down(x)))


@pytest.mark.parametrize("winner", ["template", "library"])
def test_a_residual_block_whose_kernel_reads_two_products(timer: FakeTimer, winner: str) -> None:
    """The block's last kernel pairs with one convolution only; the other's result, and
    every operand the template reads later, stay alive until that kernel."""
    timer.fast = lambda name: name.startswith(winner)
    torch.manual_seed(0)
    block = _Bottleneck(16, 8).eval().to(memory_format=torch.channels_last)
    compiled = kiln.compile(block, mode=MODE, options=TRITON)
    with recording(CompiledProgramRecord) as records, torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 16, 10, 10).to(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.testing.assert_close(compiled(x), block(x), atol=0.05, rtol=0.02)
    choices = _pairs(records)
    assert len(choices) == 3 and all(c.chosen.startswith(winner) for c in choices)
    assert all(None not in c.times.values() for c in choices)  # (no candidate failed)


def test_a_program_in_symbolic_sizes_keeps_the_library(timer: FakeTimer) -> None:
    """A template's tiles are chosen per size: a program compiled for a range of sizes pairs
    nothing, and serves every size right."""
    compiled = kiln.compile(lambda a, b: (a @ b).relu(), mode=MODE, dynamic=True, options=TRITON)
    w = torch.randn(16, 24, dtype=torch.bfloat16)
    with recording(CompiledProgramRecord) as records:
        for rows in (20, 33, 7):
            x = torch.randn(rows, 16, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x, w), (x @ w).relu())
    assert records and all("any sizes" in r.sizes for r in records)
    assert _pairs(records) == []
