"""A tiny suite run in-process: one row per mode, eager vs kiln, checked and timed."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
from kiln.bench import models
from kiln.bench.progress import Progress
from kiln.bench.runner import Options, run_suite
from kiln.bench.table import format_table
from kiln.bench.worker import prepare
from kiln.cli import main


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tiny(batch: int) -> models.Workload:
    return models.Workload(
        TinyMLP(), lambda generator: (torch.randn(batch, 16, generator=generator),)
    )


@pytest.fixture
def tiny_suite(monkeypatch: pytest.MonkeyPatch) -> Options:
    monkeypatch.setitem(models.MODELS, "tiny_mlp", models.ModelSpec("tiny_mlp", "MLP", _tiny, 4))
    missing = models.ModelSpec("needs_nothing_here", "-", _tiny, 4, ("kiln_no_such_package",))
    monkeypatch.setitem(models.MODELS, "needs_nothing_here", missing)
    return Options(
        models=["tiny_mlp", "needs_nothing_here"], compilers=("kiln",), isolate=False, budget_s=0.05
    )


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_tiny_row_in_process(tiny_suite: Options, mode: str) -> None:
    tiny_suite.mode = mode
    stream = io.StringIO()
    rows = run_suite(tiny_suite, Progress(stream, live=False))
    tiny, skipped = rows
    assert skipped.skipped == "needs kiln_no_such_package (not installed)"
    assert not tiny.failed, tiny.measurements
    assert set(tiny.measurements) == {"eager", "kiln"}  # no warm starts in-process
    kiln_run = tiny.measurements["kiln"]
    assert kiln_run.median_ms is not None and kiln_run.median_ms > 0
    assert kiln_run.max_rel_error is not None and kiln_run.max_rel_error < 1e-5
    assert kiln_run.notes[0].startswith("kiln: 1 graph(s), 0 break(s)")
    assert (
        "[1/2] tiny_mlp " + mode + " · kiln.compile · compiling + first call" in stream.getvalue()
    )
    assert "| ok " in format_table(rows)


def test_compiler_crash_marks_the_row(tiny_suite: Options, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(kiln, "compile", broken)
    tiny_suite.models = ["tiny_mlp"]
    (row,) = run_suite(tiny_suite, Progress(io.StringIO(), live=False))
    assert row.failed
    assert row.measurements["kiln"].error == "RuntimeError: compiler exploded"
    assert "FAIL: kiln error" in format_table([row])


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_a_wrong_first_call_alone_marks_the_row(
    tiny_suite: Options, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The first call (the one that compiles) is judged against eager too, not only a later
    one: a compiler right from its second call on still fails the row."""
    compile_for_real = kiln.compile

    def wrong_once(model: nn.Module, **options: object) -> object:
        compiled = compile_for_real(model, **options)
        calls = []

        def run(*args: torch.Tensor) -> torch.Tensor:
            calls.append(None)
            output = compiled(*args)
            return output * 1.5 if len(calls) == 1 else output

        return run

    monkeypatch.setattr(kiln, "compile", wrong_once)
    tiny_suite.models, tiny_suite.mode = ["tiny_mlp"], mode
    (row,) = run_suite(tiny_suite, Progress(io.StringIO(), live=False))
    measured = row.measurements["kiln"]
    assert row.failed and not measured.ok, measured
    assert any("first call: largest error" in note for note in measured.notes), measured.notes
    assert measured.max_rel_error is not None and measured.max_rel_error > 0.1


