"""Guards and recompiles: changing any guarded property recompiles exactly once, the result is
never stale, and the recorded reason names the guard that failed. Also the recompile limit
(then the frame runs uncompiled, still correctly), cache-hit counting, and ``kiln.reset()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.capture.driver.cache import _number_hint

FACTOR = 2


def double(t):
    return t * 2


def triple(t):
    return t * 3


ACTIVATION = double


def tensor_program(x):
    return x.sin() * 2 + x.sum()


def int_program(x, n):
    return x * n + n


def string_program(x, mode):
    if mode == "relu":
        return x.relu()
    return x.tanh()


def bool_program(x, flag):
    return x + 1 if flag else x - 1


def none_program(x, bias):
    return x * 2 if bias is None else x * 2 + bias


def global_int_program(x):
    return x * FACTOR


def global_function_program(x):
    return ACTIVATION(x) + 1


def creation_program(x):
    return x + torch.ones(3)


def matmul_program(x, w):
    return x @ w


class Dropoutish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.training:
            return y * 2
        return y - 1


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def global_value(name: str, value: Any) -> Iterator[None]:
    saved = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = saved


def nothing() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def bf16_autocast() -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


# (id, program, first args, second args, context of the second call, words one of which the
#  recompile reason must contain)
Change = tuple[
    str,
    Callable[..., Any],
    Callable[[], tuple],
    Callable[[], tuple],
    Callable[[], Any],
    tuple[str, ...],
]

x34 = lambda: torch.randn(3, 4)

CHANGES: list[Change] = [
    ("dtype", tensor_program, lambda: (x34(),), lambda: (x34().double(),), nothing, ("L['x']",)),
    ("shape", tensor_program, lambda: (x34(),), lambda: (torch.randn(5, 4),), nothing, ("L['x']",)),
    (
        "strides",
        tensor_program,
        lambda: (x34(),),
        lambda: (torch.randn(4, 3).t(),),
        nothing,
        ("L['x']",),
    ),
    (
        "requires_grad",
        tensor_program,
        lambda: (x34(),),
        lambda: (x34().requires_grad_(),),
        nothing,
        ("L['x']",),
    ),
    ("int_arg", int_program, lambda: (x34(), 2), lambda: (x34(), 3), nothing, ("L['n']",)),
    (
        "string_arg",
        string_program,
        lambda: (x34(), "relu"),
        lambda: (x34(), "tanh"),
        nothing,
        ("L['mode']",),
    ),
    (
        "bool_arg",
        bool_program,
        lambda: (x34(), True),
        lambda: (x34(), False),
        nothing,
        ("L['flag']",),
    ),
    (
        "none_arg",
        none_program,
        lambda: (x34(), None),
        lambda: (x34(), torch.randn(4)),
        nothing,
        ("L['bias']",),
    ),
    (
        "global_int",
        global_int_program,
        lambda: (x34(),),
        lambda: (x34(),),
        lambda: global_value("FACTOR", 5),
        ("FACTOR",),
    ),
    (
        "global_function",
        global_function_program,
        lambda: (x34(),),
        lambda: (x34(),),
        lambda: global_value("ACTIVATION", triple),
        ("ACTIVATION",),
    ),
    (
        "grad_mode",
        tensor_program,
        lambda: (x34().requires_grad_(),),
        lambda: (x34().requires_grad_(),),
        torch.no_grad,
        ("grad",),
    ),
    (
        "autocast",
        matmul_program,
        lambda: (x34(), torch.randn(4, 2)),
        lambda: (x34(), torch.randn(4, 2)),
        bf16_autocast,
        ("autocast",),
    ),
    (
        "default_dtype",
        creation_program,
        lambda: (torch.randn(3, dtype=torch.float64),),
        lambda: (torch.randn(3, dtype=torch.float64),),
        lambda: default_dtype(torch.float64),
        ("default_dtype", "dtype"),
    ),
]


@pytest.mark.parametrize(
    "program, first, second, context, words", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES]
)
def test_guarded_change_recompiles_once(
    program: Any, first: Any, second: Any, context: Any, words: tuple[str, ...]
) -> None:
    kiln.reset()
    compiled = kiln.compile(program)
    a, b = first(), second()
    torch.testing.assert_close(compiled(*a), program(*a))
    torch.testing.assert_close(compiled(*a), program(*a))
    assert kiln.counters.recompiles == []
    with context():
        expected = program(*b)
        for _ in range(2):  # the second call hits the new entry
            out = compiled(*b)
            torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
            assert out.dtype == expected.dtype
            assert out.requires_grad == expected.requires_grad
    assert len(kiln.counters.recompiles) == 1, kiln.counters.recompiles
    qualname, reason = kiln.counters.recompiles[0]
    assert qualname == program.__qualname__
    assert any(word in reason for word in words), reason
    # Back to the first inputs and state: the old entry is still there, no new recompile.
    torch.testing.assert_close(compiled(*a), program(*a))
    assert len(kiln.counters.recompiles) == 1, kiln.counters.recompiles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_device_change_recompiles_once() -> None:
    kiln.reset()
    compiled = kiln.compile(tensor_program)
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), tensor_program(x))
    y = x.cuda()
    torch.testing.assert_close(compiled(y), tensor_program(y))
    assert len(kiln.counters.recompiles) == 1
    assert "L['x']" in kiln.counters.recompiles[0][1]


@pytest.mark.parametrize("change", ["eval", "attribute"])
def test_module_state_change_recompiles(change: str) -> None:
    """``model.eval()`` (``training`` is read) and a changed Python attribute recompile once."""
    kiln.reset()
    model = Dropoutish() if change == "eval" else Scaled()
    compiled = kiln.compile(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    if change == "eval":
        model.eval()
    else:
        model.scale = 5.0
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x))
    assert len(kiln.counters.recompiles) == 1, kiln.counters.recompiles
    word = "training" if change == "eval" else "scale"
    assert word in kiln.counters.recompiles[0][1], kiln.counters.recompiles


def test_swapped_submodule_is_not_stale() -> None:
    """Replacing a submodule (identity guard) recompiles; the new module's output is returned."""
    kiln.reset()
    model = Scaled()
    compiled = kiln.compile(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    model.lin = nn.Linear(4, 4)
    torch.testing.assert_close(compiled(x), model(x))
    assert len(kiln.counters.recompiles) == 1


def test_parameter_values_are_not_guarded() -> None:
    """Training updates parameter values in place: no recompile, results follow the values."""
    kiln.reset()
    model = Scaled()
    compiled = kiln.compile(model)
    x = torch.randn(2, 4)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), model(x))
        with torch.no_grad():
            model.lin.weight.add_(0.1)
    assert kiln.counters.recompiles == []


