"""Conformance of graph breaks: every break kind, nested breaks (a break in a callee, in a
callee's callee), breaks inside grad-mode/autocast regions, inside ``try`` and loops (the frame
runs uncompiled), values live across a break, and ``fullgraph=True`` errors and successes.

A break ends the graph: the program runs the graph so far, performs the step natively, and a
resume function is captured in its turn, so a break between two pieces of tensor work gives two
graphs. A break in a callee breaks the caller at the call site, and the callee runs through
its own compiled wrapper: ``f -> g(print)`` gives f's graph, g's two graphs, f's resume graph.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import torch
from harness import case, check, line_of, rand, run_case
from torch import nn

import kiln
from kiln.capture.core.breaks import FullGraphError

IO = kiln.BreakReason.IO
DATA = kiln.BreakReason.DATA_DEPENDENT
EXPLICIT = kiln.BreakReason.EXPLICIT
CALL = kiln.BreakReason.UNSUPPORTED_CALL
IN_TRY = kiln.SkipReason.BREAK_IN_TRY
IN_LOOP = kiln.SkipReason.BREAK_IN_LOOP

log = logging.getLogger("kiln.tests.capture")

# --- one break of each kind ----------------------------------------------------------------


def print_middle(x):
    y = x * 2
    print("middle", y.shape)  # BREAK
    return y + 1


def print_tensor(x):
    y = x.sin()
    print(y)  # BREAK
    return y * 3


def item_break(x):
    s = x.sum().item()  # BREAK
    return x * s, s


def tolist_break(x):
    values = (x * 2).tolist()  # BREAK
    return x + values[0], values


def tensor_condition(x):
    y = x * 2
    if y.sum() > 0:  # BREAK
        return y + 1
    return y - 1


def tensor_bool_conversions(x):
    y = x.abs()
    n = int(y.argmax())  # BREAK
    return y[n] * 2, n


def explicit_break(x):
    y = x.cos()
    kiln.graph_break()  # BREAK
    return y * y


def time_call(x):
    y = x + 1
    t = time.time()  # BREAK
    return y * 2, t > 0


def getpid_call(x):
    y = x + 1
    pid = os.getpid()  # BREAK
    return y * 2, pid > 0


def logging_call(x):
    y = x - 1
    log.warning("value %s", 3)  # BREAK
    return y.exp()


def two_breaks(x):
    a = x * 2
    print("one")  # BREAK
    b = a + 1
    kiln.graph_break()  # BREAK2
    return b * a


def break_at_first_line(x):
    print("start")  # BREAK
    return x * 2


def break_mid_expression(x):
    return x * 2, print("mid"), x + 1  # BREAK


def item_mid_expression(x, y):
    return torch.cat([x, y * y.sum().item()]) + 1  # BREAK


# --- nested breaks -------------------------------------------------------------------------


def leaf_prints(t):
    t = t + 1
    print("leaf")  # BREAK
    return t * 2


def middle_calls_leaf(t):
    t = t - 1
    t = leaf_prints(t)
    return t / 2


def callee_breaks(x):
    y = x.sin()
    y = leaf_prints(y)
    return y.cos()


def callee_callee_breaks(x):
    y = x.sin()
    y = middle_calls_leaf(y)
    return y.cos()


def data_dependent_leaf(t):
    t = t * 3
    if t.mean() > 0:  # BREAK
        return t + 1
    return t - 1


def callee_data_dependent(x):
    y = x + 2
    return data_dependent_leaf(y) * 2


def callee_breaks_mid_expression(x):
    y = x * 2
    return y + leaf_prints(y) * y


class PrintingModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x = self.lin(x)
        print("module")  # BREAK
        return x.relu()


def module_breaks(model, x):
    y = x * 2
    return model(y).sin()


# --- breaks in regions, try, loops ---------------------------------------------------------


def break_in_no_grad(x):
    with torch.no_grad():
        y = x * 2
        print("inside")  # BREAK
        z = x * 3
    return y, z, x * 4


def break_in_nested_regions(x):
    with torch.no_grad():
        with torch.enable_grad():
            a = x * 2
            kiln.graph_break()  # BREAK
            b = x * 3
        c = x * 4
    return a, b, c, x + 1


def break_in_autocast(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x @ w
        print("autocast")  # BREAK
        b = x @ w
    return a, b, x @ w


def break_in_inference_mode(x):
    with torch.inference_mode():
        a = x * 2
        kiln.graph_break()  # BREAK
        b = a + 1
    return b.clone(), torch.is_inference_mode_enabled()


def break_in_try(x):
    y = x + 1
    try:
        print("try")  # BREAK
        y = y * 2
    except KeyError:
        y = y - 1
    return y


def branch_in_try(x):
    y = x + 1
    try:
        if y.sum() > 0:  # BREAK
            y = y * 2
    except KeyError:
        y = y - 1
    return y


def break_in_handler(x):
    try:
        y = x[10]  # IndexError for these inputs: the handler runs
    except IndexError:
        print("handler")  # BREAK
        y = x * 2
    return y


def break_in_try_callee(x):
    y = x + 1
    try:
        y = leaf_prints(y)
    finally:
        y = y * 2
    return y


def break_in_for(x):
    for i in range(2):
        x = x + i
        print(i)  # BREAK
    return x * 2


def item_in_while(x):
    n = 0
    while n < 3:
        x = x * 2
        n += int(x.sum().item() != 12345.0)  # BREAK
    return x


def callee_break_in_loop(x):
    for _ in range(2):
        x = leaf_prints(x)
    return x


def break_after_loop(x):
    for i in range(3):
        x = x + i
    print("after")  # BREAK
    return x * 2


# --- values live across a break ------------------------------------------------------------


class Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def live_containers(x):
    items = [x * 2, 1, "a"]
    table = {"k": x + 1, "n": 3}
    pair = (x, None)
    kiln.graph_break()  # BREAK
    items.append(x)
    return items, table, pair, items[0] + table["k"]


def live_closure(x):
    k = x.mean()

    def scale(t):
        return t * k

    print("closure")  # BREAK
    return scale(x)


def live_object(x):
    h = Holder(x * 2)
    print("object")  # BREAK
    h.t = h.t + 1
    return h.t, h.__class__.__name__


def live_iterator(x, ys):
    it = iter(ys)
    first = next(it) * x
    kiln.graph_break()  # BREAK
    second = next(it) * x
    return first + second


def live_input_mutation(x):
    x.add_(1)
    kiln.graph_break()  # BREAK
    x.mul_(2)
    return x.sum()


def live_python_numbers(x, n):
    m = n * 2
    s = f"{n}"
    y = x * m
    kiln.graph_break()  # BREAK
    return y + m, s + "!"


class Recorder:
    """A user context manager: capture cannot know what its __exit__ needs."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __enter__(self):
        self.log.append("enter")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.log.append("exit")


