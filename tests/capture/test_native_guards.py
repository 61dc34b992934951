"""Guards checked by the native extension (a plan: access paths walked and values checked in
C++) agree with the Python checks: tensors' metadata, identities, values, lengths, types,
through locals, attributes, items, globals, builtins, closures and weak references."""

from __future__ import annotations

import shutil
import threading
from typing import Any

import pytest
import torch

from kiln.capture.guards import guards as guard_module
from kiln.capture.guards import native_guards
from kiln.capture.guards.guards import (
    Equals,
    Guard,
    Identity,
    LengthIs,
    NativeCheck,
    SeparateMemory,
    TensorMatch,
    TypeIs,
    compile_guards,
)
from kiln.capture.guards.sources import (
    Attr,
    Builtin,
    Called,
    Closure,
    FunctionAttr,
    Global,
    Item,
    Local,
)

COUNT = native_guards.NATIVE_MIN_TENSORS + 4


@pytest.fixture(scope="module")
def native() -> Any:
    loaded = native_guards.load_now()
    if loaded is None and shutil.which("g++") is None:
        pytest.skip("the native guard extension does not build here (no g++)")
    assert loaded is not None, "the native guard extension failed to build (KILN_LOG=guards)"
    return loaded


def _tensors() -> list[torch.Tensor]:
    made: list[torch.Tensor] = []
    for i in range(COUNT):
        t = torch.randn(3 + i % 3, 4)
        if i % 4 == 1:
            t = t.t()  # strided
        if i % 4 == 2:
            t = torch.nn.Parameter(t)  # another type, requires_grad
        if i % 4 == 3:
            t = t.to(torch.float64)
        made.append(t)
    return made


