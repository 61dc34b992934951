"""The capture conformance harness: run a program eagerly and compiled, demand the same results.

``check(fn, *args)`` deep-copies the inputs twice, runs ``fn`` eagerly on one copy and
``kiln.compile(fn)`` (fresh, after ``kiln.reset()``) on the other, ``calls`` times each, and
compares after every call:

- the outputs as pytrees: container types, lengths and keys; tensors with ``assert_close``
  (values, dtype, shape, device) plus ``requires_grad``; other leaves with ``==`` and type;
- aliasing: an output that *is* an input object (a tensor, a list stored in an argument) must be
  the corresponding compiled input; an output that shares storage with an input tensor must do
  so compiled too (and must not where eager does not); outputs that are one object stay one;
- exceptions: when eager raises, compiled raises the same exception type;
- the final state of every argument (tensors mutated in place, lists, dicts, objects'
  ``__dict__``, modules' parameters, buffers and public attributes).

With ``graphs``/``breaks``/``skips``, ``kiln.explain`` on a third copy must report that graph
count, those break reasons (in order) and those skip reasons. A capture that failed
internally and fell back to eager (``INTERNAL_ERROR``/``BACKEND_ERROR``) is always a failure.

Inputs: pass tensors, or :func:`rand` placeholders (``rand(3, 4)``), materialised with
``torch.randn`` when the test runs (the conftest seeds each test), or a zero-argument callable
returning the argument tuple (for aliasing or objects built around tensors).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import kiln

_FAILED_CAPTURE = (kiln.SkipReason.INTERNAL_ERROR, kiln.SkipReason.BACKEND_ERROR)


@dataclasses.dataclass(frozen=True)
class Rand:
    """A placeholder for ``torch.randn(*shape)`` created when the test runs."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool = False

    def make(self) -> torch.Tensor:
        return torch.randn(self.shape, dtype=self.dtype, requires_grad=self.requires_grad)


def rand(*shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> Rand:
    return Rand(shape, dtype, requires_grad)


def materialize(value: Any) -> Any:
    """Replace every :class:`Rand` in nested tuples/lists/dicts by a fresh random tensor."""
    if isinstance(value, Rand):
        return value.make()
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(materialize(v) for v in value)
    if isinstance(value, list):
        return [materialize(v) for v in value]
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


def make_args(args: Any) -> tuple[Any, ...]:
    """The argument tuple of a table entry: a callable builds it, otherwise placeholders."""
    if callable(args) and not isinstance(args, torch.nn.Module):
        return tuple(args())
    return tuple(materialize(tuple(args)))


# ---------------------------------------------------------------------------------------------
# Comparison


def assert_same(actual: Any, expected: Any, *, atol: float, rtol: float, path: str = "out") -> None:
    """``actual`` (compiled) equals ``expected`` (eager) as a pytree, container types included."""
    assert type(actual) is type(expected), (
        f"{path}: type {type(actual).__name__} != eager's {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        _assert_tensor(actual, expected, atol=atol, rtol=rtol, path=path)
    elif isinstance(expected, torch.nn.Module):
        _assert_module(actual, expected, atol=atol, rtol=rtol, path=path)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], atol=atol, rtol=rtol, path=f"{path}[{key!r}]")
        _assert_attributes(actual, expected, atol=atol, rtol=rtol, path=path)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, atol=atol, rtol=rtol, path=f"{path}[{i}]")
    elif isinstance(expected, types.MethodType):
        assert actual.__func__ is expected.__func__, f"{path}: a different method"
        assert_same(actual.__self__, expected.__self__, atol=atol, rtol=rtol, path=f"{path}.self")
    elif isinstance(expected, functools.partial):
        assert actual.func is expected.func, f"{path}: a partial of a different function"
        assert_same(
            (actual.args, actual.keywords),
            (expected.args, expected.keywords),
            atol=atol,
            rtol=rtol,
            path=f"{path}.args",
        )
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for f in dataclasses.fields(expected):
            assert_same(
                getattr(actual, f.name),
                getattr(expected, f.name),
                atol=atol,
                rtol=rtol,
                path=f"{path}.{f.name}",
            )
    elif _is_plain_object(expected):
        _assert_attributes(actual, expected, atol=atol, rtol=rtol, path=path)
    else:
        assert actual == expected, f"{path}: {actual!r} != eager's {expected!r}"


def _assert_tensor(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, path: str
) -> None:
    assert actual.requires_grad == expected.requires_grad, (
        f"{path}: requires_grad {actual.requires_grad} != eager's {expected.requires_grad}"
    )
    torch.testing.assert_close(
        actual.detach(), expected.detach(), atol=atol, rtol=rtol, msg=lambda m: f"{path}: {m}"
    )