def test_float_argument_never_stale() -> None:
    """A Python float argument: whether specialised or not, results follow the value."""
    kiln.reset()
    compiled = kiln.compile(int_program)
    x = torch.randn(3)
    for value in (0.5, 1.5, 0.5, -2.0):
        torch.testing.assert_close(compiled(x, value), int_program(x, value))


def test_tensor_values_are_not_guarded() -> None:
    kiln.reset()
    compiled = kiln.compile(tensor_program)
    for _ in range(3):
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), tensor_program(x))
    assert kiln.counters.recompiles == []
    assert kiln.counters.captures == 1


def test_recompile_limit_falls_back_correctly() -> None:
    """Nine different int arguments: eight entries, then RECOMPILE_LIMIT and uncompiled runs."""
    kiln.reset()
    compiled = kiln.compile(int_program)
    x = torch.randn(3)
    for n in range(9):
        torch.testing.assert_close(compiled(x, n), int_program(x, n))
    assert kiln.counters.captures == 8
    limits = [r for r in kiln.counters.fallbacks if r.reason is kiln.SkipReason.RECOMPILE_LIMIT]
    assert len(limits) == 1, kiln.counters.fallbacks
    assert limits[0].function == int_program.__qualname__
    for n in (9, 10, 0, 4):
        torch.testing.assert_close(compiled(x, n), int_program(x, n))
    assert kiln.counters.captures == 8


def test_recompile_limit_option() -> None:
    kiln.reset()
    compiled = kiln.compile(int_program, options={"recompile_limit": 2})
    x = torch.randn(3)
    with pytest.warns(UserWarning, match=r"int_program hit the recompile limit") as record:
        for n in range(4):
            torch.testing.assert_close(compiled(x, n), int_program(x, n))
    assert kiln.counters.captures == 2
    assert [r.reason for r in kiln.counters.fallbacks] == [kiln.SkipReason.RECOMPILE_LIMIT]
    # Warned once, naming the limit and the last guard that failed, at the user's call.
    limit = [w for w in record if "recompile limit" in str(w.message)]
    assert len(limit) == 1
    assert "recompile_limit=2" in str(limit[0].message)
    assert "L['n'] == 1" in str(limit[0].message)
    assert "L['n'] is a Python number" in str(limit[0].message)  # and what to do about it
    assert _number_hint("len(L['xs']) == 3") == _number_hint("L['s'] == 'a'") == ""
    assert "L['self'].scale is a Python number" in _number_hint("L['self'].scale == -2.5e-05")
    assert limit[0].filename == __file__


