"""Conformance of side effects and aliasing: mutation of argument lists, dicts, sets, objects and
modules, global and closure-cell writes, in-place tensor ops on inputs, views of inputs and
buffers (BatchNorm running stats), inputs that alias each other, and outputs that are inputs.

Side effects happen as in eager, on every call (cache hits included): the harness calls each
program several times and compares the arguments' final state after every call.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from harness import assert_same, case, check, rand, run_case
from torch import nn

import kiln


class State:
    def __init__(self) -> None:
        self.count = 0
        self.history: list[Any] = []


# --- containers and objects passed in ------------------------------------------------------


def list_append(x, acc):
    acc.append(x * 2)
    return x + 1


def list_many_mutations(x, items):
    items.extend([x.sum(), 3])
    items.insert(0, "head")
    items[1] = items[1] * 2
    items.pop(2)
    del items[-1]
    return x * len(items)


def list_sort_reverse(x, values):
    values.sort()
    values.reverse()
    values[0] = values[0] + 100
    return x * values[-1]


def dict_update(x, d):
    d.update({"last": x * 2})
    d["calls"] = d.get("calls", 0) + 1
    d.setdefault("first", x.sum())
    return x - d["calls"]


def dict_delete_pop(x, d):
    removed = d.pop("a", None)
    if "b" in d:
        del d["b"]
    d["x"] = x + 1
    return x * 2, removed


def dict_clear(x, d):
    d.clear()
    d["only"] = x.mean()
    return x + 3


def set_add(x, seen):
    seen.add(len(seen))
    seen.discard(0)
    return x * len(seen)


def object_attributes(x, obj):
    obj.count += 1
    obj.last = x * 2
    obj.history.append(obj.count)
    return x + obj.count


def object_delattr(x, obj):
    obj.tmp = 1
    del obj.tmp
    if hasattr(obj, "history"):
        del obj.history
    return x * 2


def nested_container_mutation(x, state):
    state["items"].append(x.sum())
    state["meta"]["n"] += 1
    state["obj"].count = state["meta"]["n"]
    return x * state["meta"]["n"]


def mutation_then_return_container(x, store):
    out = [x * 2, "tag"]
    store["last"] = out
    return out


def returns_mutated_argument(x, acc):
    acc.append(x + 1)
    return acc


def returns_argument_dict(x, d):
    d["y"] = x * 3
    return d, d["y"]


def mutation_before_raise(x, acc):
    acc.append(x * 2)
    acc.append("before")
    raise ValueError("after mutation")


def mutation_visible_to_callee(x, acc):
    acc.append(x)
    return _sum_list(acc)


def _sum_list(items):
    total = items[0] * 0
    for t in items:
        total = total + t
    return total


def new_list_in_argument(x, d):
    d["fresh"] = [x * 2]
    d["fresh"].append(x * 3)
    return x


def alias_list_twice(x, a, b):
    a.append(x)
    return len(b), x * len(a)


# --- modules -------------------------------------------------------------------------------


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.last_input_shape = tuple(x.shape)
        self.steps.add_(1)
        self.cache = x.detach() * 2
        return self.lin(x) * self.calls


class ParamUpdate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x):
        out = x * self.weight
        with torch.no_grad():
            self.weight.mul_(0.5)
        return out


def call_module(model, x):
    return model(x)


def set_module_attribute(model, x):
    model.scale = 3.0
    model.lin.tag = "set"
    return model.lin(x) * model.scale


def submodule_swap(model, act, x):
    model.act = act
    return model.act(x) + model.lin(x)


def batchnorm_train(bn, x):
    return bn(x) * 2


def batchnorm_train_momentum_none(bn, x):
    return bn(x).relu()


# --- in-place tensor ops on inputs and views -----------------------------------------------


def inplace_input(x):
    x.add_(1)
    return x * 2


def inplace_returns_input(x):
    return x.mul_(2)


def inplace_view_of_input(x):
    x[0].mul_(2)
    return x.sum(0)


def setitem_input(x, y):
    x[1] = y
    x[:, 0] = 0.5
    return x + 1


def inplace_on_list_item(x, items):
    items[0].add_(x)
    items[1] = items[1] * 2
    return x


def inplace_reshape_view(x):
    v = x.view(-1)
    v.mul_(3)
    return v.sum()


def inplace_chain(x):
    x.clamp_(-0.5, 0.5).mul_(2).sub_(0.1)
    return x


def inplace_with_out_of_place_read(x):
    before = x * 1
    x.sub_(before.mean())
    return before, x.sum()


def inplace_functional(x):
    torch.relu_(x)
    torch.nn.functional.relu(x, inplace=True)
    return x.exp()


def inplace_after_view_returned(x):
    v = x[1:]
    x.add_(10)
    return v


def inplace_leaf_requires_grad(x):
    x.add_(1)  # eager: "a leaf Variable that requires grad is being used in an in-place operation"
    return x * 2


def inplace_view_of_leaf(x):
    x[0].mul_(3)
    return x


def no_grad_write_then_use(x):
    with torch.no_grad():
        x.mul_(2)  # autograd does not see it: x stays a leaf that requires grad
        x[0] = 1.0
    return (x * x).sum()


def inplace_nonleaf_requires_grad(x):
    y = x * 2
    y.add_(1)
    y[0] = 0.0
    return y


# --- aliasing -------------------------------------------------------------------------------


def same_tensor_twice_mutate(x, y):
    x.add_(1)
    return y * 2


def same_tensor_twice_read(x, y):
    return x * y + x


def overlapping_views(base, row):
    row.mul_(10)
    return base.sum()


def returns_input_itself(x):
    y = x * 2
    return x, y


def returns_input_identity_ops(x):
    return x.contiguous(), x.float(), x.to(torch.float32), x.type_as(x), x.detach()


def returns_views(x):
    return x[0], x.view(-1), x.t(), x.reshape(6), x.unsqueeze(0), x[:, ::2], x.expand(2, 2, 3)


def returns_copies(x):
    return x.clone(), x.reshape(3, 2).contiguous(), x.t().contiguous(), x + 0, x.flatten() * 1


def returns_parameter(model, x):
    return model.weight, model.weight * x


def returns_buffer_view(model, x):
    return model.offset[:2], x * model.offset


def returns_input_list_item(x, items):
    return items[0], items


# --- global and closure-cell writes ---------------------------------------------------------

counter = 0
LAST: Any = None
REGISTRY: list[Any] = []


def global_counter(x):
    global counter
    counter += 1
    return x * counter


def global_tensor(x):
    global LAST
    LAST = x * 2
    return LAST + 1


def global_list_append(x):
    REGISTRY.append(x.sum())
    return x * len(REGISTRY)


def make_counter():
    count = 0
    total = None

    def step(x):
        nonlocal count, total
        count += 1
        total = x * count if total is None else total + x * count
        return total

    return step


CASES = [
    case("container/list_append", list_append, rand(3), [], calls=3),
    case("container/list_many", list_many_mutations, rand(3), [1, 2, 3, 4], calls=3),
    case("container/list_sort_reverse", list_sort_reverse, rand(3), [3, 1, 2]),
    case("container/dict_update", dict_update, rand(3), {}, calls=3),
    case("container/dict_delete_pop", dict_delete_pop, rand(3), {"a": 1, "b": 2, "c": 3}),
    case("container/dict_clear", dict_clear, rand(3), {"a": rand(3), "b": 2}),
    case("container/set_add", set_add, rand(3), {0, 1}, calls=3),
    case("object/attributes", object_attributes, build=lambda: (torch.randn(3), State()), calls=3),
    case("object/delattr", object_delattr, build=lambda: (torch.randn(3), State())),
    case(
        "container/nested",
        nested_container_mutation,
        build=lambda: (torch.randn(3), {"items": [], "meta": {"n": 0}, "obj": State()}),
        calls=3,
    ),
    case("alias/returned_list_stored", mutation_then_return_container, rand(3), {}, calls=3),
    case("alias/returns_mutated_argument", returns_mutated_argument, rand(3), [], calls=3),
    case("alias/returns_argument_dict", returns_argument_dict, rand(3), {"a": 1}),
    case("container/before_raise", mutation_before_raise, rand(3), [], graphs=None),
    case("container/visible_to_callee", mutation_visible_to_callee, rand(3), [rand(3)], calls=3),
    case("container/new_list_in_argument", new_list_in_argument, rand(3), {}),
    case(
        "alias/same_list_twice",
        alias_list_twice,
        build=lambda: (lambda acc: (torch.randn(3), acc, acc))([]),
        calls=3,
    ),
    case(
        "module/attributes_and_buffer",
        call_module,
        build=lambda: (Counting(), torch.randn(2, 4)),
        calls=3,
    ),
    case(
        "module/param_update_no_grad",
        call_module,
        build=lambda: (ParamUpdate(), torch.randn(4)),
        calls=3,
    ),
    case(
        "module/set_attribute", set_module_attribute, build=lambda: (Counting(), torch.randn(2, 4))
    ),
    case(
        "module/swap_submodule",
        submodule_swap,
        build=lambda: (Counting(), nn.Tanh(), torch.randn(2, 4)),
    ),
    case(
        "module/batchnorm_train",
        batchnorm_train,
        build=lambda: (nn.BatchNorm1d(4).train(), torch.randn(8, 4)),
        calls=3,
    ),
    case(
        "module/batchnorm2d_train_momentum_none",
        batchnorm_train_momentum_none,
        build=lambda: (nn.BatchNorm2d(3, momentum=None).train(), torch.randn(4, 3, 5, 5)),
        calls=3,
        graphs=None,  # float(num_batches_tracked) needs the buffer's value: a break is fine
        breaks=None,
    ),
    case(
        "module/batchnorm_eval_untouched",
        batchnorm_train,
        build=lambda: (nn.BatchNorm1d(4).eval(), torch.randn(8, 4)),
    ),
    case("inplace/input", inplace_input, rand(3), calls=3),
    case("inplace/returns_input", inplace_returns_input, rand(3), calls=3),
    case("inplace/view_of_input", inplace_view_of_input, rand(3, 2), calls=3),
    case("inplace/setitem", setitem_input, rand(3, 2), rand(2)),
    case("inplace/list_item", inplace_on_list_item, rand(3), [rand(3), rand(3)]),
    case("inplace/reshape_view", inplace_reshape_view, rand(2, 3)),
    case("inplace/chain", inplace_chain, rand(5)),
    case("inplace/read_then_write", inplace_with_out_of_place_read, rand(4)),
    case("inplace/functional", inplace_functional, rand(4)),
    case("inplace/view_returned_before_write", inplace_after_view_returned, rand(3)),
    case(
        "inplace/nonleaf_requires_grad", inplace_nonleaf_requires_grad, rand(3, requires_grad=True)
    ),
    case("inplace/leaf_refused", inplace_leaf_requires_grad, rand(3, requires_grad=True)),
    case("inplace/view_of_leaf_refused", inplace_view_of_leaf, rand(3, requires_grad=True)),
    case("inplace/no_grad_write", no_grad_write_then_use, rand(3, requires_grad=True), calls=3),
    case(
        "alias/same_tensor_mutated",
        same_tensor_twice_mutate,
        build=lambda: (lambda t: (t, t))(torch.randn(3)),
        calls=3,
    ),
    case(
        "alias/same_tensor_read",
        same_tensor_twice_read,
        build=lambda: (lambda t: (t, t))(torch.randn(3)),
    ),
    case(
        "alias/overlapping_views",
        overlapping_views,
        # Writing through one input into another's memory: the frame runs uncompiled.
        build=lambda: (lambda b: (b, b[1]))(torch.randn(3, 2)),
        graphs=0,
        skips=[kiln.SkipReason.ALIASED_MUTATION],
    ),
    case("alias/returns_input", returns_input_itself, rand(3)),
    case("alias/identity_ops", returns_input_identity_ops, rand(3), graphs=None),
    case("alias/views", returns_views, rand(2, 3)),
    case("alias/copies", returns_copies, rand(2, 3)),
    case("alias/parameter", returns_parameter, build=lambda: (_weights(), torch.randn(4))),
    case("alias/buffer_view", returns_buffer_view, build=lambda: (_weights(), torch.randn(4))),
    case(
        "alias/input_list_item", returns_input_list_item, rand(3), [rand(3), rand(3)], graphs=None
    ),
]


def _weights() -> nn.Module:
    model = nn.Module()
    model.weight = nn.Parameter(torch.randn(4))
    model.register_buffer("offset", torch.randn(4))
    return model


@pytest.mark.parametrize("fn, args, build, expect", CASES)
def test_mutation(fn: Any, args: Any, build: Any, expect: dict[str, Any]) -> None:
    run_case(fn, args, build, expect)


@pytest.mark.parametrize("fn", [global_counter, global_tensor, global_list_append])
def test_global_writes(fn: Any) -> None:
    """``global`` writes happen on every call, compiled as eagerly (cache hits included)."""
    global counter, LAST

    def fresh() -> None:
        global counter, LAST
        counter, LAST = 0, None
        REGISTRY.clear()

    x = torch.randn(3)
    fresh()
    expected = [fn(x) for _ in range(3)]
    expected_state = (counter, LAST, list(REGISTRY))
    fresh()
    kiln.reset()
    compiled = kiln.compile(fn)
    actual = [compiled(x) for _ in range(3)]
    assert_same(actual, expected, atol=1e-6, rtol=1e-6)
    assert_same(
        (counter, LAST, list(REGISTRY)), expected_state, atol=1e-6, rtol=1e-6, path="globals"
    )
    fresh()
    report = kiln.explain(fn, x)
    fresh()
    assert report.graph_count == 1 and not report.breaks and not report.skips, str(report)


def test_closure_cell_writes() -> None:
    """A compiled closure writing ``nonlocal`` cells updates them on every call."""
    eager, compiled_fn = make_counter(), make_counter()
    compiled = kiln.compile(compiled_fn)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x))
    cells = lambda f: [c.cell_contents for c in f.__closure__]
    assert_same(cells(compiled_fn), cells(eager), atol=1e-6, rtol=1e-6, path="cells")
    assert kiln.explain(make_counter(), x).graph_count == 1


def test_side_effects_before_break_are_visible(capsys: pytest.CaptureFixture[str]) -> None:
    """Mutations made before a graph break are applied before the native step runs."""

    def program(x, acc, obj):
        acc.append(len(acc))
        obj.count += 1
        print(acc, obj.count)
        return x * len(acc)

    x = torch.randn(3)
    acc, obj = [], State()
    for _ in range(2):
        program(x, acc, obj)
    eager = capsys.readouterr().out
    kiln.reset()
    acc2, obj2 = [], State()
    compiled = kiln.compile(program)
    for _ in range(2):
        compiled(x, acc2, obj2)
    assert capsys.readouterr().out == eager
    assert acc2 == acc and obj2.count == obj.count


def test_compiled_module_batchnorm_train_buffers() -> None:
    """Through ``kiln.compile(module)``: BatchNorm running stats update as in eager."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    for _ in range(3):
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(compiled(x), reference(x))
    bn, ref_bn = model[1], reference[1]
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    assert int(bn.num_batches_tracked) == int(ref_bn.num_batches_tracked) == 3


