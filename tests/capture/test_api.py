"""The public surface of capture: compile's forms and options, fallbacks, logging, explain."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

import kiln
from kiln.backends.registry import _BACKENDS, add_backend
from kiln.capture.core.breaks import FullGraphError
from kiln.ir.graph import Graph


def double_plus(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * 2 + y


def test_decorator_forms() -> None:
    @kiln.compile
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    @kiln.compile(fullgraph=True)
    def configured(x: torch.Tensor) -> torch.Tensor:
        return x.cos()

    x = torch.randn(4)
    torch.testing.assert_close(plain(x), x.sin())
    torch.testing.assert_close(configured(x), x.cos())
    assert plain.__name__ == "plain" and plain.__wrapped__ is not None


def test_compiled_module_shares_parameters() -> None:
    model = torch.nn.Linear(3, 2)
    compiled = kiln.compile(model)
    assert isinstance(compiled, kiln.CompiledModule)
    assert compiled._orig_mod is model
    assert all(p is q for p, q in zip(compiled.parameters(), model.parameters(), strict=True))
    assert compiled.weight is model.weight
    x = torch.randn(5, 3)
    torch.testing.assert_close(compiled(x), model(x))
    with torch.no_grad():
        model.weight.mul_(2)  # in place: the same parameter, new values, no recompile
    torch.testing.assert_close(compiled(x), model(x))


def test_bound_method_compiles() -> None:
    model = torch.nn.Linear(3, 2)
    forward = kiln.compile(model.forward)
    x = torch.randn(4, 3)
    torch.testing.assert_close(forward(x), model(x))


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="mode"):
        kiln.compile(double_plus, mode="fastest")
    with pytest.raises(ValueError, match="unknown options"):
        kiln.compile(double_plus, options={"colour": "blue"})
    with pytest.raises(kiln.KilnError, match="unknown backend"):
        kiln.compile(double_plus, backend="nope")
    with pytest.raises(TypeError, match=r"callable or nn\.Module"):
        kiln.compile(42)


def test_fullgraph_error_names_line_and_reason() -> None:
    def prints(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        print("hi")  # the break
        return y

    with pytest.raises(FullGraphError, match=r"test_api\.py:\d+: print\(\"hi\"\).*IO"):
        kiln.compile(prints, fullgraph=True)(torch.randn(2))


@dataclass(frozen=True)
class FailingBackend:
    name: str = "failing-for-tests"

    def compile(self, graph: Graph, options: object) -> object:
        raise RuntimeError("this backend always fails")


@pytest.fixture
def failing_backend() -> str:
    backend = FailingBackend()
    if backend.name not in _BACKENDS:
        add_backend(backend)
    return backend.name


def test_backend_failure_falls_back_with_warning(failing_backend: str) -> None:
    kiln.reset()
    compiled = kiln.compile(double_plus, backend=failing_backend)
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(compiled(x, y), double_plus(x, y))  # right result, eagerly
    reasons = [record.reason for record in kiln.counters.fallbacks]
    assert reasons == [kiln.SkipReason.BACKEND_ERROR]


def test_backend_failure_raises_when_strict(
    failing_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.config import config

    kiln.reset()
    compiled = kiln.compile(double_plus, backend=failing_backend, options={"strict": True})
    with pytest.raises(RuntimeError, match="always fails"):
        compiled(torch.randn(3), torch.randn(3))
    # KILN_STRICT=1 sets the default of the option.
    kiln.reset()
    monkeypatch.setattr(config, "strict", True)
    compiled = kiln.compile(double_plus, backend=failing_backend)
    with pytest.raises(RuntimeError, match="always fails"):
        compiled(torch.randn(3), torch.randn(3))


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown options: \\['bogus'\\]"):
        kiln.compile(double_plus, options={"bogus": 1})
    with pytest.raises(ValueError, match="unknown codegen 'fortran'"):
        kiln.compile(double_plus, options={"codegen": "fortran"})
    with pytest.raises(ValueError, match="unknown mode"):
        kiln.compile(double_plus, mode="fastest")


def test_internal_capture_error_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in capture must never give a wrong result: the frame runs uncompiled, with a
    warning, or the error is raised under strict."""
    from kiln.capture.core import frame

    def broken(frame_: object, inst: object) -> None:
        raise AttributeError("simulated capture bug")

    monkeypatch.setitem(frame.HANDLERS, "BINARY_OP", broken)
    kiln.reset()
    x, y = torch.randn(3), torch.randn(3)
    with pytest.warns(UserWarning, match="runs uncompiled"):
        result = kiln.compile(double_plus)(x, y)
    torch.testing.assert_close(result, double_plus(x, y))
    assert kiln.counters.fallbacks[-1].reason is kiln.SkipReason.INTERNAL_ERROR
    kiln.reset()
    with pytest.raises(AttributeError, match="simulated"):
        kiln.compile(double_plus, options={"strict": True})(x, y)


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("graph", "graph of"),
        ("guards", "guards of"),
        ("graph_breaks", "graph break"),
        ("recompiles", "recompiling"),
    ],
)
def test_logging_topics(topic: str, expected: str, caplog: pytest.LogCaptureFixture) -> None:
    def breaks(x: torch.Tensor) -> torch.Tensor:
        kiln.graph_break()
        return x + 1

    kiln.reset()
    compiled = kiln.compile(breaks)
    with caplog.at_level(logging.INFO, logger=f"kiln.{topic}"):
        compiled(torch.randn(2))
        compiled(torch.randn(3))  # a new shape: recompile
    messages = [r.getMessage() for r in caplog.records if r.name == f"kiln.{topic}"]
    assert any(expected in message for message in messages), messages


