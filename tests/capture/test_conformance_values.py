"""Conformance of values: tensor arithmetic and methods, tensor metadata used in Python, numbers,
strings, containers, slices, comprehensions, unpacking, f-strings and builtins.

Each row is a small program run eagerly and compiled (``harness.check``); every program does
tensor work, so it captures into exactly one graph with no breaks unless the row says otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import case, rand, run_case


class Box:
    def __init__(self, scale: float, inner: Any = None) -> None:
        self.scale = scale
        self.inner = inner
        self.name = "box"


# --- tensor arithmetic and methods ---------------------------------------------------------


def arith(x, y):
    return x + y * 2 - 1, x / (y.abs() + 1), -x, x**2, 3 - x, 2 / (x.abs() + 1)


def floor_mod(x, y):
    return x // 0.5, x % 0.7, torch.remainder(x, y.abs() + 1)


def matmul(x, w):
    return x @ w, torch.matmul(x, w), x.mm(w)


def unary_chain(x):
    return x.sin().exp().tanh().sigmoid().sqrt()


def reductions(x):
    return x.sum(0), x.mean(dim=1, keepdim=True), x.amax(-1), x.std(), x.norm()


def max_with_indices(x):
    values, indices = x.max(dim=1)
    return values * 2, indices, x.min(dim=0)


def movement(x):
    return (
        x.reshape(4, 3),
        x.view(-1),
        x.permute(1, 0),
        x.transpose(0, 1).contiguous(),
        x.unsqueeze(0).flatten(),
        x.T,
        x.mT,
    )


def cat_stack(x, y):
    return torch.cat([x, y], dim=0), torch.stack((x, y), dim=1), torch.cat((x, y), -1)


def where_compare(x, y):
    return torch.where(x > 0, x, y), x > y, (x <= y) & (x > 0), x == x


def dtype_conversions(x):
    return x.double(), x.to(torch.float64) + 1, x.half().float(), (x > 0).long(), x.int()


def item_index(x):
    return x[0], x[:, 1:3], x[..., None], x[-1, ::2], x[1][2], x[None, 0]


def tensor_index(x):
    index = torch.tensor([0, 2])
    return x[index], x.index_select(1, index), x.gather(1, index.expand(3, 2))


def inplace_on_intermediate(x):
    y = x * 2
    y.add_(1)
    y.relu_()
    y.mul_(y)
    return y


def functional_ops(x, w):
    return F.softmax(x, dim=-1), F.gelu(x), F.linear(x, w), F.relu(x) + F.silu(x)


def creation(x):
    return (
        torch.ones_like(x) + x,
        torch.zeros(x.shape[0], 2) + x[:, :2],
        torch.arange(x.shape[1]) * x,
        torch.full((2,), 3.0),
        x.new_ones((2, 2)),
        torch.eye(3) @ x,
    )


def chunk_split(x):
    a, b = x.chunk(2, dim=0)
    c, d, e = x.split([1, 2, 1], dim=0)
    return a - b, c + e, d.sum()


def clamp_einsum(x, w):
    return x.clamp(min=-0.5, max=0.5), torch.einsum("ij,jk->ik", x, w), abs(x)


def scalar_tensor_mix(x):
    return x * 1.5 + 2, 2**x, x.sum() + 1, (x.mean() * 3).exp()


def where_scalar(x):
    return torch.where(x > 0, x, 0.0), x.masked_fill(x < 0, -1.0)


def integer_tensors(x):
    i = (x * 10).long()
    return i // 3, i % 4, i.float() / 2, i.bitwise_and(7), i.argmax(dim=-1)


# --- tensor metadata in Python -------------------------------------------------------------


def shape_unpack(x):
    n, m = x.shape
    return x.reshape(m, n), n * m


def size_methods(x):
    return x * x.size(1), x.size(), x.shape[-1], x.size(-2)


def dim_numel(x):
    return x.flatten() * x.dim() + x.ndim + x.numel()


def shape_branch(x):
    if x.shape[0] > 2:
        return x[:2]
    return x * 2


def dtype_in_python(x):
    if x.dtype == torch.float32:
        return x.double(), x.dtype, str(x.dtype)
    return x * 3, x.dtype, "other"


def device_in_python(x):
    if x.device.type == "cpu":
        return x + 1, x.device, x.device.type
    return x - 1, x.device, "other"


def tensor_predicates(x):
    out = x * 2
    if x.is_floating_point() and x.is_contiguous():
        out = out + 1
    if x.requires_grad:
        out = out - 100
    return out, x.is_leaf, x.grad


def shape_arith(x):
    half = x.shape[0] // 2
    return x[:half] + x[half:], x.view(x.shape[0], -1, 1).shape


def tuple_of_shape(x):
    shape = tuple(x.shape)
    return x.reshape(*shape[::-1]), list(x.shape), shape == (3, 4)


# --- numbers and strings -------------------------------------------------------------------


def int_float_math(x, n, f):
    a = n // 2 + n % 3 - 2**n
    b = f * n / 4 - f**2
    c = divmod(n, 4)
    return x * a + b, a, b, c, round(b, 2), -n, abs(-f), float(n), int(f)


def math_constants(x):
    return x * math.pi, math.e, math.inf > 1e9


def math_functions(x, f):
    return x * math.sqrt(f), math.floor(f), math.log(f + 1)


def bool_logic(x, a, b):
    if (a and not b) or (b and a):
        return x + 1, a or b, a and b
    return x - 1, not a, b is True


def compare_chain(x, n):
    if 0 < n <= 5 and n != 3:
        return x * n, n is not None
    return x - 1, False


def string_ops(x, s):
    parts = s.split(",")
    name = parts[0].upper() + "_" + s[-1]
    x = x * len(name)
    if s.startswith("re"):
        x = torch.relu(x)
    return x, name, "lu" in s, s.replace(",", ";"), len(parts), s.strip().lower()


def string_format(x, s, n):
    return x + n, "{}-{}".format(s, n), "%s=%d" % (s, n), s * 2, s.join(["a", "b"])  # noqa: UP031, UP032


def fstrings(x, n, f, s):
    return x * 2, f"{n}-{s!r}-{f:.2f}-{n:03d}", f"shape={tuple(x.shape)} {x.dim()}"


def string_as_key(x, s):
    table = {"relu": torch.relu, "tanh": torch.tanh}
    return table[s](x)


# --- tuples, lists, dicts, sets, slices ----------------------------------------------------


def tuple_ops(x, t):
    u = t + (x,)  # noqa: RUF005  (tuple concatenation is the construct)
    return u[0] + u[-1], len(u), t * 2, u[1:], (1, 2) < (1, 3), x in (x,)


def list_methods(x, y):
    items = [x, y]
    items.append(x + y)
    items.extend([x * 2])
    items.insert(0, y - 1)
    last = items.pop()
    del items[1]
    items.reverse()
    return items, last, len(items), items[1:], items[::-1]


def list_of_numbers(x, values):
    v = list(values)
    v.sort()
    total = sum(v)
    return x * total, v, v.index(3), v.count(1), v[:2] + v[-2:], [0] * 3, max(v), min(v)


def list_slicing_assign(x, y):
    items = [x, y, x, y]
    items[1:3] = [x * 10]
    items[0] = items[0] + 1
    return items


def dict_ops(x, d):
    out = {k: v * 2 for k, v in d.items()}
    keys = list(d.keys())
    total = sum(d.values())
    out.update({"extra": x})
    missing = d.get("missing", 0)
    first = out.pop(keys[0])
    return out, keys, x * (total + missing), first, "b" in d, len(out)


def dict_construction(x, y):
    a = dict(zip(["x", "y"], [x, y]))  # noqa: B905
    b = {**a, "z": x + y}
    c = dict(a, w=y * 3)
    b.setdefault("z", None)
    b.setdefault("q", 7)
    return b, c, list(b.items())[0], sorted(c)  # noqa: RUF015


def dict_iteration_order(x):
    d = {}
    for name in ["c", "a", "b"]:
        d[name] = x * len(d)
    del d["a"]
    d["a"] = x
    return d, list(d)


def set_ops(x, values):
    s = set(values)
    t = {2, 3, 10}
    u = s | t
    s.add(42)
    s.discard(1)
    if 3 in s and 99 not in s:
        x = x + 1
    return x, s & t, u - s, len(u), sorted(s ^ t), frozenset(t) == t


def slices(x, items):
    sl = slice(0, 2)
    return x[sl], x[1:-1:2], items[::2], items[sl], x[slice(None, None, -1) if False else sl]


def negative_steps(x, items):
    return items[::-1], items[-2:], x.flip(0)[::2], x[-3:]


# --- comprehensions and generator expressions ---------------------------------------------


def list_comprehension(x):
    scaled = [x * i for i in range(3)]
    return scaled, [t.sum() for t in scaled if t.numel() > 0]


def dict_set_comprehension(x, names):
    lengths = {len(n) for n in names}
    table = {n: x * len(n) for n in names}
    return table, lengths


def generator_expression(x, y):
    total = sum(t * 2 for t in (x, y))
    largest = max(len(s) for s in ["ab", "c"])
    return total, largest, tuple(i * i for i in range(4))


def nested_comprehension(x):
    grid = [[x[i] * j for j in range(2)] for i in range(x.shape[0])]
    flat = [t for row in grid for t in row]
    return torch.stack(flat), len(grid)


def comprehension_filters(x):
    rows = [x[i] for i in range(x.shape[0]) if i % 2 == 0]
    pairs = {(i, j): i * j for i in range(3) for j in range(3) if i != j}
    return torch.stack(rows), pairs


def comprehension_over_tensor_rows(x):
    return torch.stack([row * 2 for row in x]), [r.sum() for r in x.unbind(0)]


def comprehension_closure(x, k):
    return [x * k + i for i in range(k)]


# --- unpacking -----------------------------------------------------------------------------


def unpack_basic(x, pair):
    a, b = pair
    (c, d), e = (x, x + 1), 5
    a, b = b, a
    return a * c + d, b, e


def unpack_star(x, values):
    first, *middle, last = values
    head, *tail = [x, x + 1, x + 2]
    return first + last, middle, head, tail, [*values, 9], (*tail, head)


def unpack_call(x, values):
    return torch.stack([*[x, x]]), max(*values), torch.add(*[x, x]), "-".join([*"ab"])


def unpack_dicts(x, d):
    merged = {**d, **{"b": x * 2}}
    return merged


def unpack_for(x, items):
    out = x
    for name, (scale, shift) in items:  # noqa: B007  (name is read after the loop)
        out = out * scale + shift
    return out, name


def unpack_enumerate_zip(x, ys):
    out = x
    for i, (y, w) in enumerate(zip(ys, [1.0, 2.0])):  # noqa: B905
        out = out + y * w * i
    return out


# --- builtins ------------------------------------------------------------------------------


def builtin_len_range(x, items):
    out = x
    for i in range(len(items)):
        out = out + items[i]
    for i in range(1, 7, 2):
        out = out * 0.5 + i
    return out, len(range(10)), list(range(5, 0, -2))


def builtin_enumerate_zip(x, ys):
    out = [y * i for i, y in enumerate(ys, start=1)]
    pairs = list(zip(ys, out))  # noqa: B905
    return out, len(pairs), list(zip([1, 2], "ab"))  # noqa: B905


def builtin_isinstance(x, n, s):
    out = x
    if isinstance(x, torch.Tensor):
        out = out + 1
    if isinstance(n, int) and not isinstance(n, bool):
        out = out * n
    if isinstance(s, (list, str)):
        out = out - len(s)
    if isinstance(x, torch.nn.Parameter):
        out = out * 100
    return out, isinstance(n, float)


def builtin_min_max_sum_abs(x, values):
    return (
        x * max(values) + min(values),
        sum(values),
        sum(values, 10),
        abs(-3),
        abs(-2.5),
        max(3, 7, 2),
        min([4, 1], key=lambda v: -v),
    )


def builtin_getattr_hasattr(x, obj):
    scale = getattr(obj, "scale", 1.0)
    missing = getattr(obj, "missing", 5)
    out = x * scale + missing
    if hasattr(obj, "inner") and not hasattr(obj, "nope"):
        out = out + 1
    return out, obj.name


def builtin_vars(x, obj):
    state = vars(obj)  # (obj.__dict__ itself: reads of it are guarded like attributes)
    return x * state["scale"] + len(state)


def _halve(x):
    return x / 2


def builtin_dunder_call(x, fn):
    return fn.__call__(x) + _halve.__call__(x) + torch.sigmoid.__call__(x)


def builtin_type(x, obj, n):
    out = x
    if type(x) is torch.Tensor:
        out = out + 1
    if type(n) is int:
        out = out * 2
    return out, type(obj).__name__, type(n), type(obj) is Box


def builtin_sorted_reversed(x, values):
    order = sorted(values, reverse=True)
    by_key = sorted(["bb", "a", "ccc"], key=len)
    return x * order[0], order, by_key, list(reversed(values))


def builtin_map_filter(x, values):
    doubled = list(map(lambda v: v * 2, values))
    odd = list(filter(lambda v: v % 2, values))
    tensors = list(map(torch.relu, [x, -x]))
    return x * sum(doubled), odd, tensors, list(map(str, odd))


def builtin_any_all(x, values):
    out = x * 1.5
    if any(v > 3 for v in values):
        out = out + 1
    if all(values):
        out = out * 2
    return out, any([]), all([])


def builtin_conversions(x, f, s):
    return x * int(f), float("1.5"), str(3), bool(0), int(s), round(f), list("ab"), tuple([1])


def builtin_callable_id(x, fn):
    out = x
    if callable(fn):
        out = fn(out)
    return out, callable(3)


def walrus(x, values):
    if (n := len(values)) > 2:
        x = x * n
    return [y for v in values if (y := v * 2) > 2], x


def chained_comparisons(x, a, b):
    lo, hi = sorted((a, b))
    return x * (lo < 2 <= hi), lo <= hi < 100, a == b == 3


def string_methods(x, s):
    words = s.title().split()
    return x * len(words), s.find("b"), s.count("a"), s.center(9, "*"), "-".join(reversed(words))


def generator_function(t, n):
    for i in range(n):
        yield t * i


def consumes_generator(x):
    return sum(generator_function(x, 3)), list(generator_function(x, 2))


CASES = [
    case("tensor/arith", arith, rand(3, 4), rand(3, 4)),
    case("tensor/floor_mod", floor_mod, rand(3, 4), rand(3, 4)),
    case("tensor/matmul", matmul, rand(3, 4), rand(4, 5)),
    case("tensor/unary_chain", unary_chain, rand(3, 4)),
    case("tensor/reductions", reductions, rand(3, 4)),
    case("tensor/max_with_indices", max_with_indices, rand(3, 4)),
    case("tensor/movement", movement, rand(3, 4)),
    case("tensor/cat_stack", cat_stack, rand(3, 4), rand(3, 4)),
    case("tensor/where_compare", where_compare, rand(3, 4), rand(3, 4)),
    case("tensor/dtype_conversions", dtype_conversions, rand(3, 4)),
    case("tensor/item_index", item_index, rand(3, 4)),
    case("tensor/tensor_index", tensor_index, rand(3, 4)),
    case("tensor/inplace_on_intermediate", inplace_on_intermediate, rand(3, 4)),
    case("tensor/functional_ops", functional_ops, rand(3, 4), rand(5, 4)),
    case("tensor/creation", creation, rand(3, 3)),
    case("tensor/chunk_split", chunk_split, rand(4, 3)),
    case("tensor/clamp_einsum", clamp_einsum, rand(3, 4), rand(4, 2)),
    case("tensor/scalar_tensor_mix", scalar_tensor_mix, rand(3)),
    case("tensor/where_scalar", where_scalar, rand(3, 4)),
    case("tensor/integer_tensors", integer_tensors, rand(3, 4)),
    case("tensor/requires_grad_inputs", arith, rand(3, requires_grad=True), rand(3)),
    case("meta/shape_unpack", shape_unpack, rand(3, 4)),
    case("meta/size_methods", size_methods, rand(3, 4)),
    case("meta/dim_numel", dim_numel, rand(3, 4)),
    case("meta/shape_branch_taken", shape_branch, rand(4, 2)),
    case("meta/shape_branch_not_taken", shape_branch, rand(2, 2)),
    case("meta/dtype_in_python", dtype_in_python, rand(3)),
    case("meta/dtype_in_python_f64", dtype_in_python, rand(3, dtype=torch.float64)),
    case("meta/device_in_python", device_in_python, rand(3)),
    case("meta/tensor_predicates", tensor_predicates, rand(3)),
    case("meta/tensor_predicates_grad", tensor_predicates, rand(3, requires_grad=True)),
    case("meta/shape_arith", shape_arith, rand(4, 3)),
    case("meta/tuple_of_shape", tuple_of_shape, rand(3, 4)),
    case("number/int_float_math", int_float_math, rand(3), 7, 2.5),
    case("number/math_constants", math_constants, rand(3)),
    case("number/math_functions", math_functions, rand(3), 2.25, graphs=None),
    case("number/bool_logic_tf", bool_logic, rand(3), True, False),
    case("number/bool_logic_ff", bool_logic, rand(3), False, False),
    case("number/compare_chain", compare_chain, rand(3), 4),
    case("number/compare_chain_false", compare_chain, rand(3), 3),
    case("string/ops", string_ops, rand(3), "relu,tanh"),
    case("string/ops_other", string_ops, rand(3), "gelu,x"),
    case("string/format", string_format, rand(3), "n", 4),
    case("string/fstrings", fstrings, rand(3, 2), 7, 3.14159, "hi"),
    case("string/as_key", string_as_key, rand(3), "tanh"),
    case("container/tuple_ops", tuple_ops, rand(3), (1.5, 2.5)),
    case("container/list_methods", list_methods, rand(3), rand(3)),
    case("container/list_of_numbers", list_of_numbers, rand(3), [3, 1, 4, 1, 5]),
    case("container/list_slicing_assign", list_slicing_assign, rand(3), rand(3)),
    case("container/dict_ops", dict_ops, rand(3), {"a": 1.5, "b": 2.0}),
    case("container/dict_ops_tensors", dict_ops, rand(3), {"a": rand(3), "b": rand(3)}),
    case("container/dict_construction", dict_construction, rand(3), rand(3)),
    case("container/dict_iteration_order", dict_iteration_order, rand(3)),
    case("container/set_ops", set_ops, rand(3), [1, 2, 3, 3]),
    case("container/slices", slices, rand(4, 2), [1, 2, 3, 4, 5]),
    case("container/negative_steps", negative_steps, rand(4, 2), (1, 2, 3)),
    case("comprehension/list", list_comprehension, rand(3)),
    case("comprehension/dict_set", dict_set_comprehension, rand(3), ["a", "bb", "cc"]),
    case("comprehension/generator", generator_expression, rand(3), rand(3)),
    case("comprehension/nested", nested_comprehension, rand(3, 2)),
    case("comprehension/filters", comprehension_filters, rand(5, 2)),
    case("comprehension/over_tensor_rows", comprehension_over_tensor_rows, rand(3, 2)),
    case("comprehension/closure", comprehension_closure, rand(3), 3),
    case("unpack/basic", unpack_basic, rand(3), (2.0, 3.0)),
    case("unpack/star", unpack_star, rand(3), [1, 2, 3, 4]),
    case("unpack/call", unpack_call, rand(3), [4, 9, 2]),
    case("unpack/dicts", unpack_dicts, rand(3), {"a": 1, "b": 2}),
    case("unpack/for", unpack_for, rand(3), [("a", (2.0, 1.0)), ("b", (0.5, -1.0))]),
    case("unpack/enumerate_zip", unpack_enumerate_zip, rand(3), [rand(3), rand(3)]),
    case("builtin/len_range", builtin_len_range, rand(3), [rand(3), rand(3)]),
    case("builtin/enumerate_zip", builtin_enumerate_zip, rand(3), [rand(3), rand(3)]),
    case("builtin/isinstance", builtin_isinstance, rand(3), 3, "ab"),
    case("builtin/isinstance_bool", builtin_isinstance, rand(3), True, ["a"]),
    case("builtin/min_max_sum_abs", builtin_min_max_sum_abs, rand(3), [3, -1, 2]),
    case("builtin/min_max_floats", builtin_min_max_sum_abs, rand(3), [0.5, -1.5]),
    case(
        "builtin/getattr_hasattr",
        builtin_getattr_hasattr,
        build=lambda: (torch.randn(3), Box(2.0, inner=Box(3.0))),
    ),
    case("builtin/vars", builtin_vars, build=lambda: (torch.randn(3), Box(2.0, inner=Box(3.0)))),
    case("builtin/dunder_call", builtin_dunder_call, rand(3), torch.tanh),
    case("builtin/type", builtin_type, build=lambda: (torch.randn(3), Box(1.0), 3)),
    case("builtin/sorted_reversed", builtin_sorted_reversed, rand(3), [2, 9, 4]),
    case("builtin/map_filter", builtin_map_filter, rand(3), [1, 2, 3, 5]),
    case("builtin/any_all", builtin_any_all, rand(3), [1, 2, 5]),
    case("builtin/any_all_false", builtin_any_all, rand(3), [0, 1]),
    case("builtin/conversions", builtin_conversions, rand(3), 2.7, "12"),
    case("builtin/callable", builtin_callable_id, rand(3), torch.sigmoid),
    case("syntax/walrus", walrus, rand(3), [1, 2, 3]),
    case("syntax/chained_comparisons", chained_comparisons, rand(3), 3, 1),
    case("string/methods", string_methods, rand(3), "ab a ba"),
    case("syntax/inner_generator_function", consumes_generator, rand(3)),
]


@pytest.mark.parametrize("fn, args, build, expect", CASES)
def test_values(fn: Any, args: Any, build: Any, expect: dict[str, Any]) -> None:
    run_case(fn, args, build, expect)


def test_parameter_input_isinstance() -> None:
    """``isinstance(x, nn.Parameter)`` is true for a parameter argument, compiled as eagerly."""
    run_case(
        builtin_isinstance,
        (),
        lambda: (torch.nn.Parameter(torch.randn(3)), 2, "a"),
        {"graphs": 1, "breaks": [], "skips": []},
    )