def test_view_output_mutation_reaches_input() -> None:
    """Writing through a returned view of an input changes the input, as in eager."""

    def program(x):
        return x[0]

    x = torch.randn(2, 3)
    out = kiln.compile(program)(x)
    out.fill_(7.0)
    assert torch.equal(x[0], torch.full((3,), 7.0))


def test_mutation_check_can_fail() -> None:
    """The harness notices a program whose compiled run misses a side effect."""

    def eager_only(x, acc):
        if not torch.compiler.is_compiling():
            acc.append(1)
        return x + 1

    with pytest.raises(AssertionError):
        check(eager_only, rand(3), [])


def stores_tensors_in_dict(x, d):
    d["last"] = x * 2
    d["total"] = x.sum()
    return x + 1


def stores_tensor_attribute(x, obj):
    obj.last = x * 3
    return x - 1


def replaces_list_item(x, items):
    items[0] = items[0] + x
    return x * 2


class Stepper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x) + self.steps


def inplace_every_call(x, model):
    x.add_(1)
    return model(x)


@pytest.mark.parametrize(
    "fn, build",
    [
        (stores_tensors_in_dict, lambda: (torch.randn(3), {})),
        (stores_tensor_attribute, lambda: (torch.randn(3), State())),
        (replaces_list_item, lambda: (torch.randn(3), [torch.randn(3)])),
        (inplace_every_call, lambda: (torch.randn(2, 4), Stepper())),
        (global_tensor, lambda: (torch.randn(3),)),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_side_effects_on_cache_hits(fn: Any, build: Any) -> None:
    """Side effects whose guards stay stable: later calls are cache hits, and every hit still
    performs the mutation (final state matches eager after each call)."""
    args = build()
    eager_args, compiled_args = copy.deepcopy(args), copy.deepcopy(args)
    kiln.reset()
    compiled = kiln.compile(fn)
    for call in range(5):
        expected = fn(*eager_args)
        actual = compiled(*compiled_args)
        assert_same(actual, expected, atol=1e-5, rtol=1e-5, path=f"call {call + 1}")
        assert_same(compiled_args, eager_args, atol=1e-5, rtol=1e-5, path=f"call {call + 1}: args")
    assert kiln.counters.cache_hits >= 3, kiln.counters


def test_a_write_under_no_grad_keeps_the_gradient_to_the_leaf() -> None:
    """``with torch.no_grad(): w.clamp_(...)`` then a use of ``w``: the result requires grad
    and ``w.grad`` is eager's (the write is invisible to autograd), on every call; a graph
    captured for a non-leaf that it writes in place is never reused for a leaf."""

    def step(w, x):
        with torch.no_grad():
            w.clamp_(-0.5, 0.5)
            w[0].fill_(0.25)
        return (x * w * w).sum()

    kiln.reset()
    compiled = kiln.compile(step)
    for _ in range(3):
        w, x = torch.randn(5, requires_grad=True), torch.randn(5)
        mine = w.detach().clone().requires_grad_()
        out, expected = compiled(mine, x), step(w, x)
        assert out.requires_grad
        out.backward()
        expected.backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close((mine, mine.grad), (w, w.grad))
    assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks

    def write(x):
        x.mul_(2)
        return x.sum()

    kiln.reset()
    compiled = kiln.compile(write)
    nonleaf = torch.randn(3, requires_grad=True) * 1
    torch.testing.assert_close(compiled(nonleaf.detach().requires_grad_() * 1), write(nonleaf))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        compiled(torch.randn(3, requires_grad=True))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0])