def test_options_of_a_second_compile_apply() -> None:
    """The same function compiled again with another limit gets its own cache and limit."""
    kiln.reset()
    x = torch.randn(3)
    first = kiln.compile(int_program)
    for n in range(3):
        first(x, n)
    second = kiln.compile(int_program, options={"recompile_limit": 1})
    assert second is not first
    with pytest.warns(UserWarning, match="recompile_limit=1"):
        for n in range(3):
            torch.testing.assert_close(second(x, n), int_program(x, n))
    assert kiln.counters.captures == 3 + 1
    assert [r.reason for r in kiln.counters.fallbacks] == [kiln.SkipReason.RECOMPILE_LIMIT]
    first(x, 2)  # the first wrapper's entries are untouched
    assert kiln.counters.captures == 4


def test_backend_of_a_second_compile_applies() -> None:
    """``backend="eager"`` after ``backend="kiln"`` runs the reference interpreter, not the
    first compile's kernels, down to the resume functions after a break and the callees."""
    import kiln.pipeline

    def callee(x):
        return x.cos() * 2

    def program(x):
        y = x.sin()
        kiln.graph_break()
        return callee(y) + 1

    kiln.reset()
    x = torch.randn(4)
    kiln.compile(program, backend="kiln")(x)
    used: list[str] = []
    original = kiln.pipeline.lookup_backend

    def spy(name: str) -> Any:
        used.append(name)
        return original(name)

    kiln.pipeline.lookup_backend = spy  # type: ignore[assignment]
    try:
        torch.testing.assert_close(kiln.compile(program, backend="eager")(x), program(x))
    finally:
        kiln.pipeline.lookup_backend = original  # type: ignore[assignment]
    assert used and set(used) == {"eager"}, used


def test_concurrent_first_calls_compile_once() -> None:
    """Threads calling a new function at once: one capture, no recompile, every result right."""
    import threading

    kiln.reset()
    compiled = kiln.compile(tensor_program, options={"recompile_limit": 1})
    x = torch.randn(3, 4)
    expected = tensor_program(x)
    results: list[Any] = []
    start = threading.Barrier(4)

    def call() -> None:
        start.wait()
        results.append(compiled(x))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for result in results:
        torch.testing.assert_close(result, expected)
    assert kiln.counters.captures == 1
    assert kiln.counters.recompiles == []
    assert kiln.counters.fallbacks == []


class Method(nn.Module):
    def forward(self, x, n):
        return x * n


def test_recompile_limit_counts_per_module_instance() -> None:
    """Methods count recompiles per instance: two modules, five ints each, stay under the limit."""
    kiln.reset()
    first, second = Method(), Method()
    compiled = [kiln.compile(first.forward), kiln.compile(second.forward)]
    x = torch.randn(3)
    for n in range(5):
        for fn in compiled:
            torch.testing.assert_close(fn(x, n), x * n)
    assert kiln.counters.fallbacks == []
    assert kiln.counters.captures == 10


def test_unknown_option_rejected() -> None:
    with pytest.raises(ValueError):
        kiln.compile(int_program, options={"no_such_option": 1})


def test_cache_hits_counted_and_reset() -> None:
    kiln.reset()
    compiled = kiln.compile(tensor_program)
    x = torch.randn(3, 4)
    compiled(x)
    assert kiln.counters.captures == 1
    assert kiln.counters.cache_hits == 0
    for expected_hits in (1, 2, 3):
        compiled(x)
        assert kiln.counters.cache_hits == expected_hits
    assert kiln.counters.captures == 1
    compiled(x.double())
    assert kiln.counters.captures == 2 and len(kiln.counters.recompiles) == 1
    kiln.reset()
    assert kiln.counters.cache_hits == 0
    assert kiln.counters.captures == 0
    assert kiln.counters.recompiles == []
    assert kiln.counters.graph_breaks == [] and kiln.counters.fallbacks == []
    assert kiln.counters.graphs == 0


