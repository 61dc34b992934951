"""Conformance of control flow and state: grad-mode and autocast regions, ``if``/``for``/
``while``/``match`` on Python values, ``assert``, ``try``/``except`` without breaks, raising,
return-value structures, and ``torch.compiler.is_compiling()``.
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from typing import Any

import pytest
import torch
from harness import case, check, rand, run_case

import kiln

# --- grad mode and autocast regions --------------------------------------------------------


def no_grad_region(x):
    with torch.no_grad():
        y = x * 2
        inside = torch.is_grad_enabled()
    z = x * 3
    return y, z, inside, torch.is_grad_enabled()


def enable_grad_in_no_grad(x):
    with torch.no_grad():
        a = x + 1
        with torch.enable_grad():
            b = x + 2
        c = x + 3
    return a, b, c


def inference_mode_region(x):
    with torch.inference_mode():
        y = x * 2 + 1
        inside = torch.is_inference_mode_enabled()
    return y.clone(), inside, x * 4


def set_grad_enabled_region(x, flag):
    with torch.set_grad_enabled(flag):
        y = x.sin()
    return y, x.cos()


def autocast_region(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        z = torch.relu(y)
        s = y.float().softmax(-1)
        inside = torch.is_autocast_enabled("cpu")
    return y, z, s, x @ w, inside


def autocast_nested_disabled(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = x @ w
        with torch.autocast("cpu", enabled=False):
            b = x @ w
        c = torch.mm(x, w)
    return a, b, c


def autocast_mixed_inputs(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.nn.functional.linear(x, w.t()) + x.sum(-1, keepdim=True)


@torch.no_grad()
def decorated_no_grad(x):
    return x * 5


def calls_decorated_no_grad(x):
    return decorated_no_grad(x) + 1, x + 1


def grad_region_with_module(model, x):
    with torch.no_grad():
        frozen = model(x)
    return model(x) - frozen


def region_returns_early(x):
    with torch.no_grad():
        return x * 2


# --- if / for / while / match on Python values ---------------------------------------------


def if_elif_else(x, n):
    if n > 2:
        y = x * 2
    elif n == 2:
        y = x + 10
    else:
        y = -x
    return y if n % 2 else y * 0.5


def for_range(x, n):
    for i in range(n):
        x = x * 0.5 + i
    return x


def while_loop(x, n):
    i = 0
    while i < n:
        x = x + x.sin()
        i += 1
    return x, i


def break_continue_else(x, limit):
    total = x
    for i in range(10):
        if i % 2:
            continue
        if i > limit:
            break
        total = total + i
    else:
        total = total * 100
    found = None
    for j, v in enumerate([3, 5, 7]):
        if v == 5:
            found = j
            break
    return total, found


def nested_loops(x, ys):
    out = x
    for y in ys:
        for k in range(2):
            out = out + y * k
    return out


def loop_over_tensor_list(x, ys):
    acc = []
    for y in ys:
        acc.append(torch.dot(x, y))
    return torch.stack(acc)


def while_true_with_break(x):
    n = 0
    while True:
        x = x * 1.1
        n += 1
        if n >= 3:
            break
    return x


def match_statement(x, command):
    match command:
        case "double":
            return x * 2
        case ("scale", factor):
            return x * factor
        case {"shift": s}:
            return x + s
        case _:
            return x - 1


def truthiness(x, items, text, maybe):
    out = x * 1.0
    if items:
        out = out + len(items)
    if not text:
        out = out * 2
    if maybe is None:
        out = out - 1
    return out


def loop_carried_python_state(x):
    stats = {"calls": 0}
    for _ in range(3):
        stats["calls"] += 1
        x = x + stats["calls"]
    return x, stats


# --- assert ---------------------------------------------------------------------------------


def asserts(x, n):
    assert x.dim() == 2, "expected a matrix"
    assert n > 0
    assert isinstance(n, int), f"bad {n}"
    return x * n


# --- try / except without graph breaks -----------------------------------------------------


def try_key_error(x, d):
    try:
        scale = d["missing"]
    except KeyError:
        scale = 3.0
    return x * scale


def try_else_finally(x, d):
    log = []
    try:
        value = d["a"]
    except KeyError:
        value = 0.0
        log.append("except")
    else:
        log.append("else")
    finally:
        log.append("finally")
    return x + value, log


def try_raise_catch(x):
    try:
        raise ValueError("boom")
    except ValueError as error:
        message = str(error)
    return x * len(message), message


def try_nested(x, items):
    try:
        try:
            v = items[10]
        except KeyError:
            v = -1
    except IndexError:
        v = 2
    return x * v


class Empty:
    pass


def try_attribute_error(x, obj):
    try:
        k = obj.missing_attribute
    except AttributeError:
        k = 4
    return x + k


def try_in_callee_helper(d):
    try:
        return d["k"]
    except KeyError:
        return 1.5


def try_in_callee(x, d):
    return x * try_in_callee_helper(d)


# --- raising --------------------------------------------------------------------------------


class CustomError(Exception):
    pass


def raises_value_error(x, n):
    y = x * 2
    if n < 0:
        raise ValueError(f"negative: {n}")
    return y


def raises_custom(x):
    y = x.sin()
    if y.shape[0] == 3:
        raise CustomError("three")
    return y


def raises_key_error(x, d):
    return x * d["nope"]


def raises_index_error(x, items):
    return x + items[5]


def raises_shape_error(x, y):
    return x @ y


def raises_type_error(x):
    return helper_two_args(x)


def helper_two_args(a, b):
    return a + b


def raises_assertion(x):
    assert x.shape[0] == 99, "wrong rows"
    return x


def raises_from_callee(x):
    return x + raises_value_error(x, -1)


# --- return values --------------------------------------------------------------------------


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    steps: int = 0


Pair = collections.namedtuple("Pair", ["first", "second"])


class Triple(typing.NamedTuple):
    a: torch.Tensor
    b: int
    c: str = "c"


def returns_tensor(x):
    return x.exp()


def returns_tuple_of_one(x):
    return (x + 1,)


def returns_list(x):
    return [x + 1, x - 1]


def returns_dict(x):
    return {"b": x * 2, "a": x.sum()}


def returns_nested(x, y):
    return {"a": [x, (y * 2, {"b": x + y})], "n": 3, "empty": ((), [], {})}


def returns_none_after_work(x):
    x.mul_(2)
    return None


def returns_int(x):
    y = x * 2
    return int(y.shape[0] * 7)


def returns_scalars(x):
    return x * 2, 1.5, "s", True, None, x.dtype, x.device, x.shape, torch.Size([2])


def returns_dataclass(x):
    return Output(logits=x * 2, steps=3)


def returns_dataclass_with_loss(x):
    logits = x * 2
    return Output(logits, loss=logits.pow(2).mean())


def returns_namedtuples(x):
    return Pair(x + 1, x - 1), Triple(x * 2, 5)


def uses_namedtuple(x, pair):
    return pair.first * pair[1] + pair.second, Pair(*pair)._replace(first=x)


def builds_dataclass_internally(x):
    out = Output(x * 2, steps=1)
    out.steps += 1
    return out.logits + out.steps, dataclasses.replace(out, steps=9).steps


def returns_same_tensor_twice(x):
    y = x * 2
    return y, y, [y]


# --- transformers-style ModelOutput --------------------------------------------------------

try:
    from transformers.utils import ModelOutput
except ImportError:  # pragma: no cover - transformers is an optional dependency
    ModelOutput = None  # type: ignore[assignment,misc]

if ModelOutput is not None:

    @dataclasses.dataclass
    class TinyOutput(ModelOutput):
        logits: torch.Tensor | None = None
        hidden_states: tuple[torch.Tensor, ...] | None = None
        loss: torch.Tensor | None = None

    def returns_model_output(x):
        return TinyOutput(logits=x * 2, hidden_states=(x, x + 1))

    def uses_model_output(x):
        out = TinyOutput(logits=x.sin())
        tup = out.to_tuple()
        return out.logits + out["logits"] + out[0] + tup[0], len(out), list(out.keys())


CASES = [
    case("grad/no_grad", no_grad_region, rand(3, requires_grad=True)),
    case("grad/enable_in_no_grad", enable_grad_in_no_grad, rand(3, requires_grad=True)),
    case("grad/inference_mode", inference_mode_region, rand(3, requires_grad=True)),
    case(
        "grad/set_grad_enabled_false", set_grad_enabled_region, rand(3, requires_grad=True), False
    ),
    case("grad/set_grad_enabled_true", set_grad_enabled_region, rand(3, requires_grad=True), True),
    case("grad/decorated_no_grad_callee", calls_decorated_no_grad, rand(3, requires_grad=True)),
    case("grad/early_return", region_returns_early, rand(3, requires_grad=True)),
    case(
        "grad/module_in_no_grad",
        grad_region_with_module,
        build=lambda: (torch.nn.Linear(3, 3), torch.randn(2, 3)),
    ),
    case("autocast/bf16", autocast_region, rand(4, 8), rand(8, 4), atol=1e-2, rtol=1e-2),
    case(
        "autocast/nested_disabled",
        autocast_nested_disabled,
        rand(4, 8),
        rand(8, 4),
        atol=1e-2,
        rtol=1e-2,
    ),
    case("autocast/mixed", autocast_mixed_inputs, rand(4, 8), rand(8, 4), atol=1e-2, rtol=1e-2),
    case("flow/if_elif_else_3", if_elif_else, rand(3), 3),
    case("flow/if_elif_else_2", if_elif_else, rand(3), 2),
    case("flow/if_elif_else_0", if_elif_else, rand(3), 0),
    case("flow/for_range", for_range, rand(3), 4),
    case("flow/while", while_loop, rand(3), 3),
    case("flow/break_continue_else", break_continue_else, rand(3), 5),
    case("flow/for_else_taken", break_continue_else, rand(3), 20),
    case("flow/nested_loops", nested_loops, rand(3), [rand(3), rand(3)]),
    case("flow/loop_over_tensors", loop_over_tensor_list, rand(3), [rand(3), rand(3), rand(3)]),
    case("flow/while_true_break", while_true_with_break, rand(3)),
    case("flow/match_string", match_statement, rand(3), "double"),
    case("flow/match_tuple", match_statement, rand(3), ("scale", 4.0)),
    case("flow/match_dict", match_statement, rand(3), {"shift": 2.0}),
    case("flow/match_default", match_statement, rand(3), 17),
    case("flow/truthiness", truthiness, rand(3), [1], "", None),
    case("flow/truthiness_other", truthiness, rand(3), [], "t", 0),
    case("flow/loop_carried_state", loop_carried_python_state, rand(3)),
    case("assert/passes", asserts, rand(2, 3), 3),
    case("assert/fails", asserts, rand(2, 3), 0, graphs=None),
    case("try/key_error", try_key_error, rand(3), {"a": 1.0}),
    case("try/else_finally_hit", try_else_finally, rand(3), {"a": 2.0}),
    case("try/else_finally_miss", try_else_finally, rand(3), {"b": 2.0}),
    case("try/raise_catch", try_raise_catch, rand(3)),
    case("try/nested", try_nested, rand(3), [1, 2]),
    case("try/attribute_error", try_attribute_error, build=lambda: (torch.randn(3), Empty())),
    case("try/in_callee", try_in_callee, rand(3), {}),
    case("raise/value_error", raises_value_error, rand(3), -1, graphs=None),
    case("raise/value_error_not_raised", raises_value_error, rand(3), 1),
    case("raise/custom", raises_custom, rand(3), graphs=None),
    case("raise/key_error", raises_key_error, rand(3), {"a": 1}, graphs=None),
    case("raise/index_error", raises_index_error, rand(3), [1, 2], graphs=None),
    case("raise/shape_error", raises_shape_error, rand(3, 4), rand(3, 4), graphs=None),
    case("raise/type_error", raises_type_error, rand(3), graphs=None),
    case("raise/assertion", raises_assertion, rand(3), graphs=None),
    case("raise/from_callee", raises_from_callee, rand(3), graphs=None),
    case("return/tensor", returns_tensor, rand(3)),
    case("return/tuple_of_one", returns_tuple_of_one, rand(3)),
    case("return/list", returns_list, rand(3)),
    case("return/dict", returns_dict, rand(3)),
    case("return/nested", returns_nested, rand(3), rand(3)),
    case("return/none", returns_none_after_work, rand(3)),
    case("return/int", returns_int, rand(3)),
    case("return/scalars", returns_scalars, rand(3)),
    case("return/dataclass", returns_dataclass, rand(3)),
    case("return/dataclass_loss", returns_dataclass_with_loss, rand(3, requires_grad=True)),
    case("return/namedtuples", returns_namedtuples, rand(3)),
    case(
        "return/namedtuple_input",
        uses_namedtuple,
        build=lambda: (torch.randn(3), Pair(torch.randn(3), 2.0)),
    ),
    case("return/dataclass_internal", builds_dataclass_internally, rand(3)),
    case("return/same_tensor_twice", returns_same_tensor_twice, rand(3)),
]

if ModelOutput is not None:
    CASES += [
        case("return/model_output", returns_model_output, rand(3)),
        case("return/uses_model_output", uses_model_output, rand(3)),
    ]


@pytest.mark.parametrize("fn, args, build, expect", CASES)
def test_control(fn: Any, args: Any, build: Any, expect: dict[str, Any]) -> None:
    run_case(fn, args, build, expect)


@pytest.mark.parametrize(
    "outer", ["no_grad", "inference_mode", "autocast"], ids=lambda s: f"called_under_{s}"
)
def test_called_inside_region(outer: str) -> None:
    """A compiled function called inside a grad-mode or autocast region behaves as eager there."""
    regions = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }

    def program(x, w):
        return (x @ w).relu(), x.sum() * 2

    with regions[outer]():
        check(program, rand(4, 8, requires_grad=True), rand(8, 4), atol=1e-2, rtol=1e-2)


def is_compiling_branch(x):
    if torch.compiler.is_compiling():
        return x + 1
    return x - 1


def is_compiling_in_callee(x):
    return x * 2 + is_compiling_branch(x)


@pytest.mark.parametrize("fn", [is_compiling_branch, is_compiling_in_callee])
def test_is_compiling(fn: Any) -> None:
    """``torch.compiler.is_compiling()`` is False eagerly and True inside compiled code."""
    kiln.reset()
    x = torch.randn(3)
    assert torch.compiler.is_compiling() is False
    compiled = kiln.compile(fn)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), fn(x) + 2)  # x + 1 where eager has x - 1
    assert torch.compiler.is_compiling() is False
    assert kiln.explain(fn, x).graph_count == 1
