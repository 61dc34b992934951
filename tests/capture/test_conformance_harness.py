"""The harness itself: ``check`` must fail when compiled code differs from eager in any of the
ways it claims to compare. Each program diverges only under compilation
(``torch.compiler.is_compiling()``), so eager runs are unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import check, rand

import kiln


def wrong_value(x):
    return x + 1 if torch.compiler.is_compiling() else x + 1.5


def wrong_container(x):
    return (x * 2,) if torch.compiler.is_compiling() else [x * 2]


def wrong_dtype(x):
    return x.double() if torch.compiler.is_compiling() else x * 1


def wrong_requires_grad(x):
    return (x * 2).detach() if torch.compiler.is_compiling() else x * 2


def wrong_identity(x):
    return x * 1 if torch.compiler.is_compiling() else x


def wrong_view(x):
    return x.clone() if torch.compiler.is_compiling() else x[0]


def wrong_mutation(x, acc):
    if not torch.compiler.is_compiling():
        acc.append(1)
    return x + 1


def wrong_tensor_mutation(x):
    if not torch.compiler.is_compiling():
        x.add_(1)
    return x * 2


def raises_value_error(x):
    raise ValueError("eager")


def wrong_dict_keys(x):
    return {"a": x, "b": x} if torch.compiler.is_compiling() else {"b": x, "a": x}


def missed_graph_break(x):
    y = x * 2
    return y + 1


@pytest.mark.parametrize(
    "fn, args, expect",
    [
        (wrong_value, (rand(3),), {}),
        (wrong_container, (rand(3),), {}),
        (wrong_dtype, (rand(3),), {}),
        (wrong_requires_grad, (rand(3, requires_grad=True),), {}),
        (wrong_identity, (rand(3),), {}),
        (wrong_view, (rand(2, 3),), {}),
        (wrong_mutation, (rand(3), []), {}),
        (wrong_tensor_mutation, (rand(3),), {}),
        (wrong_dict_keys, (rand(3),), {}),
        (missed_graph_break, (rand(3),), {"graphs": 2}),
        (missed_graph_break, (rand(3),), {"breaks": [kiln.BreakReason.IO]}),
        (missed_graph_break, (rand(3),), {"skips": [kiln.SkipReason.BREAK_IN_TRY]}),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_check_detects_divergence(fn: Any, args: Any, expect: dict[str, Any]) -> None:
    with pytest.raises(AssertionError):
        check(fn, *args, **expect)


def test_check_detects_other_exception_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager raises ValueError; a "compiled" function raising TypeError must be caught."""

    def compiled(x):
        raise TypeError("compiled")

    monkeypatch.setattr(kiln, "compile", lambda fn, **options: compiled)
    with pytest.raises(AssertionError, match="TypeError"):
        check(raises_value_error, rand(3))