def test_reset_forgets_entries_of_existing_wrappers() -> None:
    """After ``kiln.reset()`` ("forget every cache entry"), a wrapper made before the reset
    captures afresh, and its later hits are counted."""
    kiln.reset()
    compiled = kiln.compile(tensor_program)
    x = torch.randn(3, 4)
    compiled(x)
    compiled(x)
    kiln.reset()
    torch.testing.assert_close(compiled(x), tensor_program(x))
    assert kiln.counters.captures == 1
    compiled(x)
    assert kiln.counters.cache_hits == 1


def test_cache_hits_with_breaks_count_resume_functions() -> None:
    """A program with one break hits (at least) two cached entries per call once warm."""

    def program(x):
        y = x * 2
        kiln.graph_break()
        return y + 1

    kiln.reset()
    compiled = kiln.compile(program)
    x = torch.randn(3)
    compiled(x)
    captures = kiln.counters.captures
    assert captures >= 2  # the frame and its resume function
    compiled(x)
    per_call = kiln.counters.cache_hits
    assert per_call >= 2
    compiled(x)
    assert kiln.counters.cache_hits == 2 * per_call
    assert kiln.counters.captures == captures


def test_recompile_reason_is_readable_guard_text() -> None:
    kiln.reset()
    compiled = kiln.compile(tensor_program)
    compiled(torch.randn(3, 4))
    compiled(torch.randn(3, 5))
    ((qualname, reason),) = kiln.counters.recompiles
    assert qualname == "tensor_program"
    assert reason == "L['x'].size(1) is 5, expected 4"  # the dim that changed, named


# --- state changed between calls: results are never stale -----------------------------------

WEIGHT = torch.randn(3)


def reads_global_tensor(x):
    return x * WEIGHT


def reads_list(x, scales):
    return x * scales[0] + scales[1]


def reads_object(x, obj):
    return x * obj.scale + obj.offset


def make_closure(k):
    state = {"k": k}

    def program(x):
        return x * state["k"]

    def scaled(x):
        return x * k

    return program, scaled, state


def hooked_call(model, x):
    return model(x)


def _set_global_weight() -> None:
    globals()["WEIGHT"] = torch.randn(3)


class Obj:
    def __init__(self) -> None:
        self.scale = 2.0
        self.offset = torch.randn(3)


# (id, program, build args, change the state in place)
STALE: list[tuple[str, Any, Any, Any]] = [
    (
        "global_tensor_rebound",
        reads_global_tensor,
        lambda: [torch.randn(3)],
        lambda args: _set_global_weight(),
    ),
    (
        "list_item_changed",
        reads_list,
        lambda: [torch.randn(3), [2, 3]],
        lambda args: args[1].__setitem__(0, 5),
    ),
    (
        "list_tensor_item",
        reads_list,
        lambda: [torch.randn(3), [2.0, torch.randn(3)]],
        lambda args: args[1].__setitem__(1, torch.randn(3)),
    ),
    (
        "object_float",
        reads_object,
        lambda: [torch.randn(3), Obj()],
        lambda args: setattr(args[1], "scale", 7.5),
    ),
    (
        "object_tensor",
        reads_object,
        lambda: [torch.randn(3), Obj()],
        lambda args: setattr(args[1], "offset", torch.randn(3)),
    ),
    (
        "forward_hook_added",
        hooked_call,
        lambda: [nn.Linear(3, 3), torch.randn(3)],
        lambda args: args[0].register_forward_hook(lambda m, a, out: out * 10),
    ),
    (
        "pre_hook_added",
        hooked_call,
        lambda: [nn.Linear(3, 3), torch.randn(3)],
        lambda args: args[0].register_forward_pre_hook(lambda m, a: (a[0] + 100,)),
    ),
    (
        "requires_grad_toggled_on_parameters",
        hooked_call,
        lambda: [nn.Linear(3, 3), torch.randn(3)],
        lambda args: args[0].requires_grad_(False),
    ),
]


@pytest.mark.parametrize(
    "program, build, change", [s[1:] for s in STALE], ids=[s[0] for s in STALE]
)
def test_state_change_never_stale(program: Any, build: Any, change: Any) -> None:
    kiln.reset()
    saved = WEIGHT
    try:
        args = build()
        compiled = kiln.compile(program)
        for _ in range(2):
            _assert_matches(compiled(*args), program(*args))
        change(args)
        for _ in range(2):
            _assert_matches(compiled(*args), program(*args))
    finally:
        globals()["WEIGHT"] = saved


