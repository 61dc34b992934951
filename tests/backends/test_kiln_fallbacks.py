"""The kiln backend when it cannot compile: a missing generator warns once and the graphs run on
the reference interpreter; a failed build names its source and falls back for that graph; a
graph that draws random numbers never falls back alone; strict mode raises."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import kiln
import kiln.backends.kernels as kernels
import kiln.backends.kiln as backend
from kiln.errors import KernelBuildError


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    kiln.reset()
    monkeypatch.setattr(backend, "_WARNED", set())


def _compile(fn: object, **options: object) -> Any:
    """``fn`` compiled for C++ kernels, falling back where they cannot build."""
    return kiln.compile(fn, options={"codegen": "cpp", "strict": False, **options})


def _functions() -> list[tuple[object, torch.Tensor]]:
    return [
        (lambda x: torch.relu(x) * 2, torch.randn(5, 3)),
        (lambda x: torch.softmax(x + 1, -1), torch.randn(4, 6)),
    ]


def test_missing_compiler_warns_once_and_results_stay_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernels, "cpp_compiler_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn, x in _functions():
            torch.testing.assert_close(_compile(fn)(x), fn(x))  # type: ignore[operator]
    messages = [str(w.message) for w in caught if "kiln" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler" in messages[0]


def test_missing_triton_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda *a, **k: "Triton is not installed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn, x in _functions():
            torch.testing.assert_close(_compile(fn, codegen="triton")(x), fn(x))  # type: ignore[operator]
    messages = [str(w.message) for w in caught if "kiln" in str(w.message)]
    assert messages == ["kiln: graphs run on the reference interpreter: Triton is not installed"]


def _broken_build(*args: object, **kwargs: object) -> object:
    raise KernelBuildError("g++ failed on /tmp/kiln/k0_relu.cpp:\nerror: expected ';'")


def test_a_failed_build_names_its_source_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load_kernels", _broken_build)
    fn, x = _functions()[0]
    with pytest.warns(UserWarning, match=r"k0_relu\.cpp"):
        result = _compile(fn)(x)  # type: ignore[arg-type]
    torch.testing.assert_close(result, fn(x))  # type: ignore[operator]


def test_strict_mode_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load_kernels", _broken_build)
    fn, x = _functions()[0]
    with pytest.raises(KernelBuildError, match=r"k0_relu\.cpp"):
        _compile(fn, strict=True)(x)  # type: ignore[arg-type]


def test_random_graphs_do_not_fall_back_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load_kernels", _broken_build)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, 0.5, training=True)

    with pytest.raises(KernelBuildError):
        _compile(noisy)(torch.randn(16))