def _assert_module(
    actual: torch.nn.Module, expected: torch.nn.Module, *, atol: float, rtol: float, path: str
) -> None:
    assert actual.training == expected.training, f"{path}.training differs"
    for kind in ("named_parameters", "named_buffers"):
        a = dict(getattr(actual, kind)())
        e = dict(getattr(expected, kind)())
        assert list(a) == list(e), f"{path}: {kind} {list(a)} != {list(e)}"
        for name in e:
            assert_same(a[name], e[name], atol=atol, rtol=rtol, path=f"{path}.{name}")
    for name, value in vars(expected).items():
        if not name.startswith("_") and name != "training":
            assert name in vars(actual), f"{path}.{name} missing"
            assert_same(vars(actual)[name], value, atol=atol, rtol=rtol, path=f"{path}.{name}")
    extra = {n for n in vars(actual) if not n.startswith("_")} - set(vars(expected))
    assert not extra, f"{path}: attributes {sorted(extra)} set compiled but not eagerly"


def _is_plain_object(value: Any) -> bool:
    return hasattr(value, "__dict__") and not isinstance(
        value,
        (type, Callable, torch.dtype, torch.device),  # type: ignore[arg-type]
    )


def _assert_attributes(actual: Any, expected: Any, *, atol: float, rtol: float, path: str) -> None:
    e = getattr(expected, "__dict__", None)
    if e is None:
        return
    a = vars(actual)
    assert sorted(a) == sorted(e), f"{path}: attributes {sorted(a)} != eager's {sorted(e)}"
    for name in e:
        assert_same(a[name], e[name], atol=atol, rtol=rtol, path=f"{path}.{name}")


# ---------------------------------------------------------------------------------------------
# Aliasing


def _walk(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every object reachable through containers, plain objects and modules' tensors."""
    yield path, value
    if depth > 6:
        return
    if isinstance(value, torch.nn.Module):
        for name, tensor in value.state_dict(keep_vars=True).items():
            yield f"{path}.{name}", tensor
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]", depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name), f"{path}.{f.name}", depth + 1)
    elif _is_plain_object(value) and not isinstance(value, torch.Tensor):
        for name, item in vars(value).items():
            yield from _walk(item, f"{path}.{name}", depth + 1)


def _identity_matters(value: Any) -> bool:
    """Objects whose identity eager code can observe (not interned ints, strings, None)."""
    return isinstance(value, (torch.Tensor, list, dict, set, torch.nn.Module)) or (
        _is_plain_object(value) and not isinstance(value, (tuple, str))
    )


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def assert_same_aliasing(
    actual_out: Any, expected_out: Any, actual_inputs: Any, expected_inputs: Any
) -> None:
    """Identity and storage sharing between outputs and inputs follow eager's."""
    e_inputs = dict(_walk(expected_inputs, "args"))
    a_inputs = dict(_walk(actual_inputs, "args"))
    e_by_id = {id(v): p for p, v in e_inputs.items() if _identity_matters(v)}
    e_storages = {
        _storage(v): p for p, v in e_inputs.items() if isinstance(v, torch.Tensor) and v.numel()
    }
    a_outs = dict(_walk(actual_out, "out"))
    seen: dict[int, str] = {}
    for path, e in _walk(expected_out, "out"):
        if not _identity_matters(e) or path not in a_outs:
            continue
        a = a_outs[path]
        if id(e) in e_by_id:
            source = e_by_id[id(e)]
            assert a is a_inputs.get(source), (
                f"{path} is {source} in eager, but compiled returned a different object"
            )
        if id(e) in seen:
            assert a is a_outs[seen[id(e)]], f"{path} is {seen[id(e)]} in eager, not compiled"
        seen.setdefault(id(e), path)
        if isinstance(e, torch.Tensor) and e.numel() and isinstance(a, torch.Tensor):
            source = e_storages.get(_storage(e))
            a_shares = {p for p, v in a_inputs.items() if isinstance(v, torch.Tensor) and v.numel()}
            a_shares = {p for p in a_shares if _storage(a_inputs[p]) == _storage(a)}
            if source is not None:
                assert source in a_shares, (
                    f"{path} is a view of {source} in eager, but compiled it is not"
                )
            else:
                assert not a_shares, (
                    f"{path} shares memory with {sorted(a_shares)} compiled, but not in eager"
                )


# ---------------------------------------------------------------------------------------------
# Running