def test_hook_removed_never_stale() -> None:
    kiln.reset()
    model = nn.Linear(3, 3)
    handle = model.register_forward_hook(lambda m, a, out: out * 10)
    compiled = kiln.compile(model)
    x = torch.randn(3)
    _assert_matches(compiled(x), model(x))
    handle.remove()
    _assert_matches(compiled(x), model(x))


def test_closure_cell_changed_never_stale() -> None:
    """A closure's captured dict changing, and a new closure over another value."""
    kiln.reset()
    program, _, state = make_closure(2.0)
    compiled = kiln.compile(program)
    x = torch.randn(3)
    _assert_matches(compiled(x), program(x))
    state["k"] = 5.0
    _assert_matches(compiled(x), program(x))
    for k in (2.0, 3.0):
        _, other, _ = make_closure(k)
        _assert_matches(kiln.compile(other)(x), other(x))


def _assert_matches(actual: Any, expected: Any) -> None:
    torch.testing.assert_close(actual, expected)
    assert actual.requires_grad == expected.requires_grad


def write_then_read(x, y, z):
    x.add_(1)
    return y * 2 + z


def test_written_input_that_later_shares_memory_recompiles() -> None:
    """Captured with separate tensors, called with the written input aliasing a read one:
    the memory guard fails (naming the written input), and the result is eager's."""
    kiln.reset()
    compiled = kiln.compile(write_then_read)
    x, y, z = torch.randn(3), torch.randn(3), torch.randn(3)
    expected = write_then_read(x.clone(), y, z)
    torch.testing.assert_close(compiled(x.clone(), y, z), expected)
    base = torch.randn(4)
    eager_base = base.clone()
    expected = write_then_read(eager_base[:3], eager_base[1:], z)
    torch.testing.assert_close(compiled(base[:3], base[1:], z), expected)
    torch.testing.assert_close(base, eager_base)
    assert len(kiln.counters.recompiles) == 1, kiln.counters.recompiles
    assert "share no memory" in kiln.counters.recompiles[0][1]


def test_slice_arguments_are_guarded_by_value() -> None:
    """Slices (unhashable before Python 3.12), alone and in tuples, specialize by value."""

    def program(x, rows, index):
        return x[rows] * 2 + x[index].sum()

    kiln.reset()
    compiled = kiln.compile(program)
    x = torch.randn(6, 5)
    calls = [
        (slice(0, 3), (slice(1, 4), 2)),
        (slice(1, 4), (slice(0, 3), 0)),
        (slice(0, 3), (slice(1, 4), 2)),
        (slice(None, None, 2), (slice(3, None), 1)),
    ]
    for rows, index in calls:
        torch.testing.assert_close(compiled(x, rows, index), program(x, rows, index))
    assert kiln.counters.fallbacks == []
    assert kiln.counters.captures == 3  # the third call hits the first entry


def _defaults_flag(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator that fills a keyword in its own ``**kwargs`` (as transformers' do)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("flag") is None:
            kwargs["flag"] = True
        return fn(*args, **kwargs)

    return wrapper


class _LoopWithBreaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    @_defaults_flag
    def forward(self, x: torch.Tensor, flag: bool | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            kiln.graph_break()
        return x * 2 if flag else x


def test_an_item_the_frame_wrote_is_not_guarded() -> None:
    """Read back, ``kwargs["flag"]`` is the frame's own write, not the caller's value: a guard
    on it (``L['kwargs']['flag'] == True``) would fail on every call and recompile."""
    kiln.reset()
    model = _LoopWithBreaks()
    compiled = kiln.compile(model)
    for _ in range(4):
        x = torch.randn(3, 4)
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x, flag=False), model(x, flag=False))
    assert [r for r in kiln.counters.recompiles if "kwargs" in r[1] and "True" in r[1]] == []
    assert kiln.counters.graphs >= 1


def _insert_then_read(x: torch.Tensor, values: list[float]) -> torch.Tensor:
    values.insert(0, 1.0)
    return x * values[1]  # the caller's first item, moved by the insertion: still guarded


def test_an_item_a_list_insertion_moved_is_still_guarded() -> None:
    compiled = kiln.compile(_insert_then_read)
    x = torch.randn(3)
    for factor in (2.0, 3.0, 2.0):
        values = [factor]
        torch.testing.assert_close(compiled(x, values), x * factor)
        assert values == [1.0, factor]
