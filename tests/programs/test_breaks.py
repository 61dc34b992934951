"""Every kind of graph break, in four places and two modes.

Kinds: ``print``, ``.item()``, ``.tolist()``, ``if tensor:``, ``if x.sum() > 0``, boolean-mask
indexing, ``torch.nonzero``, ``torch.unique``, ``torch.masked_select``, ``kiln.graph_break()``,
a C function capture cannot see into (``os.getpid``), ``logging`` and ``warnings.warn``.
Places: a module's ``forward``; a plain function; a callee of a function
(``caller -> inner``); behind ``*args/**kwargs`` forwarding (``outer(*a, **k) -> inner``).
Modes: inference (modules under ``no_grad``) and training (every parameter's and input's
gradient checked).

The data-dependent ops select a number of elements fixed by the input's shape (values above
the median), so new values at one shape must not recompile; ``if`` kinds take their branch
from the input's sign: calls 1 and 2 take one branch, call 3 (same shapes) the other, call 4
has new shapes.

Expected counts, from one break of reason R in the innermost function: a plain function
compiles the graph before the break and its resume function's graph and records [R]; a module
also records R for the ``__call__`` frame whose call to ``forward`` broke; a caller compiles
its own graphs before and after the call and records R once more; a forwarder has no tensor
work of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import kiln

from .harness import Call, Program, WrongCounters, Xfail, check_program, params

IO = kiln.BreakReason.IO
DATA = kiln.BreakReason.DATA_DEPENDENT
EXPLICIT = kiln.BreakReason.EXPLICIT
CALL = kiln.BreakReason.UNSUPPORTED_CALL

log = logging.getLogger("programs.breaks")

# --- the kinds, as plain functions ----------------------------------------------------------


def print_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    print("rows", h.shape[0])
    return h * 2 + 1


def item_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    scale = h.abs().mean().item()
    return h / scale


def tolist_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    top = max(h[:, 0].tolist())
    return h - top


def if_tensor_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    positive = x.mean() > 0
    if positive:
        return h * 2
    return h.exp()


def if_sum_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    if x.sum() > 0:
        h = h * 2
    return h + 1


def mask_index_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    picked = h[h > h.median()]
    return h * picked.mean()


def nonzero_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    rows = torch.nonzero(h[:, 0] > h[:, 0].median()).squeeze(1)
    return h.index_select(0, rows) * 2


def unique_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    _, counts = torch.unique(y, return_counts=True)
    weight = (1.0 / counts.float())[y]
    return h * weight[:, None]


def masked_select_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    picked = torch.masked_select(h, h > h.median())
    return h + picked.sum()


def explicit_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    kiln.graph_break()
    return h * 3


def c_call_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    pid = os.getpid()
    return h * 2 if pid > 0 else h


def logging_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    log.warning("rows %d", h.shape[0])
    return h + 1


def warning_fn(x, w, y=None):
    h = torch.tanh(x @ w)
    warnings.warn(f"{h.shape[0]} rows", stacklevel=1)
    return h * h


# --- the kinds, inside a module's forward ---------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)


class PrintNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        print("rows", h.shape[0])
        return self.fc2(h * 2 + 1)


class ItemNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        scale = h.abs().mean().item()
        return self.fc2(h / scale)


class TolistNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        top = max(h[:, 0].tolist())
        return self.fc2(h - top)


class IfTensorNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        positive = x.mean() > 0
        if positive:
            return self.fc2(h * 2)
        return self.fc2(h.exp())


class IfSumNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        if x.sum() > 0:
            h = h * 2
        return self.fc2(h + 1)


class MaskIndexNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        picked = h[h > h.median()]
        return self.fc2(h * picked.mean())


class NonzeroNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        rows = torch.nonzero(h[:, 0] > h[:, 0].median()).squeeze(1)
        return self.fc2(h.index_select(0, rows) * 2)


class UniqueNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        _, counts = torch.unique(y, return_counts=True)
        weight = (1.0 / counts.float())[y]
        return self.fc2(h * weight[:, None])


class MaskedSelectNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        picked = torch.masked_select(h, h > h.median())
        return self.fc2(h + picked.sum())


class ExplicitNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        kiln.graph_break()
        return self.fc2(h * 3)


class CCallNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        pid = os.getpid()
        return self.fc2(h * 2 if pid > 0 else h)


class LoggingNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        log.warning("rows %d", h.shape[0])
        return self.fc2(h + 1)


class WarningNet(_Net):
    def forward(self, x, y=None):
        h = torch.tanh(self.fc1(x))
        warnings.warn(f"{h.shape[0]} rows", stacklevel=1)
        return self.fc2(h * h)


# --- places ---------------------------------------------------------------------------------


def nest(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A caller with tensor work before and after the call that breaks."""

    def caller(x, w, y=None):
        z = inner(x * 0.5, w, y)
        return z.tanh() * 3

    return caller


