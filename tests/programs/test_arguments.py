"""Arguments that are not tensors, called with new values, and compile options.

A function taking a ``slice``, ``None``, an int, a float, a string, a tuple, a list, a dtype or
a bool may specialise on the value (a new value recompiles: the row's variants give it new
values), but a call repeating earlier values with new tensor values must not recompile, and
each new value must give eager's result, never a cached one. A NumPy array argument counts as
a tensor: new values at one shape must not recompile, and must be used.

Options: the same function compiled with ``backend="kiln"`` and then ``backend="eager"`` (each
must capture and run its own graphs), ``recompile_limit`` (past it the frame runs uncompiled:
the one expected skip), ``fullgraph=True`` and ``strict``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln

from .harness import Call, Program, check_program, params

LIMIT = kiln.SkipReason.RECOMPILE_LIMIT


def sliced(x, s):
    return x[s] * 2, x[:, s].sum(0)


def optional_bias(x, bias=None):
    y = x @ x.t()
    if bias is not None:
        y = y + bias
    return y.relu()


def rolled_topk(x, k):
    return x.roll(k, dims=1).topk(k, dim=1).values


def scaled(x, alpha):
    return x * alpha + alpha**2


def activation(x, name):
    if name == "gelu":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    return torch.tanh(x)


def reshaped(x, shape):
    return x.reshape(shape).sum(-1)


def permuted(x, dims):
    return x.permute(*dims).contiguous() + 1


def as_dtype(x, dtype):
    return (x * 3).to(dtype) + 1


def flagged(x, *, normalize):
    return F.normalize(x, dim=-1) if normalize else x / 2


def indexed(x, i):
    return x[i] + x[-1 - i]


def with_options(x, **options):
    y = x * options.get("scale", 1.0)
    if options.get("square", False):
        y = y * y
    return y + len(options)


def defaults(x, eps=1e-5, dim=-1):
    return x / (x.norm(dim=dim, keepdim=True) + eps)


class Configured(nn.Module):
    """A module whose forward takes a mode string and an optional mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mode="sum", mask=None):
        h = self.fc(x)
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return h.sum(1) if mode == "sum" else h.amax(1)


def from_numpy_argument(x, array):
    """A NumPy array argument (a data loader's batch) turned into a tensor in the program."""
    return torch.from_numpy(array).float() * x


def numpy_inputs(variant: int) -> tuple[torch.Tensor, Any]:
    return torch.randn(4 + variant), torch.randn(4 + variant, dtype=torch.float64).numpy()


# --- inputs (the variant picks the non-tensor value; 0 repeats it with new tensors) ---------


def value_per_variant(values: list[Any], shape=(4, 6)):
    def make(variant: int) -> tuple[torch.Tensor, Any]:
        return torch.randn(shape), values[variant]

    return make