def user_context_no_break(x, log):
    with Recorder(log):
        y = x * 2
    return y + 1


def user_context_break(x, log):
    y = x * 2
    with Recorder(log):
        print("inside user context")  # BREAK
        y = y + 1
    return y


def raise_after_break(x):
    y = x * 2
    print("before raise")  # BREAK
    if y.shape[0] == 3:
        raise ValueError("after the break")
    return y


def callee_mutates_then_breaks(t, acc):
    acc.append(t.shape[0])
    print(acc)  # BREAK
    acc.append(len(acc))
    return t * 2


def caller_of_mutating_callee(x, acc):
    y = x + 1
    return callee_mutates_then_breaks(y, acc) - 1


def print_in_hook(module, args, output):
    print("hook", output.shape)  # BREAK


def hooked_model_with_print() -> nn.Module:
    model = nn.Linear(4, 4)
    model.register_forward_hook(print_in_hook)
    return model


def calls_model(model, x):
    return model(x * 2) + 1


def numbers_then_item(x):
    y = x.softmax(0)
    top = y.max().item()  # BREAK
    if top > 0.5:
        return y * 2
    return y / 2


CASES = [
    case("kind/print", print_middle, rand(3), graphs=2, breaks=[IO]),
    case("kind/print_tensor", print_tensor, rand(3), graphs=2, breaks=[IO]),
    case("kind/item", item_break, rand(3), graphs=2, breaks=[DATA]),
    case("kind/tolist", tolist_break, rand(3), graphs=2, breaks=[DATA]),
    case(
        "kind/tensor_if_positive",
        tensor_condition,
        build=lambda: (torch.rand(3) + 0.1,),
        graphs=2,
        breaks=[DATA],
    ),
    case(
        "kind/tensor_if_negative",
        tensor_condition,
        build=lambda: (-torch.rand(3) - 0.1,),
        graphs=2,
        breaks=[DATA],
    ),
    case("kind/int_of_tensor", tensor_bool_conversions, rand(3), graphs=2, breaks=[DATA]),
    case("kind/explicit", explicit_break, rand(3), graphs=2, breaks=[EXPLICIT]),
    case("kind/time_time", time_call, rand(3), graphs=2, breaks=[CALL]),
    case("kind/os_getpid", getpid_call, rand(3), graphs=2, breaks=[CALL]),
    case("kind/logging", logging_call, rand(3), graphs=2, breaks=[IO]),
    case("kind/two_breaks", two_breaks, rand(3), graphs=3, breaks=[IO, EXPLICIT]),
    case("kind/first_line", break_at_first_line, rand(3), graphs=None, breaks=None, skips=None),
    case("kind/mid_expression", break_mid_expression, rand(3), graphs=2, breaks=[IO]),
    case(
        "kind/item_mid_expression", item_mid_expression, rand(3), rand(2), graphs=2, breaks=[DATA]
    ),
    case("nested/callee", callee_breaks, rand(3), graphs=4, breaks=[IO, IO]),
    case("nested/callee_callee", callee_callee_breaks, rand(3), graphs=6, breaks=[IO, IO, IO]),
    case(
        "nested/callee_data_dependent",
        callee_data_dependent,
        rand(3),
        graphs=4,
        breaks=[DATA, DATA],
    ),
    case(
        "nested/callee_mid_expression",
        callee_breaks_mid_expression,
        rand(3),
        graphs=4,
        breaks=[IO, IO],
    ),
    case(
        "nested/module",
        module_breaks,
        build=lambda: (PrintingModule(), torch.randn(2, 4)),
        graphs=None,
        breaks=None,
    ),
    case("region/no_grad", break_in_no_grad, rand(3, requires_grad=True), graphs=2, breaks=[IO]),
    case(
        "region/nested",
        break_in_nested_regions,
        rand(3, requires_grad=True),
        graphs=2,
        breaks=[EXPLICIT],
    ),
    case(
        "region/autocast",
        break_in_autocast,
        rand(4, 8),
        rand(8, 4),
        graphs=2,
        breaks=[IO],
        atol=1e-2,
        rtol=1e-2,
    ),
    case("region/inference_mode", break_in_inference_mode, rand(3), graphs=2, breaks=[EXPLICIT]),
    # A break at a call in a try body resumes compiled; the head sends an exception the call
    # raises to the handler (a resume function starting there).
    case("try/break", break_in_try, rand(3), graphs=2, breaks=[IO]),
    # f's graph, the callee's two, f's resume (the finally block on the normal path)
    case("try/callee", break_in_try_callee, rand(3), graphs=4, breaks=[IO, IO]),
    case("skip/try_branch", branch_in_try, rand(3), graphs=0, skips=[IN_TRY]),
    case("skip/except_handler", break_in_handler, rand(3), graphs=0, skips=[IN_TRY]),
    case("skip/for", break_in_for, rand(3), graphs=0, skips=[IN_LOOP]),
    case("skip/while_item", item_in_while, rand(3), graphs=0, skips=[IN_LOOP]),
    case(
        "skip/callee_in_loop",
        callee_break_in_loop,
        rand(3),
        graphs=2,
        breaks=[IO],
        skips=[IN_LOOP],
    ),
    case("skip/not_after_loop", break_after_loop, rand(3), graphs=2, breaks=[IO]),
    case("live/containers", live_containers, rand(3), graphs=2, breaks=[EXPLICIT]),
    case("live/closure", live_closure, rand(3), graphs=2, breaks=[IO]),
    case("live/object", live_object, rand(3), graphs=2, breaks=[IO]),
    # The resume function would receive the live iterator, which its capture would use up:
    # it runs uncompiled (before, its capture baked the iterator's next item in).
    case(
        "live/iterator",
        live_iterator,
        rand(3),
        [rand(3), rand(3)],
        graphs=1,
        breaks=[EXPLICIT],
        skips=[kiln.SkipReason.ITERATOR_ARGUMENT],
    ),
    case("live/input_mutation", live_input_mutation, rand(3), graphs=2, breaks=[EXPLICIT]),
    case("live/python_numbers", live_python_numbers, rand(3), 4, graphs=2, breaks=[EXPLICIT]),
    case("with/user_context_no_break", user_context_no_break, rand(3), []),
    case(
        "with/user_context_break",
        user_context_break,
        rand(3),
        [],
        graphs=0,
        skips=[kiln.SkipReason.BREAK_IN_WITH],
    ),
    case("raise/after_break", raise_after_break, rand(3), graphs=None),
    case(
        "nested/callee_mutates_then_breaks",
        caller_of_mutating_callee,
        rand(3),
        [],
        graphs=3,  # the callee does no tensor work before its break
        breaks=[IO, IO],
    ),
    case(
        "nested/print_in_forward_hook",
        calls_model,
        build=lambda: (hooked_model_with_print(), torch.randn(2, 4)),
        graphs=None,
        breaks=None,
    ),
    case("kind/item_then_python_branch", numbers_then_item, rand(3), graphs=2, breaks=[DATA]),
]


