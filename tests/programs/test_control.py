"""Python control flow in real programs: loops, comprehensions, recursion, shape-dependent
branches, context managers, ``try``; breaks inside them; data-dependent ops whose result
shape changes with the values; NumPy used for preprocessing and metrics.

Kiln's documented limits (README, architecture.md): a break inside a loop body, ``try`` or
an unknown context manager runs that frame uncompiled (its callees still compile), so those
rows declare the skip. Without dynamic shapes, a tensor whose shape comes from the data
(``x[x > 0]``) may recompile the code after the break when its length changes; those rows
allow it (``dynamic=True``) but still forbid frames running uncompiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln

from .harness import (
    Program,
    WrongCounters,
    Xfail,
    check_program,
    params,
)

IO = kiln.BreakReason.IO
DATA = kiln.BreakReason.DATA_DEPENDENT
EXPLICIT = kiln.BreakReason.EXPLICIT
CALL = kiln.BreakReason.UNSUPPORTED_CALL
IN_LOOP = kiln.SkipReason.BREAK_IN_LOOP
IN_TRY = kiln.SkipReason.BREAK_IN_TRY
IN_WITH = kiln.SkipReason.BREAK_IN_WITH


# --- data-dependent shapes ------------------------------------------------------------------


def positive_part(x):
    """The user's report: boolean-mask indexing with a data-dependent count."""
    y = x * 2
    return y[y > 0] + 1, y.sum()


def nonzero_rows(x):
    idx = torch.nonzero(x[:, 0] > 0).squeeze(1)
    return x[idx].sum(0), idx


def unique_labels(x, labels):
    classes = torch.unique(labels)
    return x[:, : classes.numel()].sum(1), classes


def masked_select_mean(x):
    picked = torch.masked_select(x, x.abs() > 0.5)
    return picked.mean() * x


def topk_threshold(x):
    """Keeps values above the row's 3rd largest: data-dependent count via a comparison."""
    kth = x.topk(3, dim=1).values[:, -1:]
    kept = x[x >= kth]
    return kept.view(x.shape[0], 3) * 2


# --- loops, comprehensions, recursion -------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(8) for _ in range(depth)])

    def forward(self, x):
        for i, (layer, norm) in enumerate(zip(self.layers, self.norms, strict=True)):
            x = x + layer(norm(x)) / (i + 1)
        return x


def unrolled_while(x, steps):
    i = 0
    while i < steps:
        x = torch.tanh(x * 1.5 + i)
        i += 1
    return x


def comprehension_over_rows(x):
    parts = [row * (i + 1) for i, row in enumerate(x.unbind(0))]
    return torch.stack(parts), sum(p.sum() for p in parts)


def recursive(x, depth):
    if depth == 0:
        return x
    return recursive(torch.sin(x) + x, depth - 1) * 0.5


def shape_branch(x):
    if x.shape[0] > 4:
        return x.mean(0, keepdim=True).expand_as(x)
    return x.cumsum(0)


def dispatch_by_type(inputs):
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            out.append(item.relu())
        elif isinstance(item, (list, tuple)):
            out.append(torch.cat(item).sum())
        else:
            out.append(item * 2)
    return out


class Gate:
    """A user context manager with visible state."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self):
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1


def with_user_context(x):
    gate = Gate()
    with gate:
        y = x * gate.depth + 1
    return y, gate.depth


def loop_with_print(x):
    for i in range(2):
        x = x * 2 + i
        print("step", i)
    return x


def leaf(x):
    y = x.exp()
    print("leaf", y.shape[0])
    return y - 1


def loop_calls_breaking_callee(x):
    for _ in range(2):
        x = leaf(x) * 0.5
    return x


def try_with_break(x):
    y = x + 1
    try:
        kiln.graph_break()
        y = y * 2
    except RuntimeError:
        y = y - 1
    return y


def with_break_inside(x):
    gate = Gate()
    with gate:
        y = x.cos()
        print("inside", gate.depth)
    return y + gate.depth


def no_grad_with_break(x, w):
    """A break inside a grad-mode region re-enters it in the resume function."""
    h = x @ w
    with torch.no_grad():
        stats = h.mean(0)
        print("stats", stats.shape[0])
        scale = stats.abs() + 1
    return h / scale


def autocast_with_break(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        kiln.graph_break()
        out = F.gelu(h) @ w
    return out.float()


def numpy_roundtrip(labels):
    """Labels through NumPy and back (a preprocessing step written with NumPy)."""
    shifted = labels.numpy() + 1
    return torch.from_numpy(shifted) * 2


def collect_classes():
    """Appends each batch's classes (a data-dependent op) to a list in the closure."""
    seen: list[torch.Tensor] = []

    def program(x, labels):
        seen.append(torch.unique(labels))
        return x.softmax(-1)

    return program


def numpy_sum(labels):
    total = float(labels.numpy().sum())
    return labels * 2, total


def numpy_metric():
    """An accuracy computed in NumPy for logging, kept in the closure's history."""
    history: list[float] = []

    def program(x, labels):
        logits = x * 2
        accuracy = float((logits.argmax(1).numpy() == labels.numpy()).mean())
        history.append(round(accuracy, 3))
        return logits.softmax(-1)

    return program


# --- inputs ---------------------------------------------------------------------------------