def bias_inputs(variant: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(4, 3)
    return (x,) if variant == 0 else (x, torch.randn(4, 4))


def flag_inputs(variant: int) -> Call:
    return Call((torch.randn(3, 5),), {"normalize": variant == 0})


def option_inputs(variant: int) -> Call:
    options = [{"scale": 2.0}, {"scale": 0.5, "square": True}][variant]
    return Call((torch.randn(3, 4),), options)


def default_inputs(variant: int) -> Call:
    return Call((torch.randn(3, 4),), {} if variant == 0 else {"dim": 0})


def configured_inputs(variant: int) -> Call:
    x = torch.randn(3, 8)
    if variant == 0:
        return Call((x,))
    return Call((x,), {"mode": "max", "mask": torch.rand(3, 8) > 0.5})


def rows(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(4 + 2 * variant, 8),)


def many_shapes(variant: int) -> tuple[torch.Tensor]:
    return (torch.randn(2 + variant, 5),)


# --- options --------------------------------------------------------------------------------


def mlp_function(x):
    return torch.tanh(x @ x.t()).softmax(-1) @ x


def kiln_then_eager(fn):
    """Compile and run with the default backend, then hand back an eager-backend compile of
    the same function: it must capture anew, not reuse the kiln backend's cache."""
    kiln.compile(fn)(torch.randn(4, 8))
    return kiln.compile(fn, backend="eager")


def eager_then_kiln(fn):
    kiln.compile(fn, backend="eager")(torch.randn(4, 8))
    return kiln.compile(fn, backend="kiln")


def static_with_limit(limit):
    """Compiled with every size static, so that each new shape is a recompile."""
    return lambda fn: kiln.compile(fn, dynamic=False, options={"recompile_limit": limit})


def two_limits(fn):
    """The same function under two recompile limits: the limit of 1 is used for the run."""
    kiln.compile(fn, options={"recompile_limit": 8})(torch.randn(3, 8))
    return kiln.compile(fn, options={"recompile_limit": 1})


PROGRAMS = [
    Program("slice-argument", lambda: sliced, value_per_variant([slice(0, 2), slice(1, 4, 2)])),
    Program("none-or-tensor-argument", lambda: optional_bias, bias_inputs),
    Program("int-argument", lambda: rolled_topk, value_per_variant([1, 3])),
    Program("float-argument", lambda: scaled, value_per_variant([0.5, -1.25])),
    Program("string-argument", lambda: activation, value_per_variant(["gelu", "silu"])),
    Program("tuple-argument", lambda: reshaped, value_per_variant([(2, 12), (3, 2, 4)])),
    Program(
        "list-argument",
        lambda: permuted,
        value_per_variant([[1, 0, 2], [2, 0, 1]], shape=(2, 3, 4)),
    ),
    Program("dtype-argument", lambda: as_dtype, value_per_variant([torch.float64, torch.int32])),
    Program("bool-keyword-only", lambda: flagged, flag_inputs),
    Program("negative-int-index", lambda: indexed, value_per_variant([0, 2])),
    Program("kwargs-dict", lambda: with_options, option_inputs),
    Program("defaults-overridden", lambda: defaults, default_inputs),
    Program("module-string-and-optional-mask", Configured, configured_inputs),
    Program(
        "numpy-array-argument",
        lambda: from_numpy_argument,
        numpy_inputs,
        graphs=1,
        breaks=(kiln.BreakReason.UNSUPPORTED_CALL,),  # torch.from_numpy runs natively
        captures=2,
    ),
    Program(
        "backend-kiln-then-eager",
        lambda: mlp_function,
        rows,
        compile=kiln_then_eager,
    ),
    Program(
        "backend-eager-then-kiln",
        lambda: mlp_function,
        rows,
        compile=eager_then_kiln,
    ),
    Program(
        "backend-eager-module",
        Configured,
        configured_inputs,
        backend="eager",
    ),
    Program(
        "recompile-limit-1",
        lambda: mlp_function,
        rows,
        options={"recompile_limit": 1},
        later_graphs=0,
        skips=(LIMIT,),
    ),
    Program(
        "recompile-limit-2",
        lambda: mlp_function,
        many_shapes,
        variants=(0, 1, 2, 3, 1),
        graphs=(1, 1, 0, 0, 0),
        compile=static_with_limit(2),
        skips=(LIMIT,),
    ),
    Program(
        "recompile-limits-side-by-side",
        lambda: mlp_function,
        rows,
        compile=two_limits,
        later_graphs=0,
        skips=(LIMIT,),
    ),
    Program(
        "recompile-limit-module",
        lambda: nn.Sequential(nn.Linear(5, 5), nn.GELU()),
        many_shapes,
        variants=(0, 1, 2, 3),
        # past the limit the caller runs uncompiled and its callee, Sequential.forward,
        # compiles under its own limit
        graphs=(1, 1, 1, 1),
        compile=static_with_limit(3),
        skips=(LIMIT,),
    ),
    Program(
        "fullgraph",
        lambda: mlp_function,
        rows,
        compile=lambda fn: kiln.compile(fn, fullgraph=True),
    ),
    Program(
        "strict-option",
        Configured,
        configured_inputs,
        options={"strict": True},
    ),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_arguments(program: Program) -> None:
    check_program(program)