def test_explain_summary_is_readable() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        print("between")
        return y.sum()

    report = kiln.explain(program, torch.randn(4))
    text = str(report)
    assert report.graph_count == 2
    assert "IO in " in text and 'print("between")' in text
    assert "L['x']: Tensor[float32, [4]" in text


def test_explain_lists_externs() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        return torch.special.i0(x) + 1  # no translation: an extern node

    report = kiln.explain(program, torch.rand(3))
    assert any("i0" in name for name in report.externs), report.externs


def test_is_compiling_true_during_capture_only() -> None:
    seen = []

    def program(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x + 1

    kiln.compile(program)(torch.randn(2))
    assert seen == [True]  # capture saw True; the list append replays on the call
    assert not torch.compiler.is_compiling()


def test_id_of_existing_objects_is_guarded() -> None:
    def program(x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
        distinct = {id(p) for p in model.parameters()}
        return x * len(distinct) + (1 if id(x) == id(x) else 0)

    model = torch.nn.Linear(2, 2)
    x = torch.randn(2)
    torch.testing.assert_close(kiln.compile(program)(x, model), program(x, model))
    assert not kiln.counters.fallbacks


def test_id_of_a_new_object_breaks() -> None:
    def program(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        return y * (id(y) > 0)

    report = kiln.explain(program, torch.randn(2))
    assert report.break_reasons == [kiln.BreakReason.UNSUPPORTED_CALL]


def test_functions_sharing_code_but_not_globals() -> None:
    """One code object, two globals dicts: the cache entry of one must not serve the other."""
    source = "def scaled(x):\n    return x * FACTOR\n"
    code = compile(source, "<shared>", "exec")
    first: dict[str, object] = {"FACTOR": 2.0}
    second: dict[str, object] = {"FACTOR": 3.0}
    exec(code, first)
    exec(code, second)
    x = torch.randn(3)
    torch.testing.assert_close(kiln.compile(first["scaled"])(x), x * 2.0)
    torch.testing.assert_close(kiln.compile(second["scaled"])(x), x * 3.0)
