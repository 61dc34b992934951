"""Bad input to the ``kiln`` commands: one line on stderr and a non-zero exit, no traceback."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kiln.bench import kernels, models, overhead
from kiln.bench.command import main as bench_main
from kiln.cli import main

NO_GPU = not torch.cuda.is_available()


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["bench", "--models", "no_such_model"], ["unknown model 'no_such_model'", "tiny_gpt"]),
        (["bench", "--models", ","], ["--models is empty"]),
        (["bench", "--mode", "sideways"], ["invalid choice: 'sideways'"]),
        (["bench", "--batch", "0"], ["--batch must be positive"]),
        (["bench", "--compilers", "tvm"], ["unknown compiler 'tvm'"]),
        (["bench", "--device", "tpu"], ["device"]),
        (["bench", "--batch", "many"], ["invalid int value"]),
        (["demo", "--backend", "nope"], ["unknown backend 'nope'"]),
        (["explain", "no/such/script.py"], ["no such script: no/such/script.py"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status: object
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors exit
        status = exit_.code
    assert status == 2
    _one_line_error(capsys, *needles)


@pytest.mark.skipif(not NO_GPU, reason="needs a machine without a GPU")
@pytest.mark.parametrize(
    "run",
    [
        lambda: main(["bench", "--device", "cuda"]),
        lambda: main(["demo", "--device", "cuda"]),
        lambda: bench_main(["--device", "cuda:0"]),
        lambda: kernels.main(["--device", "cuda"]),
        lambda: overhead.main(["--device", "cuda"]),
    ],
)
def test_cuda_without_gpu(run: Callable[[], int], capsys: pytest.CaptureFixture[str]) -> None:
    assert run() == 2
    _one_line_error(capsys, "no CUDA GPU")


def test_named_model_with_missing_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = dataclasses.replace(models.MODELS["tiny_gpt"], requires=("kiln_no_such_package",))
    monkeypatch.setitem(models.MODELS, "tiny_gpt", spec)
    assert main(["bench", "--models", "tiny_gpt"]) == 2
    _one_line_error(capsys, "needs kiln_no_such_package")


def test_kernels_without_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if not NO_GPU:
        pytest.skip("has a GPU")
    assert kernels.main([]) == 0
    assert "no GPU here" in capsys.readouterr().out


@pytest.mark.parametrize(
    "run",
    [
        lambda: kernels.main(["--device", "cpu", "--shape", "8by8"]),
        lambda: kernels.main(["--device", "cpu", "--compilers", "xla"]),
        lambda: overhead.main(["--compilers", "xla"]),
    ],
)
def test_microbenchmark_bad_input(
    run: Callable[[], int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run() == 2
    _one_line_error(capsys, "error")