def _run(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(result, None) or (None, exception)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as error:
        return None, error


def failed_captures() -> list[str]:
    """Frames that fell back to eager because capture or the backend crashed."""
    return [str(r) for r in kiln.counters.fallbacks if r.reason in _FAILED_CAPTURE]


def check(
    fn: Callable[..., Any],
    *args: Any,
    graphs: int | None = None,
    breaks: Sequence[kiln.BreakReason] | None = None,
    skips: Sequence[kiln.SkipReason] | None = None,
    fullgraph: bool = False,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    calls: int = 2,
    **kwargs: Any,
) -> None:
    """``kiln.compile(fn)`` behaves as ``fn`` on these inputs (see the module docstring)."""
    args = materialize(args)
    kwargs = materialize(kwargs)
    eager_args, eager_kwargs = copy.deepcopy((args, kwargs))
    compiled_args, compiled_kwargs = copy.deepcopy((args, kwargs))
    explain_args, explain_kwargs = copy.deepcopy((args, kwargs))

    kiln.reset()
    compiled = kiln.compile(fn, fullgraph=fullgraph)
    raised: Exception | None = None
    for call in range(calls):
        expected, eager_error = _run(fn, eager_args, eager_kwargs)
        actual, compiled_error = _run(compiled, compiled_args, compiled_kwargs)
        where = f"call {call + 1}"
        if eager_error is not None:
            assert compiled_error is not None, (
                f"{where}: eager raised {type(eager_error).__name__}: {eager_error}, "
                f"compiled returned {actual!r}"
            )
            assert type(compiled_error) is type(eager_error), (
                f"{where}: compiled raised {type(compiled_error).__name__}: {compiled_error}; "
                f"eager raised {type(eager_error).__name__}: {eager_error}"
            )
        elif compiled_error is not None:
            raise AssertionError(
                f"{where}: compiled raised {type(compiled_error).__name__}: {compiled_error}"
            ) from compiled_error
        else:
            assert_same(actual, expected, atol=atol, rtol=rtol, path=f"{where}: out")
            assert_same_aliasing(
                actual, expected, (compiled_args, compiled_kwargs), (eager_args, eager_kwargs)
            )
        assert_same(
            (compiled_args, compiled_kwargs),
            (eager_args, eager_kwargs),
            atol=atol,
            rtol=rtol,
            path=f"{where}: inputs after the call",
        )
        raised = eager_error
    crashed = failed_captures()
    assert not crashed, f"capture fell back to eager: {crashed}"
    if graphs is None and breaks is None and skips is None:
        return
    if raised is not None:
        # explain() calls the program, so it raises eager's exception and reports nothing.
        try:
            kiln.explain(fn, *explain_args, **explain_kwargs)
        except Exception as error:
            assert type(error) is type(raised), f"explain raised {error!r}, eager {raised!r}"
            return
        raise AssertionError(f"explain returned, but eager raised {raised!r}")
    report = kiln.explain(fn, *explain_args, **explain_kwargs)
    summary = f"\n{report}"
    if graphs is not None:
        assert report.graph_count == graphs, (
            f"{report.graph_count} graphs, expected {graphs}{summary}"
        )
    if breaks is not None:
        assert report.break_reasons == list(breaks), (
            f"breaks {report.break_reasons}, expected {list(breaks)}{summary}"
        )
    if skips is not None:
        got = [record.reason for record in report.skips]
        assert got == list(skips), f"skips {got}, expected {list(skips)}{summary}"


def line_of(fn: Callable[..., Any], marker: str) -> tuple[str, int]:
    """(file basename, line number) of the first line of ``fn`` containing ``marker``."""
    lines, first = inspect.getsourcelines(fn)
    for offset, text in enumerate(lines):
        if marker in text:
            return os.path.basename(inspect.getsourcefile(fn) or ""), first + offset
    raise AssertionError(f"{marker!r} not in the source of {fn.__qualname__}")


def case(
    id: str,
    fn: Callable[..., Any],
    *args: Any,
    build: Callable[[], Sequence[Any]] | None = None,
    graphs: int | None = 1,
    breaks: Sequence[kiln.BreakReason] | None = (),
    skips: Sequence[kiln.SkipReason] | None = (),
    **options: Any,
) -> Any:
    """One table row: a program, its inputs (or a ``build`` callable making them when the test
    runs) and the expected explain() facts (by default one graph, no breaks, no skips)."""
    import pytest

    expect = dict(
        graphs=graphs,
        breaks=None if breaks is None else list(breaks),
        skips=None if skips is None else list(skips),
        **options,
    )
    return pytest.param(fn, args, build, expect, id=id)


def run_case(
    fn: Callable[..., Any],
    args: Sequence[Any],
    build: Callable[[], Sequence[Any]] | None,
    expect: dict[str, Any],
) -> None:
    """The body of every table-driven conformance test."""
    check(fn, *(build() if build is not None else args), **expect)