@pytest.mark.parametrize("fn, args, build, expect", CASES)
def test_breaks(fn: Any, args: Any, build: Any, expect: dict[str, Any]) -> None:
    run_case(fn, args, build, expect)


@pytest.mark.parametrize(
    "fn, expected_graphs",
    [
        (print_middle, 2),
        (print_tensor, 2),
        (two_breaks, 3),
        (break_at_first_line, None),
        (callee_callee_breaks, 6),
        (break_in_try, 2),
        (break_in_for, 0),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_print_output_once_per_call(
    fn: Any, expected_graphs: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a program prints compiled is exactly what it prints eagerly, once per call."""
    x = torch.randn(3)
    calls = 3
    for _ in range(calls):
        fn(x.clone())
    eager = capsys.readouterr().out
    assert eager, "the program prints"
    kiln.reset()
    compiled = kiln.compile(fn)
    for _ in range(calls):
        compiled(x.clone())
    assert capsys.readouterr().out == eager
    if expected_graphs is not None:
        assert kiln.explain(fn, x.clone()).graph_count == expected_graphs
        capsys.readouterr()


def test_logging_emitted_once_per_call(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(3)
    compiled = kiln.compile(logging_call)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(3):
            torch.testing.assert_close(compiled(x), logging_call(x))
    messages = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert messages == ["value 3"] * 6


def test_break_location_names_user_line() -> None:
    """Each break record carries the user's file and line and the line's text."""
    for fn, marker in [(print_middle, "print("), (item_break, ".item()"), (leaf_prints, "print(")]:
        report = kiln.explain(fn, torch.randn(3))
        assert report.breaks, str(report)
        record = report.breaks[-1]
        file, line = line_of(fn, marker)
        assert record.location is not None
        assert os.path.basename(record.location.file) == file
        assert record.location.line == line
        assert marker in record.location.text
        assert f"{file}:{line}" in str(report)


def test_explain_report_contents() -> None:
    report = kiln.explain(print_middle, torch.randn(3))
    assert all(isinstance(g, kiln.Graph) for g in report.graphs)
    assert report.guards and all(isinstance(g, str) for g in report.guards)
    assert any("L['x']" in g for g in report.guards)
    text = str(report)
    assert "2 graph(s)" in text and "IO" in text
    assert report.breaks[0].function == "print_middle"


def test_explain_of_compiled_function_and_counters() -> None:
    """explain() accepts a compiled function too; breaks are counted in kiln.counters."""
    kiln.reset()
    compiled = kiln.compile(two_breaks)
    x = torch.randn(3)
    assert kiln.explain(compiled, x).break_reasons == [IO, EXPLICIT]
    kiln.reset()
    compiled(x)
    assert [r.reason for r in kiln.counters.graph_breaks] == [IO, EXPLICIT]
    assert kiln.counters.graphs == 3


def test_explain_lists_skips_for_try() -> None:
    report = kiln.explain(branch_in_try, torch.randn(3))
    assert [s.reason for s in report.skips] == [IN_TRY]
    record = report.skips[0]
    assert record.location is not None
    assert record.location.line == line_of(branch_in_try, "# BREAK")[1]
    kiln.reset()
    kiln.compile(branch_in_try)(torch.randn(3))
    assert [r.reason for r in kiln.counters.fallbacks] == [IN_TRY]


# --- fullgraph=True --------------------------------------------------------------------------

FULLGRAPH_ERRORS = [
    (print_middle, (rand(3),), print_middle, "IO"),
    (item_break, (rand(3),), item_break, "DATA_DEPENDENT"),
    (tolist_break, (rand(3),), tolist_break, "DATA_DEPENDENT"),
    (tensor_condition, (rand(3),), tensor_condition, "DATA_DEPENDENT"),
    (explicit_break, (rand(3),), explicit_break, "EXPLICIT"),
    (time_call, (rand(3),), time_call, "UNSUPPORTED_CALL"),
    (getpid_call, (rand(3),), getpid_call, "UNSUPPORTED_CALL"),
    (logging_call, (rand(3),), logging_call, "IO"),
    (callee_breaks, (rand(3),), leaf_prints, "IO"),
    (callee_callee_breaks, (rand(3),), leaf_prints, "IO"),
    (break_in_try, (rand(3),), break_in_try, "IO"),
    (branch_in_try, (rand(3),), branch_in_try, ("DATA_DEPENDENT", "BREAK_IN_TRY")),
    (break_in_for, (rand(3),), break_in_for, ("IO", "BREAK_IN_LOOP")),
    (break_in_no_grad, (rand(3),), break_in_no_grad, "IO"),
]


@pytest.mark.parametrize(
    "fn, args, where, reason",
    FULLGRAPH_ERRORS,
    ids=[f[0].__name__ for f in FULLGRAPH_ERRORS],
)
def test_fullgraph_error(fn: Any, args: Any, where: Any, reason: Any) -> None:
    """``fullgraph=True`` turns a needed break into FullGraphError naming file:line and reason."""
    from harness import materialize

    kiln.reset()
    compiled = kiln.compile(fn, fullgraph=True)
    with pytest.raises(FullGraphError) as info:
        compiled(*materialize(args))
    assert isinstance(info.value, kiln.KilnError)
    message = str(info.value)
    file, line = line_of(where, "# BREAK")
    assert f"{file}:{line}" in message, message
    reasons = (reason,) if isinstance(reason, str) else reason
    assert any(r in message for r in reasons), message


def test_fullgraph_error_on_every_call() -> None:
    """The error is raised again on the next call (no silent eager fallback is cached)."""
    compiled = kiln.compile(print_middle, fullgraph=True)
    for _ in range(2):
        with pytest.raises(FullGraphError):
            compiled(torch.randn(3))


def test_fullgraph_decorator_and_module() -> None:
    @kiln.compile(fullgraph=True)
    def breaks(x):
        y = x + 1
        kiln.graph_break()
        return y

    with pytest.raises(FullGraphError):
        breaks(torch.randn(3))
    compiled = kiln.compile(PrintingModule(), fullgraph=True)
    with pytest.raises(FullGraphError) as info:
        compiled(torch.randn(2, 4))
    file, line = line_of(PrintingModule.forward, "# BREAK")
    assert f"{file}:{line}" in str(info.value)


class Clean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        for layer in self.layers:
            x = self.norm(layer(x)).relu() + x
        return {"out": x, "shape": x.shape}


def clean_program(x, items, d):
    with torch.no_grad():
        y = torch.stack([x * v for v in items])
    z = {k: y.sum(0) * v for k, v in d.items()}
    total = sum(t.mean() for t in z.values())
    return y, z, total, f"{len(items)}"


def clean_closure(x):
    def inner(t, k=2):
        return t * k

    return inner(x) + inner(x, k=3)


@pytest.mark.parametrize(
    "fn, build",
    [
        (clean_program, lambda: (torch.randn(3), [1.0, 2.0], {"a": 1.5})),
        (clean_closure, lambda: (torch.randn(3),)),
        (lambda m, x: m(x), lambda: (Clean(), torch.randn(2, 4))),
        (lambda x: x.sin() + 1, lambda: (torch.randn(3),)),
    ],
    ids=["program", "closure", "module", "lambda"],
)
def test_fullgraph_success(fn: Any, build: Any) -> None:
    """Break-free programs compile under fullgraph=True into one graph and match eager."""
    check(fn, *build(), fullgraph=True, graphs=1, breaks=[], skips=[])


def test_fullgraph_compiled_module_success() -> None:
    model = Clean()
    compiled = kiln.compile(model, fullgraph=True)
    x = torch.randn(2, 4)
    out = compiled(x)
    torch.testing.assert_close(out["out"], model(x)["out"])
    assert out["shape"] == (2, 4)


def generator_program(x, n):
    for i in range(n):
        yield x * i


def test_generator_frame_runs_uncompiled() -> None:
    """A generator function compiled directly runs as its original code (GENERATOR skip)."""
    kiln.reset()
    compiled = kiln.compile(generator_program)
    x = torch.randn(3)
    for _ in range(2):
        actual = list(compiled(x, 3))
        expected = list(generator_program(x, 3))
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            torch.testing.assert_close(a, e)
    report = kiln.explain(lambda t: list(generator_program(t, 2)), x)
    assert report.graph_count <= 1, str(report)
    direct = kiln.explain(generator_program, x, 2)
    assert [s.reason for s in direct.skips] == [kiln.SkipReason.GENERATOR], str(direct)


counter_after_break = 0


def global_write_across_break(x):
    global counter_after_break
    y = x * 2
    print("global")
    counter_after_break += 1
    return y + counter_after_break


def test_global_write_across_break(capsys: pytest.CaptureFixture[str]) -> None:
    global counter_after_break
    x = torch.randn(3)
    counter_after_break = 0
    expected = [global_write_across_break(x) for _ in range(3)]
    counter_after_break = 0
    kiln.reset()
    compiled = kiln.compile(global_write_across_break)
    actual = [compiled(x) for _ in range(3)]
    assert counter_after_break == 3
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    capsys.readouterr()


def make_cell_writer():
    count = 0

    def step(x):
        nonlocal count
        y = x * 2
        kiln.graph_break()
        count += 1
        return y + count

    return step


def test_cell_write_across_break() -> None:
    eager, compiled_fn = make_cell_writer(), make_cell_writer()
    compiled = kiln.compile(compiled_fn)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x))
    assert compiled_fn.__closure__[0].cell_contents == eager.__closure__[0].cell_contents == 3