def forwarding(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``outer(*args, **kwargs) -> inner(*args, **kwargs)``, as decorators and wrappers do."""

    def outer(*args, **kwargs):
        return inner(*args, **kwargs)

    return outer


# --- inputs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    function: Callable[..., Any]
    module: type[nn.Module]
    reason: kiln.BreakReason
    labels: bool = False  # takes class labels y (every class present)
    branches: bool = False  # branches on the input's sign (variants 0, 0, 1, 2)


def _rows(variant: int, branches: bool) -> int:
    return (4 if variant < 2 else 6) if branches else 4 + 2 * variant


def _x(variant: int, kind: Kind, train: bool) -> torch.Tensor:
    x = torch.randn(_rows(variant, kind.branches), 8)
    if kind.branches:  # the mean's sign is the variant's: 0 and 2 positive, 1 negative
        x = x - x.mean() + (-0.5 if variant == 1 else 0.5)
    return x.requires_grad_(train)


def _labels(variant: int, kind: Kind) -> dict[str, torch.Tensor]:
    if not kind.labels:
        return {}
    rows = _rows(variant, kind.branches)
    return {"y": torch.randperm(rows) % 3}


def inputs_for(kind: Kind, place: str, train: bool) -> Callable[[int], Any]:
    def make(variant: int) -> Any:
        x = _x(variant, kind, train)
        labels = _labels(variant, kind)
        if place == "module":
            return Call((x,), labels)
        w = (torch.randn(8, 8) / 3).requires_grad_(train)
        if place == "forwarded":
            return Call((x,), {"w": w, **labels})
        return Call((x, w), labels)

    return make


def build_for(kind: Kind, place: str) -> Callable[[], Any]:
    if place == "module":
        return kind.module
    if place == "function":
        return lambda: kind.function
    if place == "nested":
        return lambda: nest(kind.function)
    return lambda: forwarding(kind.function)


KINDS = [
    Kind("print", print_fn, PrintNet, IO),
    Kind("item", item_fn, ItemNet, DATA),
    Kind("tolist", tolist_fn, TolistNet, DATA),
    Kind("if_tensor", if_tensor_fn, IfTensorNet, DATA, branches=True),
    Kind("if_sum", if_sum_fn, IfSumNet, DATA, branches=True),
    Kind("mask_index", mask_index_fn, MaskIndexNet, DATA),
    Kind("nonzero", nonzero_fn, NonzeroNet, DATA),
    Kind("unique", unique_fn, UniqueNet, DATA, labels=True),
    Kind("masked_select", masked_select_fn, MaskedSelectNet, DATA),
    Kind("graph_break", explicit_fn, ExplicitNet, EXPLICIT),
    Kind("c_function", c_call_fn, CCallNet, CALL),
    Kind("logging", logging_fn, LoggingNet, IO),
    Kind("warning", warning_fn, WarningNet, IO),
]

PLACES = ("module", "function", "nested", "forwarded")


def _expected(kind: Kind, place: str) -> dict[str, Any]:
    graphs: int | tuple[int, ...] = {"module": 2, "function": 2, "nested": 4, "forwarded": 2}[place]
    if kind.branches:  # call 3 takes the other branch: its resume function's one graph
        graphs = (graphs, 0, 1, graphs)
    breaks = (kind.reason,) * (1 if place == "function" else 2)
    # the function and its resume function; a caller (__call__, caller, outer) adds its own
    # frame and the resume function after the call
    captures = 2 if place == "function" else 4
    return {"graphs": graphs, "breaks": breaks, "captures": captures}


SCALAR_GUARD = Xfail(
    WrongCounters,
    "the resume function after .item()/.tolist() guards the Python number(s) by value "
    "(L['__stack0'] == 0.5428): every new tensor value recompiles, and past recompile_limit "
    "the frame runs uncompiled",
)

XFAILS: dict[str, Xfail] = {"item": SCALAR_GUARD, "tolist": SCALAR_GUARD}


def _program(kind: Kind, place: str, mode: str) -> Program:
    train = mode == "train"
    name = f"{kind.name}-{place}-{mode}"
    return Program(
        name,
        build_for(kind, place),
        inputs_for(kind, place, train),
        variants=(0, 0, 1, 2) if kind.branches else (0, 0, 1),
        train=train,
        context=torch.no_grad if place == "module" and not train else None,
        xfail=XFAILS.get(kind.name),
        **_expected(kind, place),
    )


class ReportedModule(nn.Module):
    """The user's report: a print of ``.item()`` in forward; a later call with another shape
    returned the first call's result."""

    def forward(self, x):
        y = x * 2
        print("sum:", f"{y.sum().item():.4f}")
        return y + 1


PROGRAMS = [
    *(
        _program(kind, place, mode)
        for kind in KINDS
        for place in PLACES
        for mode in ("infer", "train")
    ),
    Program(
        "reported-print-item-module",
        ReportedModule,
        lambda variant: (torch.randn(2 + variant),),
        variants=(0, 0, 1, 2),
        graphs=2,
        breaks=(DATA, DATA, IO),
        captures=5,
        xfail=SCALAR_GUARD,
    ),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_break(program: Program) -> None:
    check_program(program)