def test_embedding_max_norm_renormalizes_its_weight_in_the_graph(norm_type: float) -> None:
    """``nn.Embedding(max_norm=...)`` scales the rows it reads in place under no_grad
    (``torch.embedding_renorm_``), once per row however often it is read: compiled into the
    graph (no break), the weight and every gradient as eager's, over calls that read rows
    again, under no_grad too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.5, norm_type=norm_type), nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight.mul_(2)
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    with kiln.recording.recording() as events:
        for call in range(4):
            tokens = torch.randint(0, 10, (3, 4))  # (repeated rows)
            if call == 3:
                with torch.no_grad():
                    torch.testing.assert_close(compiled(tokens), reference(tokens))
                continue
            compiled(tokens).relu().sum().backward()
            reference(tokens).relu().sum().backward()
            named = zip(model.named_parameters(), reference.parameters(), strict=True)
            for (name, got), want in named:
                torch.testing.assert_close(got, want, msg=name)
                torch.testing.assert_close(got.grad, want.grad, msg=f"grad of {name}")
            assert model[0].weight.is_leaf and model[0].weight.requires_grad
    report = kiln.capture.driver.explain.report_of(events)
    assert not report.breaks, report.breaks


def test_embedding_max_norm_of_integer_rows_raises_as_eager() -> None:
    weight, tokens = torch.arange(12).reshape(6, 2), torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="norm\\(\\): input dtype should be either floating"):
        torch.nn.functional.embedding(tokens, weight.clone(), max_norm=1.0)
    with pytest.raises(RuntimeError, match="norm\\(\\): input dtype should be either floating"):
        kiln.compile(lambda t, w: torch.nn.functional.embedding(t, w, max_norm=1.0))(tokens, weight)