def rows(variant: int, requires_grad: bool = False) -> tuple[torch.Tensor]:
    return (torch.randn(4 + 2 * variant, 8, requires_grad=requires_grad),)


def rows_labels(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = 6 + 2 * variant
    return torch.randn(b, 8), torch.randint(0, 6, (b,))


def every_class(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels with every one of 3 classes: unique's size follows the shapes, not the data."""
    b = 6 + 2 * variant
    return torch.randn(b, 8), torch.randperm(b) % 3


def rows_steps(variant: int) -> tuple[torch.Tensor, int]:
    return torch.randn(4, 8), 2 + variant


def mixed_items(variant: int) -> tuple[list]:
    b = 3 + variant
    return ([torch.randn(b), (torch.randn(2), torch.randn(b)), 3, torch.randn(2, b)],)


def x_w(variant: int, requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(4 + 2 * variant, 8, requires_grad=requires_grad),
        (torch.randn(8, 8) / 3).requires_grad_(requires_grad),
    )


def train_rows(variant: int) -> tuple[torch.Tensor]:
    return rows(variant, requires_grad=True)


SCALAR_SPECIALIZED = (
    "a NumPy scalar computed natively after a break (ndarray.sum()) reaches the resume "
    "function as an argument, guarded by value (L['__stack_1_1'] == np.int64(21)): every new "
    "value recompiles, and past recompile_limit the frame runs uncompiled; scalars that stay "
    "symbolic belong to dynamic shapes (issue 19)"
)

PROGRAMS = [
    Program(
        "dynamic-mask-index", lambda: positive_part, rows, graphs=2, breaks=(DATA,), dynamic=True
    ),
    Program(
        "dynamic-mask-index-train",
        lambda: positive_part,
        train_rows,
        train=True,
        graphs=2,
        breaks=(DATA,),
        dynamic=True,
    ),
    Program("dynamic-nonzero", lambda: nonzero_rows, rows, graphs=2, breaks=(DATA,), dynamic=True),
    Program(
        "dynamic-unique",
        lambda: unique_labels,
        rows_labels,
        graphs=1,  # unique of an input: nothing before the break
        breaks=(DATA,),
        dynamic=True,
    ),
    Program(
        "dynamic-masked-select",
        lambda: masked_select_mean,
        train_rows,
        train=True,
        graphs=2,
        breaks=(DATA,),
        dynamic=True,
    ),
    Program("fixed-count-mask-after-topk", lambda: topk_threshold, rows, graphs=2, breaks=(DATA,)),
    Program(
        "numpy-metric",
        numpy_metric,
        rows_labels,
        graphs=2,
        breaks=(DATA, DATA, CALL, CALL),  # .numpy() twice; NumPy's == and .mean() natively
        captures=5,
        xfail=Xfail(WrongCounters, SCALAR_SPECIALIZED),
    ),
    Program(
        "numpy-scalar-after-break",
        lambda: numpy_sum,
        lambda v: (torch.randint(0, 9, (5 + v,)),),
        graphs=1,
        breaks=(DATA, CALL),  # .numpy(), then ndarray.sum() natively
        captures=3,
        xfail=Xfail(WrongCounters, SCALAR_SPECIALIZED),
    ),
    Program(
        "numpy-roundtrip-after-break",
        lambda: numpy_roundtrip,
        lambda v: (torch.randint(0, 9, (5 + v,)),),
        graphs=1,  # the graph after torch.from_numpy, which runs natively
        breaks=(DATA, CALL, CALL),  # .numpy(); NumPy's + and from_numpy natively
        captures=4,
    ),
    Program(
        "list-append-of-break-result",
        collect_classes,
        every_class,
        graphs=1,
        breaks=(DATA,),
        captures=2,
    ),
    Program("module-list-loop", Stack, train_rows, train=True),
    Program("python-while-unrolled", lambda: unrolled_while, rows_steps),
    Program("comprehension-unbind", lambda: comprehension_over_rows, train_rows, train=True),
    Program("recursion", lambda: recursive, lambda v: (*rows(v), 3)),
    Program("shape-dependent-branch", lambda: shape_branch, rows),
    Program("isinstance-dispatch", lambda: dispatch_by_type, mixed_items),
    Program("user-context-manager", lambda: with_user_context, rows),
    Program(
        "no-grad-region-break", lambda: no_grad_with_break, x_w, train=True, graphs=2, breaks=(IO,)
    ),
    Program(
        "autocast-region-break",
        lambda: autocast_with_break,
        x_w,
        train=True,
        graphs=2,
        breaks=(EXPLICIT,),
        atol=3e-2,
        rtol=3e-2,
    ),
    Program(
        "break-in-loop-body", lambda: loop_with_print, rows, graphs=0, skips=(IN_LOOP,), captures=0
    ),
    Program(
        "loop-calls-breaking-callee",
        lambda: loop_calls_breaking_callee,
        train_rows,
        train=True,
        graphs=2,
        breaks=(IO,),
        skips=(IN_LOOP,),
    ),
    Program("break-in-try", lambda: try_with_break, rows, graphs=2, breaks=(EXPLICIT,), captures=2),
    Program(
        "break-in-user-context-manager",
        lambda: with_break_inside,
        rows,
        graphs=0,
        skips=(IN_WITH,),
        captures=0,
    ),
]


@pytest.mark.parametrize("program", params(PROGRAMS))
def test_control(program: Program) -> None:
    check_program(program)