def test_json_output(tiny_suite: Options, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", "tiny_mlp", "--compilers", "kiln", "--in-process", "--budget", "0.05"]
    assert main(["bench", *argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["command"] == "kiln bench " + " ".join(argv) + " --json"
    assert document["environment"]["torch"] == torch.__version__
    (row,) = document["rows"]
    assert row["model"] == "tiny_mlp" and not row["failed"]
    assert row["measurements"]["kiln"]["median_ms"] > 0


def test_the_json_file_keeps_every_finished_row_when_a_run_is_cut_off(
    tiny_suite: Options, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A device call's time limit can end a bench between rows: the file written after each
    row keeps the finished ones (``benchmarks/broad.py --deadline`` tables them)."""
    from kiln.bench import runner

    finished: list[str] = []
    real_row = runner.run_row

    def row_then_cut_off(spec, options, progress, counter=""):  # type: ignore[no-untyped-def]
        if finished:  # the second row: the limit strikes
            on_disk = json.loads((tmp_path / "rows.json").read_text())
            assert [row["model"] for row in on_disk["rows"]] == finished
            assert on_disk["complete"] is False
            raise KeyboardInterrupt
        row = real_row(spec, options, progress, counter)
        finished.append(row.model)
        return row

    monkeypatch.setattr(runner, "run_row", row_then_cut_off)
    argv = ["--models", "tiny_mlp,tiny_mlp", "--compilers", "kiln", "--in-process"]
    with pytest.raises(KeyboardInterrupt):
        main(["bench", *argv, "--budget", "0.05", "--json", str(tmp_path / "rows.json")])
    document = json.loads((tmp_path / "rows.json").read_text())
    (row,) = document["rows"]
    assert row["model"] == "tiny_mlp" and not row["failed"] and not document["complete"]
    assert not (tmp_path / "rows.json.partial").exists()


def test_worker_processes_and_warm_start() -> None:
    """The real path: each measurement in its own ``python -m kiln.bench.worker`` process."""
    argv = ["--models", "small_cnn", "--batch", "1", "--compilers", "kiln", "--budget", "0.05"]
    done = subprocess.run(
        [sys.executable, "-m", "kiln.bench", *argv, "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "small_cnn infer · kiln.compile (warm start) · first call" in done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| small_cnn"))
    assert re.search(r"\| ok +\|$", row), row


def test_every_worker_runs_with_mallocs_thresholds_pinned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """glibc's malloc could hand the heap's top back after each eager step and fault it in
    again (small CPU models: 1.7-2.5 ms a step against 1.0): every compiler's worker gets the
    same pinned thresholds, keeping the caller's own tunables."""
    from kiln.bench import runner

    seen: list[dict[str, str]] = []

    class Stop(Exception):
        pass

    def popen(*args: object, env: dict[str, str], **kwargs: object) -> None:
        seen.append(env)
        raise Stop

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    job = runner.Job("small_cnn", "infer", "eager", "cpu", "float32", 1, "")
    with pytest.raises(Stop):
        runner._run_in_subprocess(job, Progress(io.StringIO()), str(tmp_path))
    tunables = seen[0]["GLIBC_TUNABLES"].split(":")
    assert tunables[0] == "glibc.pthread.rseq=0"
    assert "glibc.malloc.trim_threshold=1073741824" in tunables


@pytest.mark.parametrize(
    "name", [n for n in models.SUITES["broad-tiny"] if "torchvision" in models.MODELS[n].requires]
)
def test_torchvision_training_steps_draw_no_random_numbers(name: str) -> None:
    """Kiln draws its own random numbers, so a suite model whose training step drops paths or
    units (ConvNeXt's, Swin's, MaxViT's stochastic depth, MobileNet's dropout) could never
    match eager's, and its check column would fail on every run, hiding real bugs: two eager
    steps under different seeds give the same gradients."""
    pytest.importorskip("torchvision")
    model, inputs, step = prepare(name, "train", torch.device("cpu"), torch.float32)
    grads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        step(model, inputs)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert grads[0]
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)


def test_the_suites_keyword_wrapper_is_compiled_as_user_code() -> None:
    """``KeywordModel`` lives in ``kiln.bench``, but it is the model the bench runs: when its
    callee breaks, its own frame and the callee's are still compiled (they ran uncompiled, as
    Kiln's internals do, so an encoder-decoder with LayerDrop trained with 0 graphs)."""
    from kiln.bench.models import KeywordModel

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            for _ in range(2):  # a break in a loop: this frame runs with its calls routed
                if input_ids.sum() > 0:
                    input_ids = input_ids * 2
                input_ids = self.fc(input_ids)
            return input_ids

    model = KeywordModel(Inner(), ("input_ids",))
    kiln.reset()
    kiln.counters.reset()
    compiled = kiln.compile(model)
    for _ in range(2):
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), model(x))
    assert kiln.counters.graphs >= 1