def _guard_functions(tensors: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> Any:
    names = [f"x{i}" for i in range(len(tensors))]
    guards = [TensorMatch.of(Local(n), t) for n, t in zip(names, tensors, strict=True)]
    return _both(guards, names, monkeypatch)


def _both(guards: list[Guard], names: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The guard function with the native plan, and the one in Python only."""
    native_fn, native_source, _ = compile_guards(guards, names)
    with monkeypatch.context() as patch:
        patch.setattr(native_guards, "_module", None)
        patch.setattr(native_guards, "request", lambda: None)
        python_fn, python_source, _ = compile_guards(guards, names)
    assert "native_check" in native_source and "native_check" not in python_source
    return native_fn, python_fn


def _variants(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """The captured tensors, then one changed position each: every property the guard checks."""
    changed: list[list[Any]] = [list(tensors)]
    base = tensors[0]
    replacements = [
        base.to(torch.float64),  # dtype
        torch.randn(base.shape[0] + 1, base.shape[1]),  # shape
        base.t().contiguous().t(),  # strides
        torch.nn.Parameter(base.clone()),  # type (and requires_grad)
        base.clone().requires_grad_(True),  # requires_grad
        base.to("meta"),  # device
        base.tolist(),  # not a tensor
        base.clone(),  # equal metadata: passes
    ]
    for replacement in replacements:
        changed.append([replacement, *tensors[1:]])
    last = list(tensors)
    last[-1] = tensors[-1].to(torch.float32) if tensors[-1].dtype != torch.float32 else tensors[-1]
    changed.append(last)
    return changed


def test_native_tensor_checks_agree_with_python(
    native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = _tensors()
    native_fn, python_fn = _guard_functions(tensors, monkeypatch)
    results = []
    for arguments in _variants(tensors):
        expected = python_fn(None, *arguments)
        assert native_fn(None, *arguments) is expected
        results.append(expected)
    # captured; dtype, shape, strides, type, requires_grad, device, a list; equal; last dtype
    assert results == [True, False, False, False, False, False, False, False, True, False]


def test_few_tensors_stay_in_python(native: Any) -> None:
    tensors = _tensors()[:3]
    names = [f"x{i}" for i in range(3)]
    guards = [TensorMatch.of(Local(n), t) for n, t in zip(names, tensors, strict=True)]
    _, source, _ = compile_guards(guards, names)
    assert "native_check" not in source


def test_a_guard_built_before_the_extension_is_rebuilt_natively(
    native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache entry made while the extension was still building checks in Python, and gets a
    native guard when the build's callbacks run; it still accepts and rejects as before."""
    import kiln

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(COUNT // 2)])
    compiled = kiln.compile(model)
    x = torch.randn(2, 4)
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(native_guards, "_module", None)
        patch.setattr(native_guards, "_state", "building")
        patch.setattr(native_guards, "_callbacks", [])
        patch.setattr(native_guards.config, "native_guards", True)
        torch.testing.assert_close(compiled(x), model(x))
        callbacks = list(native_guards._callbacks)
    entry = compiled._kiln_call._kiln_cache.entries[0]
    assert "native_check" not in entry.guard_source and len(callbacks) == 1
    callbacks[0]()
    assert "native_check" in entry.guard_source
    fn = compiled._kiln_call.__wrapped__
    with torch.no_grad():
        assert entry.guard(fn, model, (x,), {})
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.data = model[0].weight.data.double()
        assert not entry.guard(fn, model, (x,), {})


def test_a_guard_compiled_while_the_extension_loads_is_rebuilt_natively(
    native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extension loads from the disk cache in its thread within milliseconds: after the
    first guard set was compiled in Python (not loaded yet) but before its entry was installed.
    The entry must still get the native guard (it stayed in Python: a RegNet's guard took
    355 us a call instead of 145)."""
    import kiln

    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(COUNT // 2)])
    compiled = kiln.compile(model)
    x = torch.randn(2, 4)
    captures, hits = kiln.counters.captures, kiln.counters.cache_hits

    def loads_at_once() -> None:  # request(): the thread finds the built extension on disk
        native_guards._module, native_guards._state = native, "ready"

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(native_guards, "_module", None)
        patch.setattr(native_guards, "_state", "idle")
        patch.setattr(native_guards, "request", loads_at_once)
        patch.setattr(native_guards.config, "native_guards", True)
        torch.testing.assert_close(compiled(x), model(x))
        entry = compiled._kiln_call._kiln_cache.entries[0]
        assert "native_check" in entry.guard_source
        torch.testing.assert_close(compiled(x), model(x))
        assert kiln.counters.captures == captures + 1 and kiln.counters.cache_hits == hits + 1


def test_native_check_class_describes_itself(native: Any) -> None:
    tensors = _tensors()
    members = tuple(TensorMatch.of(Local(f"x{i}"), t) for i, t in enumerate(tensors))
    check = NativeCheck(None, "", members, None, None)
    assert str(len(tensors)) in check.describe()


class _Holder:
    def __init__(self) -> None:
        self.config = {"stride": (2, 2), "name": "conv", "flag": True, "none": None}
        self.children = {f"c{i}": torch.nn.Identity() for i in range(40)}
        self.hooks: dict[int, Any] = {}
        self.scale = 1.5


HELPER = torch.nn.functional


def test_native_plans_agree_with_python_on_every_path_and_check(
    native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every guard kind the plan takes, on every kind of access path, passes on the captured
    objects and fails, as the Python guard does, on each single change."""
    holder, target = _Holder(), torch.nn.Linear(2, 2)
    reference = __import__("weakref").ref(target)
    cell = torch.zeros(3)

    def frame_function() -> Any:
        return cell

    h = Local("h")
    guards: list[Guard] = [
        Identity(Global("HELPER", globals()), "", HELPER),
        Identity(Builtin("len"), "", len),
        TensorMatch.of(Closure(0, "cell"), cell),
        Identity(FunctionAttr("__globals__"), "", frame_function.__globals__),
        Identity(Called(Local("r")), "", target),
        Equals(Item(Attr(h, "config"), "stride"), "", (2, 2)),
        Equals(Item(Attr(h, "config"), "name"), "", "conv"),
        Equals(Item(Attr(h, "config"), "flag"), "", True),
        Equals(Item(Attr(h, "config"), "none"), "", None),
        Equals(Attr(h, "scale"), "", 1.5),
        LengthIs(Attr(h, "hooks"), "", 0),
        TypeIs(h, "", _Holder),
    ]
    for key, child in holder.children.items():
        guards.append(Identity(Item(Attr(h, "children"), key), "", child))
        guards.append(TypeIs(Item(Attr(h, "children"), key), "", torch.nn.Identity))
    native_fn, python_fn = _both(guards, ["h", "r"], monkeypatch)

    def agree(fn: Any = frame_function, ref: Any = reference) -> bool:
        expected = python_fn(fn, holder, ref)
        assert native_fn(fn, holder, ref) is expected
        return expected

    assert agree()
    changes = [
        lambda: holder.config.update(stride=(1, 1)),
        lambda: holder.config.update(name="other"),
        lambda: holder.config.update(flag=1),  # equal to True, not True
        lambda: holder.config.update(none=0),
        lambda: setattr(holder, "scale", 1),  # equal to 1.5? no; and an int
        lambda: holder.hooks.update({0: print}),
        lambda: holder.children.update(c7=torch.nn.Identity()),
        lambda: holder.children.pop("c39"),
        lambda: holder.config.pop("stride"),
        lambda: delattr(holder, "hooks"),
        lambda: cell.resize_(4),
    ]
    for change in changes:
        saved = (dict(holder.config), dict(holder.children), dict(holder.hooks), holder.scale)
        change()
        assert not agree(), change
        holder.config, holder.children = saved[0], saved[1]
        holder.hooks, holder.scale = saved[2], saved[3]
        cell.resize_(3)
        assert agree()
    assert not agree(lambda: None)  # another function: no closure cell
    other = torch.nn.Linear(2, 2)
    assert not agree(ref=__import__("weakref").ref(other))  # it points to another object


def test_turned_off_the_extension_is_neither_built_nor_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KILN_NATIVE_GUARDS=0``: guards check in Python, no build starts, no entry waits."""
    monkeypatch.setattr(native_guards.config, "native_guards", False)
    monkeypatch.setattr(native_guards, "_module", None)
    monkeypatch.setattr(native_guards, "_state", "idle")
    tensors = _tensors()
    names = [f"x{i}" for i in range(len(tensors))]
    guards = [TensorMatch.of(Local(n), t) for n, t in zip(names, tensors, strict=True)]
    function, source, _ = compile_guards(guards, names)
    assert "native_check" not in source and function(None, *tensors)
    assert native_guards._state == "idle" and not guard_module.wants_native(guards, source)


def test_waiting_returns_when_the_build_finishes_or_at_once_without_one(
    native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmarks' wait: immediate without a build in flight (idle, failed, loaded), and
    released by the build's end otherwise."""
    assert native_guards.wait(timeout=5)  # loaded (the fixture built it)
    monkeypatch.setattr(native_guards, "_module", None)
    monkeypatch.setattr(native_guards, "_callbacks", [])
    for state in ("idle", "failed"):
        monkeypatch.setattr(native_guards, "_state", state)
        assert not native_guards.wait(timeout=5)
    monkeypatch.setattr(native_guards, "_state", "building")
    finish = threading.Timer(0.2, native_guards._build_and_load)
    finish.start()
    assert native_guards.wait(timeout=30)
    finish.join()


def test_native_separate_memory_agrees_with_python(
    native: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The written inputs share no storage with each other or the others (BatchNorm buffers
    among a training step's inputs): checked in the plan, failing as Python's check does."""
    tensors = [torch.randn(3) for _ in range(70)]
    names = [f"x{i}" for i in range(70)]
    guards: list[Guard] = [TensorMatch.of(Local(n), t) for n, t in zip(names, tensors, strict=True)]
    written = tuple(Local(n) for n in names[:5])
    guards.append(SeparateMemory(None, "", written, tuple(Local(n) for n in names[5:])))
    native_fn, python_fn = _both(guards, names, monkeypatch)
    _, native_source, _ = compile_guards(guards, names)
    assert "storages_separate" not in native_source  # (checked in the plan)
    base = torch.randn(6)
    cases = [
        list(tensors),  # separate: passes
        [tensors[1], *tensors[1:]],  # two written tensors are one
        [*tensors[:5], tensors[0], *tensors[6:]],  # another input is a written one
        [base[:3], *tensors[1:5], base[3:], *tensors[6:]],  # views of one storage
        [base[:3], *tensors[1:]],  # a view, but of a storage no other input holds: passes
    ]
    for case in cases:
        assert native_fn(None, *case) is python_fn(None, *case), case
    assert [native_fn(None, *case) for case in cases] == [True, False, False, False, True]
