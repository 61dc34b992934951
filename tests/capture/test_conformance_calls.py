"""Conformance of calls: inlined user functions, closures, lambdas, methods, ``super()``,
``functools.partial``, ``*args``/``**kwargs``, defaults, keyword-only arguments, and
``nn.Module`` calls (forward, hooks, parameters and buffers, containers, nesting, sharing).

Calls to Python functions are inlined, so each program is one graph with no breaks.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from harness import assert_same, case, check, rand, run_case
from torch import nn

import kiln

# --- plain functions -----------------------------------------------------------------------


def helper(x, y):
    return x * y + 1


def calls_helper(x, y):
    return helper(x, y) - helper(y, x)


def level_c(x):
    return x.cos()


def level_b(x):
    return level_c(x) * 2


def level_a(x):
    return level_b(x) + level_c(x)


def calls_nested(x):
    return level_a(x) + 1


def factorial_scale(x, n):
    if n <= 1:
        return x
    return factorial_scale(x, n - 1) * n


def calls_recursive(x):
    return factorial_scale(x, 4)


def with_defaults(x, scale=2.0, bias=None, *, shift=0.5, clip=False):
    out = x * scale + shift
    if bias is not None:
        out = out + bias
    if clip:
        out = out.clamp(-1, 1)
    return out


def calls_defaults(x, b):
    return (
        with_defaults(x),
        with_defaults(x, 3.0),
        with_defaults(x, bias=b),
        with_defaults(x, shift=-1.0, clip=True),
        with_defaults(x, 0.5, b, shift=2.0),
    )


def keyword_only(x, *, scale, offset=1):
    return x * scale + offset


def calls_keyword_only(x):
    return keyword_only(x, scale=2) + keyword_only(x, offset=3, scale=0.5)


def varargs(*args, **kwargs):
    total = args[0]
    for a in args[1:]:
        total = total + a
    for key in sorted(kwargs):
        total = total * kwargs[key]
    return total, len(args), sorted(kwargs)


def calls_varargs(x, y):
    items = [x, y]
    options = {"b": 2.0, "a": 0.5}
    return varargs(x), varargs(x, y, a=3), varargs(*items, **options), varargs(x, *items, c=1)


def forwards_varargs(*args, **kwargs):
    return varargs(*args, **kwargs)


def calls_forwarding(x, y):
    return forwards_varargs(x, y, scale=2.0)


def positional_only(x, y, /, z=1.0):
    return x - y * z


def calls_positional_only(x, y):
    return positional_only(x, y), positional_only(x, y, 3.0), positional_only(x, y, z=0.5)


def compiled_signature(x, scale=2.0, *rest, shift=1.0, **extra):
    out = x * scale + shift
    for r in rest:
        out = out + r
    return out, sorted(extra)


def calls_kwargs_dict(x):
    kw = dict(scale=3.0, shift=-1.0)
    return with_defaults(x, **kw), keyword_only(x, **{"scale": 2})


# --- closures and lambdas ------------------------------------------------------------------


def make_scaler(k):
    def scale(x):
        return x * k

    return scale


def calls_closure(x):
    double = make_scaler(2.0)
    triple = make_scaler(3.0)
    return double(x) + triple(x)


def inner_closure_reads(x, k):
    offset = x.mean()

    def inner(t):
        return t * k + offset

    return inner(x), inner(x * 2)


def inner_closure_writes(x):
    count = 0
    acc = x

    def bump(t):
        nonlocal count, acc
        count += 1
        acc = acc + t
        return count

    bump(x)
    n = bump(x * 2)
    return acc * count, n


def nested_closures(x):
    def outer(a):
        def middle(b):
            def inner(c):
                return a + b + c

            return inner

        return middle

    return outer(x)(x * 2)(x * 3)


def closure_late_binding(x):
    fns = [lambda t, i=i: t * i for i in range(3)]
    late = [lambda t: t * i for i in range(3)]  # noqa: B023  (late binding is the construct)
    return [f(x) for f in fns], [f(x) for f in late]


def lambdas(x, y):
    add = lambda a, b=1.0: a + b
    square = lambda t: t * t
    return add(x, y), add(x), square(add(y)), (lambda: x.sum())()


def lambda_argument(x, fn):
    return fn(x) + fn(x * 2)


def higher_order(x):
    def compose(f, g):
        return lambda t: f(g(t))

    return compose(torch.sin, lambda t: t * 2)(x)


_scaler_closure = make_scaler(4.0)


def closure_from_global(x):
    return _scaler_closure(x) - 1


# --- methods, classes, super() -------------------------------------------------------------


class Affine:
    factor = 10

    def __init__(self, scale: float, shift: float) -> None:
        self.scale = scale
        self.shift = shift

    def apply(self, x):
        return x * self.scale + self.shift

    def twice(self, x):
        return self.apply(self.apply(x))

    @property
    def ratio(self):
        return self.scale / self.shift

    @staticmethod
    def static_op(x):
        return x - 1

    @classmethod
    def from_factor(cls, x):
        return x * cls.factor


class Base:
    def __init__(self) -> None:
        self.base_scale = 2.0

    def op(self, x):
        return x * self.base_scale

    def name(self):
        return "base"


class Child(Base):
    def __init__(self) -> None:
        super().__init__()
        self.bias = 0.5

    def op(self, x):
        return super().op(x) + self.bias

    def name(self):
        return "child:" + super().name()


class GrandChild(Child):
    def op(self, x):
        return super(Child, self).op(x) - super().op(x)


def calls_methods(x, obj):
    return obj.apply(x), obj.twice(x), obj.ratio, Affine.static_op(x), obj.from_factor(x)


def calls_unbound_method(x, obj):
    return Affine.apply(obj, x), obj.apply(x)


def calls_super(x, obj):
    return obj.op(x), obj.name()


def creates_objects(x):
    obj = Affine(2.0, 0.5)
    child = Child()
    return obj.apply(x) + child.op(x), child.bias


def bound_method_argument(x, method):
    return method(x) * 2


def method_on_tensor_attr(x):
    return x.new_zeros(2).add(1), x.clone().fill_(2.0)


# --- functools.partial ---------------------------------------------------------------------


def calls_partial(x, y):
    p = functools.partial(with_defaults, scale=3.0)
    q = functools.partial(helper, y)
    return p(x), p(x, shift=0.0), q(x), functools.partial(torch.add, alpha=2)(x, y)


def partial_argument(x, fn):
    return fn(x)


# --- nn.Module -----------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)
        self.scale = 0.5

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) * self.scale + x


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.register_buffer("offset", torch.randn(4))
        self.register_buffer("unused", None)

    def forward(self, x):
        return x * self.weight + self.offset


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 3)})
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        for i, layer in enumerate(self.layers):
            x = x + layer(x) * i
        x = self.layers[-1](self.layers[0](x)) + len(self.layers)
        x = self.seq(x) + self.seq[0](x) + self.seq[-1](x)
        for part in self.seq:
            x = part(x)
        out = {name: head(x) for name, head in self.heads.items()}
        out["sum"] = sum(self.heads[k](x).sum() for k in self.heads)
        return out, "a" in self.heads, list(self.heads.keys())


class SlicedContainers(Stack):
    """Slicing a ModuleList or Sequential builds a new container of the same modules."""

    def forward(self, x):
        for layer in self.layers[1:]:
            x = layer(x)
        return self.seq[1:](x) + self.seq[:1](x), len(self.layers[:2])


class Block(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.blocks(x))


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.lin(x)) + self.lin(x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 10, bias=False)
        self.proj.weight = self.embed.weight
        self.shared = nn.Linear(4, 4)
        self.again = self.shared

    def forward(self, ids):
        h = self.embed(ids)
        return self.proj(self.again(self.shared(h)))


class Configurable(nn.Module):
    def __init__(self, activation: str, residual: bool) -> None:
        super().__init__()
        self.activation = activation
        self.residual = residual
        self.lin = nn.Linear(4, 4)

    def helper(self, x):
        if self.activation == "relu":
            return x.relu()
        return torch.tanh(x)

    def forward(self, x, *, scale=1.0):
        y = self.helper(self.lin(x)) * scale
        if self.training:
            y = y * 2
        return y + x if self.residual else y


class ChildMLP(MLP):
    def forward(self, x):
        return super().forward(x) * 2 + MLP.forward(self, x)


class ReturnsStructures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        h = self.lin(x)
        if mask is not None:
            h = h * mask
        return {"hidden": h, "pooled": (h.mean(0), h.amax(0))}


class ParameterWalk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3, bias=False)

    def forward(self, x):
        total = x.sum() * 0
        for p in self.parameters():
            total = total + p.sum()
        names = [name for name, _ in self.named_parameters()]
        count = sum(p.numel() for p in self.parameters())
        return self.b(self.a(x)) + total, names, count, len(list(self.children()))


def pre_hook(module, args):
    return (args[0] * 2,)


def pre_hook_kwargs(module, args, kwargs):
    return (args[0] + 1,), {**kwargs, "scale": 3.0}


def post_hook(module, args, output):
    return output + args[0]


def post_hook_kwargs(module, args, kwargs, output):
    return output * kwargs.get("scale", 1.0)


def observing_hook(module, args, output):
    module.seen = output.shape[0]


def hooked(kind: str) -> nn.Module:
    model = Configurable("relu", residual=True)
    if kind == "pre":
        model.register_forward_pre_hook(pre_hook)
    elif kind == "pre_kwargs":
        model.register_forward_pre_hook(pre_hook_kwargs, with_kwargs=True)
    elif kind == "post":
        model.register_forward_hook(post_hook)
    elif kind == "post_kwargs":
        model.register_forward_hook(post_hook_kwargs, with_kwargs=True)
    elif kind == "all":
        model.register_forward_pre_hook(pre_hook)
        model.register_forward_pre_hook(pre_hook_kwargs, with_kwargs=True)
        model.register_forward_hook(post_hook)
        model.register_forward_hook(post_hook_kwargs, with_kwargs=True)
    elif kind == "submodule":
        model.lin.register_forward_hook(post_hook)
        model.lin.register_forward_pre_hook(pre_hook)
    elif kind == "observing":
        model.register_forward_hook(observing_hook)
    return model


def call_module(model, x):
    return model(x)


def call_module_kwargs(model, x):
    return model(x, scale=0.5)


def call_module_twice(model, x):
    return model(x) + model(x * 2)


def call_forward_directly(model, x):
    return model.forward(x)


def module_attributes(model, x):
    w = model.fc1.weight
    return x @ w.t() + model.fc1.bias, model.fc1.in_features, model.scale, w.shape


def module_buffers(model, x):
    return x * model.weight + model.offset, model.unused is None, model.weight


def functional_with_params(model, x):
    return torch.nn.functional.linear(x, model.fc1.weight, model.fc1.bias).sum(-1)


def module_list_index(model, x):
    return model.layers[1](x), model.layers[-1].weight, model.heads["b"](x)


def two_models(a, b, x):
    return a(x) + b(x)


def module_in_container(x, mods):
    return [m(x) for m in mods["list"]], mods["one"](x)


def module_isinstance(model, x):
    out = x
    for m in model.modules():
        if isinstance(m, nn.Linear):
            out = out + m.bias.sum()
    return out, type(model).__name__


def mlp() -> MLP:
    return MLP()


def deep_recursion(x, n):
    if n == 0:
        return x
    return deep_recursion(x + 1, n - 1)


def calls_deep_recursion(x):
    return deep_recursion(x, 60) * 2


@torch.no_grad()
def decorated_program(x):
    return x * 2


CASES = [
    case("fn/helper", calls_helper, rand(3), rand(3)),
    # Past the inline depth each level is its own frame (one entry per n): breaks, recompile
    # limits and skips are all fine here; only the result is checked.
    case("fn/deep_recursion", calls_deep_recursion, rand(3), graphs=None, breaks=None, skips=None),
    case("fn/compiled_decorated_no_grad", decorated_program, rand(3, requires_grad=True)),
    case("fn/nested", calls_nested, rand(3)),
    case("fn/recursive", calls_recursive, rand(3)),
    case("fn/defaults", calls_defaults, rand(3), rand(3)),
    case("fn/keyword_only", calls_keyword_only, rand(3)),
    case("fn/varargs", calls_varargs, rand(3), rand(3)),
    case("fn/forwarding", calls_forwarding, rand(3), rand(3)),
    case("fn/positional_only", calls_positional_only, rand(3), rand(3)),
    case("fn/kwargs_dict", calls_kwargs_dict, rand(3)),
    case("fn/compiled_signature_defaults", compiled_signature, rand(3)),
    case("fn/compiled_signature_all", compiled_signature, rand(3), 3.0, rand(3), rand(3), a=1),
    case("fn/compiled_keyword_only", with_defaults, rand(3), shift=2.0, clip=True),
    case("fn/compiled_keyword_tensor", with_defaults, rand(3), bias=rand(3)),
    case("closure/factory", calls_closure, rand(3)),
    case("closure/inner_reads", inner_closure_reads, rand(3), 2.0),
    case("closure/inner_writes_nonlocal", inner_closure_writes, rand(3)),
    case("closure/nested", nested_closures, rand(3)),
    case("closure/late_binding", closure_late_binding, rand(3)),
    case("closure/compiled_closure", make_scaler(1.5), rand(3)),
    case("closure/global_closure", closure_from_global, rand(3)),
    case("lambda/local", lambdas, rand(3), rand(3)),
    case("lambda/argument", lambda_argument, rand(3), lambda t: t.sin() * 2),
    case("lambda/higher_order", higher_order, rand(3)),
    case("lambda/compiled_lambda", lambda x, y: (x - y).abs().sum(), rand(3), rand(3)),
    case("method/calls", calls_methods, build=lambda: (torch.randn(3), Affine(2.0, 0.5))),
    case("method/unbound", calls_unbound_method, build=lambda: (torch.randn(3), Affine(2.0, 4))),
    case("method/super_zero_arg", calls_super, build=lambda: (torch.randn(3), Child())),
    case("method/super_two_arg", calls_super, build=lambda: (torch.randn(3), GrandChild())),
    case("method/creates_objects", creates_objects, rand(3)),
    case(
        "method/bound_argument",
        bound_method_argument,
        build=lambda: (torch.randn(3), Affine(3.0, 1.0).twice),
    ),
    case("method/tensor_methods", method_on_tensor_attr, rand(3)),
    case("partial/local", calls_partial, rand(3), rand(3)),
    case(
        "partial/argument",
        partial_argument,
        build=lambda: (torch.randn(3), functools.partial(with_defaults, scale=0.1, shift=3)),
    ),
    case("module/mlp", call_module, build=lambda: (MLP(), torch.randn(2, 4))),
    case("module/buffers", call_module, build=lambda: (WithBuffer(), torch.randn(2, 4))),
    case("module/containers", call_module, build=lambda: (Stack(), torch.randn(2, 4))),
    case("module/sliced_containers", call_module, build=lambda: (SlicedContainers(), rand(2, 4))),
    case("module/nested", call_module, build=lambda: (Nested(), torch.randn(2, 4))),
    case("module/called_twice", call_module, build=lambda: (CalledTwice(), torch.randn(2, 4))),
    case(
        "module/shared_parameters",
        call_module,
        build=lambda: (Tied(), torch.randint(0, 10, (2, 3))),
    ),
    case(
        "module/configurable_relu",
        call_module,
        build=lambda: (Configurable("relu", True), torch.randn(2, 4)),
    ),
    case(
        "module/configurable_tanh_eval",
        call_module,
        build=lambda: (Configurable("tanh", False).eval(), torch.randn(2, 4)),
    ),
    case(
        "module/forward_kwargs",
        call_module_kwargs,
        build=lambda: (Configurable("relu", True), torch.randn(2, 4)),
    ),
    case("module/subclass_super", call_module, build=lambda: (ChildMLP(), torch.randn(2, 4))),
    case(
        "module/returns_structures",
        call_module,
        build=lambda: (ReturnsStructures(), torch.randn(3, 4)),
    ),
    case("module/parameter_walk", call_module, build=lambda: (ParameterWalk(), torch.randn(2, 3))),
    case("module/call_twice_outer", call_module_twice, build=lambda: (MLP(), torch.randn(2, 4))),
    case(
        "module/forward_directly", call_forward_directly, build=lambda: (MLP(), torch.randn(2, 4))
    ),
    case("module/attributes", module_attributes, build=lambda: (MLP(), torch.randn(2, 4))),
    case("module/buffer_attributes", module_buffers, build=lambda: (WithBuffer(), torch.randn(4))),
    case("module/functional_params", functional_with_params, build=lambda: (MLP(), torch.randn(4))),
    case("module/list_index", module_list_index, build=lambda: (Stack(), torch.randn(2, 4))),
    case("module/two_models", two_models, build=lambda: (MLP(), Block(), torch.randn(2, 4))),
    case(
        "module/in_container",
        module_in_container,
        build=lambda: (torch.randn(2, 4), {"list": [MLP(), nn.Tanh()], "one": nn.Linear(4, 1)}),
    ),
    case("module/isinstance", module_isinstance, build=lambda: (Nested(), torch.randn(2, 4))),
    case(
        "module/no_grad_params",
        call_module,
        build=lambda: (MLP().requires_grad_(False), rand(2, 4)),
    ),
    *[
        case(
            f"hooks/{kind}",
            call_module,
            build=functools.partial(lambda k: (hooked(k), torch.randn(2, 4)), kind),
        )
        for kind in ("pre", "pre_kwargs", "post", "post_kwargs", "all", "submodule", "observing")
    ],
]


@pytest.mark.parametrize("fn, args, build, expect", CASES)
def test_calls(fn: Any, args: Any, build: Any, expect: dict[str, Any]) -> None:
    run_case(fn, args, build, expect)


@pytest.mark.parametrize(
    "make",
    [MLP, Nested, Stack, CalledTwice, lambda: hooked("all"), lambda: hooked("observing")],
    ids=["mlp", "nested", "containers", "called_twice", "hooks", "observing_hook"],
)
def test_compiled_module_object(make: Any) -> None:
    """``kiln.compile(module)`` returns a CompiledModule sharing the parameters; calling it
    matches the module, and the module's state (including attributes a hook sets) matches."""
    kiln.reset()
    model = make()
    reference = copy.deepcopy(model)
    compiled = kiln.compile(model)
    assert isinstance(compiled, kiln.CompiledModule)
    assert compiled._orig_mod is model
    for name, p in model.named_parameters():
        assert compiled.get_parameter(f"_orig_mod.{name}") is p
    x = torch.randn(2, 4)
    for _ in range(2):
        out = compiled(x)
        expected = reference(x)
        check_same(out, expected)
    check_same(model, reference)
    report = kiln.explain(compiled, x)
    assert report.graph_count == 1 and not report.breaks and not report.skips, str(report)


