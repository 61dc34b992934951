"""How the real-programs harness compares an eager run with a compiled one, and what it takes
a program's state and a call's guardable signature to be.

Outputs and state are compared with ``tests/capture/harness.py``'s ``assert_same`` (container
types, keys, lengths, modules' parameters, buffers and attributes), after its tensors and
floats are wrapped so that NaN equals NaN (eager's NaN must stay NaN compiled; that harness
calls ``assert_close`` without ``equal_nan``) and a Python float from ``.item()`` may differ in
its last bits, as tensors may.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "capture"))
from harness import assert_same, assert_same_aliasing


class _Float:
    """A Python float compared within a tolerance; NaN equals NaN."""

    __slots__ = ("atol", "rtol", "value")

    def __init__(self, value: float, atol: float, rtol: float) -> None:
        self.value, self.atol, self.rtol = value, atol, rtol

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Float):
            return NotImplemented
        if math.isnan(self.value) or math.isnan(other.value):
            return math.isnan(self.value) and math.isnan(other.value)
        return math.isclose(self.value, other.value, rel_tol=self.rtol, abs_tol=self.atol)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return repr(self.value)


class _Tensor:
    """A tensor compared by type, ``requires_grad``, dtype, shape, device and values within a
    tolerance, NaN equal to NaN. ``assert_same`` reports ``actual != expected`` by their
    reprs, so the compiled side's repr is the mismatch."""

    __slots__ = ("atol", "problem", "rtol", "tensor")

    def __init__(self, tensor: torch.Tensor, atol: float, rtol: float) -> None:
        self.tensor, self.atol, self.rtol = tensor, atol, rtol
        self.problem = ""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Tensor):
            return NotImplemented
        actual, expected = self.tensor, other.tensor
        try:
            assert type(actual) is type(expected), (
                f"{type(actual).__name__} != eager's {type(expected).__name__}"
            )
            assert actual.requires_grad == expected.requires_grad, (
                f"requires_grad {actual.requires_grad} != eager's {expected.requires_grad}"
            )
            torch.testing.assert_close(
                actual.detach(), expected.detach(), atol=self.atol, rtol=self.rtol, equal_nan=True
            )
        except AssertionError as error:
            self.problem = str(error)
            return False
        return True

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return self.problem or f"a tensor of shape {tuple(self.tensor.shape)}"


def _wrapped(value: Any, atol: float, rtol: float) -> Any:
    """``value`` with the tensors, generators and floats of its containers wrapped."""
    if isinstance(value, torch.Tensor):
        return _Tensor(value, atol, rtol)
    if isinstance(value, np.ndarray):
        return ("ndarray", _Tensor(torch.as_tensor(value), atol, rtol))
    if isinstance(value, torch.Generator):  # where its stream stands
        return _Tensor(value.get_state(), 0.0, 0.0)
    if isinstance(value, torch.optim.Optimizer):  # its state is keyed by the parameters
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in value.param_groups]
        slots = [dict(value.state[p]) for g in value.param_groups for p in g["params"]]
        return _wrapped([hyper, slots], atol, rtol)
    if type(value) is float:
        return _Float(value, atol, rtol)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_wrapped(v, atol, rtol) for v in value))
    if type(value) in (tuple, list):
        return type(value)(_wrapped(v, atol, rtol) for v in value)
    if type(value) is dict:
        return {k: _wrapped(v, atol, rtol) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(copied, field.name, _wrapped(getattr(value, field.name), atol, rtol))
        return copied
    return value


def same(actual: Any, expected: Any, *, atol: float, rtol: float, path: str) -> None:
    """``actual`` (compiled) equals ``expected`` (eager) as a pytree (module docstring)."""
    assert_same(
        _wrapped(actual, atol, rtol),
        _wrapped(expected, atol, rtol),
        atol=atol,
        rtol=rtol,
        path=path,
    )


def same_aliasing(actual: Any, expected: Any, actual_inputs: Any, expected_inputs: Any) -> None:
    """Outputs that are, or share memory with, inputs in eager do so compiled, and only they."""
    assert_same_aliasing(actual, expected, actual_inputs, expected_inputs)


def tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in nested containers and dataclasses, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 8:
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors(getattr(value, field.name), depth + 1)


def signature(value: Any) -> Any:
    """What guards may specialise on: tensors' metadata (not their values) and every other
    leaf's value. Two calls with one signature must not recompile."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride(), value.requires_grad)
    if isinstance(value, np.ndarray):  # array-like, as a tensor
        return ("ndarray", value.shape, value.dtype.str)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, signature(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value), *(signature(getattr(value, f.name)) for f in fields))
    return (type(value), repr(value))


def state_of(target: Any) -> list[Any]:
    """What a program can change besides its arguments: a module; a bound method's object; a
    function's closure cells holding containers, objects, tensors, generators or modules (not
    the functions and classes it refers to)."""
    if isinstance(target, nn.Module):
        return [target]
    if isinstance(target, types.MethodType):
        return [target.__self__, *state_of(target.__func__)]
    cells = getattr(target, "__closure__", None) or ()
    code = (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)
    return [c.cell_contents for c in cells if not isinstance(c.cell_contents, code)]


def guarded_state(target: Any) -> Any:
    """The program state guards may specialise on, beyond the arguments: every module's
    training flag and the Parameter objects it holds (reassigning one may recompile)."""
    modules = [m for m in state_of(target) if isinstance(m, nn.Module)]
    return [
        (m.training, tuple(id(p) for p in m.parameters(recurse=False)))
        for module in modules
        for m in module.modules()
    ]


def parameters(target: Any) -> list[tuple[str, nn.Parameter]]:
    """Named parameters of the program's modules (itself, its object or its closure's)."""
    modules = [m for m in state_of(target) if isinstance(m, nn.Module)]
    return [(f"m{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]
