"""The public backend API: ``kiln.register_backend``, ``kiln.get_backend``,
``kiln.list_backends``, entry-point discovery, and the fallback of a backend that raises."""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kiln
from kiln.backends import registry
from kiln.errors import BackendError
from kiln.ir import interpret


def program(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * y + 1).sum(0)


@pytest.fixture
def forget() -> Iterator[list[str]]:
    """Names of backends a test registers, unregistered after it."""
    names: list[str] = []
    yield names
    for name in names:
        registry._BACKENDS.pop(name, None)


def test_user_backend_receives_graph_and_inputs_and_its_callable_runs(forget: list[str]) -> None:
    seen: list[tuple[kiln.Graph, list[torch.Tensor]]] = []
    calls: list[int] = []

    def compile_fn(graph: kiln.Graph, example_inputs: list[torch.Tensor]) -> Any:
        seen.append((graph, example_inputs))

        def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            calls.append(len(inputs))
            return interpret(graph, inputs)

        return run

    kiln.register_backend("recording-backend", compile_fn)
    forget.append("recording-backend")
    assert "recording-backend" in kiln.list_backends()
    kiln.reset()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = kiln.compile(program, backend="recording-backend")
    torch.testing.assert_close(compiled(x, y), program(x, y))
    torch.testing.assert_close(compiled(y, x), program(y, x))
    assert len(seen) == 1 and calls == [2, 2]  # compiled once, its callable ran each call
    graph, example = seen[0]
    assert [node.op.printed_name for node in graph.nodes] == ["mul", "add", "tanh", "sum"]
    assert [t.shape for t in example] == [x.shape, y.shape]
    assert example[0] is x and example[1] is y  # the first call's tensors
    assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks


def test_get_backend_gives_compile_functions_of_builtin_backends() -> None:
    x, y = torch.randn(2, 5), torch.randn(2, 5)
    graph = kiln.trace(program, x, y)
    for name in ("eager", "kiln", "numpy"):
        compiled = kiln.get_backend(name)(graph, [x, y])
        torch.testing.assert_close(compiled([x, y])[0], program(x, y))
    assert {"eager", "kiln", "numpy"} <= set(kiln.list_backends())


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(BackendError, match=r"unknown backend 'tpu' \(registered: eager, kiln, "):
        kiln.compile(program, backend="tpu")
    with pytest.raises(BackendError, match="numpy"):
        kiln.get_backend("tpu")


def test_second_backend_of_a_name_is_an_error(forget: list[str]) -> None:
    kiln.register_backend("twice", lambda graph, inputs: lambda xs: interpret(graph, xs))
    forget.append("twice")
    with pytest.raises(ValueError, match="already registered"):
        kiln.register_backend("twice", lambda graph, inputs: None)


def _raising(graph: kiln.Graph, example_inputs: list[torch.Tensor]) -> Any:
    raise ValueError("no kernel for this chip")


def test_raising_backend_falls_back_to_kiln_with_a_warning(
    forget: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    kiln.register_backend("raising", _raising)
    forget.append("raising")
    kiln.reset()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = kiln.compile(program, backend="raising", options={"codegen": "evaluate"})
    message = r"backend 'raising' failed to compile graph program \(ValueError: no kernel"
    with (
        caplog.at_level(logging.WARNING, "kiln.backends"),
        pytest.warns(UserWarning, match=message),
    ):
        torch.testing.assert_close(compiled(x, y), program(x, y))
    assert "runs on the default backend 'kiln'" in caplog.text
    assert not kiln.counters.fallbacks  # compiled, by the default backend
    with pytest.warns(UserWarning, match="no kernel for this chip"):
        report = kiln.explain(compiled, x, y)
    assert any("default backend 'kiln'" in line for line in report.backends), report
    assert "backends:" in str(report)


def test_raising_backend_raises_when_strict(forget: list[str]) -> None:
    kiln.register_backend("raising-strict", _raising)
    forget.append("raising-strict")
    kiln.reset()
    compiled = kiln.compile(program, backend="raising-strict", options={"strict": True})
    with pytest.raises(BackendError, match="raising-strict"):
        compiled(torch.randn(3), torch.randn(3))


def test_entry_point_backends_are_discovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forget: list[str]
) -> None:
    (tmp_path / "kiln_test_plugin.py").write_text(
        textwrap.dedent(
            """
            from kiln.ir import interpret
            calls = []
            def compile_fn(graph, example_inputs):
                calls.append(graph.name)
                return lambda inputs: interpret(graph, inputs)
            """
        )
    )
    info = tmp_path / "kiln_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[kiln.backends]\nplugin-chip = kiln_test_plugin:compile_fn\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_DISCOVERED", [])
    forget.append("plugin-chip")
    kiln.reset()
    x, y = torch.randn(4), torch.randn(4)
    compiled = kiln.compile(program, backend="plugin-chip")  # discovered on this first lookup
    torch.testing.assert_close(compiled(x, y), program(x, y))
    assert sys.modules["kiln_test_plugin"].calls == ["program"]
    assert "plugin-chip" in kiln.list_backends()


def test_raising_backend_with_random_ops_raises(forget: list[str]) -> None:
    """The default backend would draw another dropout mask than the backend's backward."""
    kiln.register_backend("raising-random", _raising)
    forget.append("raising-random")
    kiln.reset()

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * 2, 0.5)

    compiled = kiln.compile(noisy, backend="raising-random")
    with pytest.raises(BackendError, match="raising-random"):
        compiled(torch.randn(8, requires_grad=True))