def test_compiled_bound_method() -> None:
    """``kiln.compile(obj.method)`` compiles a bound method; ``super()`` inside it works."""
    child = GrandChild()
    x = torch.randn(3)
    compiled = kiln.compile(child.op)
    torch.testing.assert_close(compiled(x), child.op(x))
    torch.testing.assert_close(compiled(x), child.op(x))
    report = kiln.explain(child.op, x)
    assert report.graph_count == 1 and not report.breaks, str(report)


def test_compiled_module_method_other_than_forward() -> None:
    model = Configurable("tanh", residual=False)
    x = torch.randn(2, 4)
    compiled = kiln.compile(model.helper)
    torch.testing.assert_close(compiled(x), model.helper(x))
    assert kiln.explain(model.helper, x).graph_count == 1


def test_decorator_forms() -> None:
    @kiln.compile
    def plain(x):
        return x.sin() + 1

    @kiln.compile(fullgraph=True)
    def strict(x, n=2):
        return x * n

    x = torch.randn(3)
    torch.testing.assert_close(plain(x), x.sin() + 1)
    torch.testing.assert_close(strict(x), x * 2)
    torch.testing.assert_close(strict(x, n=3), x * 3)
    assert plain.__name__ == "plain" and strict.__name__ == "strict"


def check_same(actual: Any, expected: Any) -> None:
    assert_same(actual, expected, atol=1e-5, rtol=1e-5)


def test_callable_object_with_call_method() -> None:
    """An object whose class defines ``__call__`` compiles through its bound ``__call__``."""

    class Scaler:
        def __init__(self) -> None:
            self.k = 3.0

        def __call__(self, x):
            return x * self.k + 1

    check(Scaler(), rand(3))
