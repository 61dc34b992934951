"""``mode="max-autotune"`` under Triton's interpreter: the candidates, the search (driven by a
fake timer that makes a known candidate fastest), in-place updates applied once, the disk
cache, failing candidates, explain's lines, and the default mode's single source a kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kiln
from kiln.backends import kernels as backend_kernels
from kiln.backends.kiln import CompiledProgramRecord
from kiln.capture.driver.explain import report_of
from kiln.codegen.sources import Form
from kiln.codegen.triton import MAX_PERSISTENT_RBLOCK, Blocks, choose_blocks
from kiln.codegen.triton_candidates import MAX_CANDIDATES, candidate_blocks
from kiln.config import config
from kiln.recording import recording
from kiln.schedule.loops import KernelKind

pytest.importorskip("triton")
from kiln.runtime import autotune, triton_build
from tests.codegen.triton_kernels import (  # noqa: F401  (_cache_dir: an autouse fixture)
    _cache_dir,
    _softmax_kernel,
)

TRITON = {"codegen": "triton"}
FASTEST = "looped x1 r512 w8"  # of a softmax over rows of 1000: neither first nor last


class FakeTimer:
    """Runs each candidate once (so failures surface) and reports ``fast`` (a predicate on
    the label) as 1 us, every other candidate as 10 us plus its position."""

    def __init__(self, fast: Callable[[str], bool]) -> None:
        self.fast = fast
        self.calls: list[str] = []

    def __call__(self, name: str, run: Callable[[], None], device: torch.device) -> float:
        self.calls.append(name)
        run()
        return 1.0 if self.fast(name) else 10.0 + len(self.calls)


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeTimer]:
    """A fake timer favouring looped reductions, and a cache of choices of this test alone."""
    fake = FakeTimer(lambda name: name == FASTEST)
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(autotune, "tuning", autotune.Tuning(timer=fake))
    kiln.reset()
    yield fake
    kiln.reset()


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 2, dim=-1)


def _compile(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[CompiledProgramRecord]]:
    with recording(CompiledProgramRecord) as records:
        result = kiln.compile(fn, mode="max-autotune", options=TRITON)(*args)
    return result, records


def test_candidates_are_legal_and_start_with_the_heuristic() -> None:
    for interpret in (True, False):
        kernel = _softmax_kernel(64, 1000, torch.float32)
        shapes = candidate_blocks(kernel, interpret)
        assert shapes[0] == choose_blocks(kernel, interpret)
        assert 2 < len(shapes) <= MAX_CANDIDATES and len(set(shapes)) == len(shapes)
        assert {b.form for b in shapes} == {Form.PERSISTENT, Form.LOOPED}
        for b in shapes:
            assert b.rblock <= MAX_PERSISTENT_RBLOCK
            if b.form is Form.PERSISTENT:
                assert b.rblock >= kernel.rnumel
            else:
                assert b.rblock < 1024
    long_rows = _softmax_kernel(4, 40000, torch.float32)
    assert {b.form for b in candidate_blocks(long_rows, False)} == {Form.LOOPED}


def test_pointwise_kernels_get_pointwise_shapes_only(timer: FakeTimer) -> None:
    x = torch.randn(300)
    with recording(CompiledProgramRecord) as records:
        kiln.compile(lambda t: t.sin() + 1, options=TRITON)(x)
    (kernel,) = records[-1].program.kernels()
    assert kernel.kind is KernelKind.POINTWISE
    shapes = candidate_blocks(kernel, interpret=True)
    assert len(shapes) > 1 and all(b.form is Form.POINTWISE for b in shapes)
    assert all(b.xblock <= 512 for b in shapes)  # never past the next power of two of 300


def test_the_fastest_candidate_serves_and_results_equal_eager(timer: FakeTimer) -> None:
    x = torch.randn(8, 1000)
    result, records = _compile(_softmax, x)
    torch.testing.assert_close(result, _softmax(x))
    (choice,) = records[-1].tuned
    assert choice.chosen == FASTEST and choice.times[FASTEST] == 1.0
    assert next(iter(choice.times)) == "persistent x8 r1024 w8"  # the heuristic's, measured first
    assert len(choice.times) == len(timer.calls) > 2 and not choice.cached
    assert all(t is not None for t in choice.times.values())


def test_in_place_updates_are_applied_once(timer: FakeTimer) -> None:
    def update(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(y.sum(dim=-1, keepdim=True))
        return x * 2

    x, y = torch.randn(8, 600), torch.randn(8, 600)
    expected_x = x.clone()
    expected = update(expected_x, y)
    result, records = _compile(update, x, y)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(result, expected)
    assert records[-1].tuned and len(timer.calls) > len(records[-1].tuned)


def test_the_disk_cache_spares_the_second_compile_its_search(
    timer: FakeTimer, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(8, 1000)
    _, first = _compile(_softmax, x)
    measured = len(timer.calls)
    assert measured > 1
    kiln.reset()
    triton_build._modules.clear()
    built: list[str] = []
    build = triton_build.build_triton
    monkeypatch.setattr(
        triton_build, "build_triton", lambda s: built.append(s.kernel_name) or build(s)
    )
    result, second = _compile(_softmax, x)
    torch.testing.assert_close(result, _softmax(x))
    assert len(timer.calls) == measured  # nothing measured again
    (choice,) = second[-1].tuned
    assert choice.cached and choice.chosen == first[-1].tuned[0].chosen
    assert f"of {choice.candidates} tried" in choice.line() and "[cached]" in choice.line()
    assert len(built) == 1  # only the chosen candidate was built


def test_a_failing_candidate_is_skipped(timer: FakeTimer, monkeypatch: pytest.MonkeyPatch) -> None:
    def with_a_broken_one(kernel: Any, interpret: bool) -> list[Blocks]:
        # XBLOCK=3: tl.arange needs a power of two, so this one fails to run
        return [*candidate_blocks(kernel, interpret), Blocks(Form.POINTWISE, 3, 1, 4)]

    monkeypatch.setattr(backend_kernels, "candidate_blocks", with_a_broken_one)
    timer.fast = lambda name: name.endswith("x3 w4")  # the broken one would win
    x = torch.randn(300)
    result, records = _compile(lambda t: t.cos() * 3, x)
    torch.testing.assert_close(result, x.cos() * 3)
    (choice,) = records[-1].tuned
    assert choice.times["pointwise x3 w4"] is None
    assert choice.chosen != "pointwise x3 w4" and choice.times[choice.chosen] is not None


def test_explain_shows_each_choice(timer: FakeTimer) -> None:
    x = torch.randn(8, 1000)
    with recording() as events:
        kiln.compile(_softmax, mode="max-autotune-no-cudagraphs", options=TRITON)(x)
    lines = [line for line in report_of(events).kernels if ": autotune " in line]
    assert len(lines) == 1
    assert f": {FASTEST} 1.0 us, runner-up " in lines[0] and "tried)" in lines[0]
    (choice,) = [t for event in events if hasattr(event, "tuned") for t in event.tuned]
    for label, time in choice.times.items():  # every measured alternative, with its time
        assert f"{label} {time:.1f}" in lines[0]


def test_the_default_mode_builds_one_source_a_kernel(
    timer: FakeTimer, monkeypatch: pytest.MonkeyPatch
) -> None:
    generated: list[str] = []
    generate = backend_kernels.generate_triton

    def counted(kernel: Any, interpret: bool, **kwargs: Any) -> Any:
        generated.append(kernel.name)
        return generate(kernel, interpret, **kwargs)

    monkeypatch.setattr(backend_kernels, "generate_triton", counted)
    x = torch.randn(8, 1000)
    with recording(CompiledProgramRecord) as records:
        result = kiln.compile(_softmax, options=TRITON)(x)
    torch.testing.assert_close(result, _softmax(x))
    kernels = records[-1].program.kernels()
    assert sorted(generated) == sorted(k.name for k in kernels)
    assert timer.calls == [] and records[-1].tuned == []


def test_budgets_bound_the_search(timer: FakeTimer, tmp_path: Path) -> None:
    x = torch.randn(8, 1000)
    autotune.tuning.kernel_budget_s = 0.0  # the heuristic's candidate only
    result, records = _compile(_softmax, x)
    torch.testing.assert_close(result, _softmax(x))
    (choice,) = records[-1].tuned
    assert timer.calls == [choice.chosen] and f"(1 of {choice.candidates} tried)" in choice.line()
    kiln.reset()
    autotune.tuning.total_budget_s = 0.0  # spent: nothing measured, nothing cached
    for path in (tmp_path / "autotune").iterdir():
        path.unlink()
    result, records = _compile(_softmax, x)
    torch.testing.assert_close(result, _softmax(x))
    assert len(timer.calls) == 1 and records[-1].tuned[0].times == {}
    assert not any((tmp_path / "autotune").iterdir())
