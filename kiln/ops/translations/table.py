"""The translation table: torch callable -> function that expresses it in prims.

A translation has the signature of the torch callable it translates, with every tensor replaced
by a :class:`~kiln.ir.Value`; it calls prims (``kiln.ops.prims``) and returns Values in the
structure the torch callable returns. One translation usually serves several keys
(``torch.add``, ``torch.Tensor.add``, ``torch.Tensor.__radd__`` ...).

In-place keys (``torch.Tensor.add_``) are registered with ``inplace=True``: the translation
computes the new value of the first argument out of place, and the frontend rebinds that
tensor (functionalization); the result is cast back to the first argument's dtype, and a cast
PyTorch refuses (float into an integer tensor) raises like PyTorch does.

Each entry carries sample calls for the table-driven test, which compares a traced and
interpreted call with the eager call for every key and dtype.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.printer import public_name
from kiln.ops.sampling import FLOATS

Assignment = tuple[Value, Value, bool]  # (argument's value, its new value, untracked)
_assignments: contextvars.ContextVar[list[Assignment] | None] = contextvars.ContextVar(
    "kiln_translation_assignments", default=None
)


def assign_input(target: Value, new: Value, untracked: bool = False) -> None:
    """Record that the tensor argument whose value is ``target`` is updated in place to ``new``
    (for example BatchNorm's running statistics); the frontend rebinds that tensor after the
    translation returns. ``target`` must be one of the translation's own tensor arguments.
    ``untracked``: the write is one eager makes under ``no_grad`` (``F.embedding``'s
    ``max_norm`` renormalizing its weight): allowed on a leaf that requires grad, which keeps
    requiring grad."""
    pending = _assignments.get()
    if pending is None:
        raise RuntimeError("assign_input is only valid inside a translation run by a frontend")
    pending.append((target, new, untracked))


def collect_assignments() -> contextvars.Token[list[Assignment] | None]:
    """Start collecting ``assign_input`` calls (frontends call this around a translation)."""
    return _assignments.set([])


def finish_assignments(
    token: contextvars.Token[list[Assignment] | None],
) -> list[Assignment]:
    pending = _assignments.get() or []
    _assignments.reset(token)
    return pending


class FallbackToExtern(Exception):
    """Raised by a translation for an argument combination it does not express in prims; the
    frontend then records the call as an ``extern`` node instead."""


@dataclass
class Call:
    """One sample call: positional and keyword arguments, tensors fresh and random."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""


CallFn = Callable[[torch.dtype, torch.device], Sequence[Call]]


@dataclass
class Translation:
    keys: tuple[Callable[..., Any], ...]
    fn: Callable[..., Any]
    samples: CallFn | None = None
    dtypes: frozenset[torch.dtype] = FLOATS
    inplace: bool = False
    random: bool = False  # results are random: the test compares statistics, not values
    autocast: str | None = None  # the autocast policy name, for the docs and explain
    tolerance: tuple[float, float] | None = None  # (rtol, atol) when decompositions round
    # The result aliases the first argument (view, transpose, slicing...): True, or a predicate
    # over the call's arguments when only some calls alias (basic vs advanced indexing).
    view: bool | Callable[..., bool] = False

    def is_view(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return self.view(*args, **kwargs) if callable(self.view) else self.view

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


_TABLE: dict[Any, Translation] = {}
_ENTRIES: list[Translation] = []


def _key(fn: Any) -> Any:
    # Bound C methods such as TensorBase.add arrive unchanged; functions are hashable as-is.
    return fn


def translation(
    *keys: Callable[..., Any],
    samples: CallFn | None = None,
    dtypes: frozenset[torch.dtype] = FLOATS,
    inplace: bool = False,
    random: bool = False,
    tolerance: tuple[float, float] | None = None,
    view: bool | Callable[..., bool] = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the translation of every callable in ``keys``."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        entry = Translation(
            tuple(keys), fn, samples, dtypes, inplace, random, None, tolerance, view
        )
        for key in keys:
            if _key(key) in _TABLE:
                raise ValueError(
                    f"{key} has two translations: {_TABLE[_key(key)].name}, {entry.name}"
                )
            _TABLE[_key(key)] = entry
        _ENTRIES.append(entry)
        return fn

    return register


def override(key: Any, fn: Callable[..., Any] | None) -> None:
    """Make ``fn`` the translation of ``key`` (a user's lowering), replacing any built-in one;
    ``fn=None`` restores the built-in translation (or none). Not listed by ``entries()``: a
    lowering has no samples."""
    builtin = next((entry for entry in _ENTRIES if key in entry.keys), None)
    if fn is not None:
        _TABLE[_key(key)] = Translation((key,), fn, dtypes=frozenset())
    elif builtin is not None:
        _TABLE[_key(key)] = builtin
    else:
        _TABLE.pop(_key(key), None)


def lookup(fn: Any) -> Translation | None:
    """The translation of torch callable ``fn``, or ``None`` (it becomes an extern node)."""
    try:
        return _TABLE.get(_key(fn))
    except TypeError:  # unhashable callable
        return None


def entries() -> list[Translation]:
    return list(_ENTRIES)


def api_name(fn: Any) -> str:
    """A readable name for a torch callable: ``torch.add``, ``torch.Tensor.view``."""
    public = public_name(fn)
    if public is not None:
        return public
    name = getattr(fn, "__name__", None) or repr(fn)
    owner = getattr(fn, "__objclass__", None) or getattr(fn, "__self__", None)
    if owner is torch._C.TensorBase or owner is torch.Tensor:
        return f"torch.Tensor.{name}"
    qualname = getattr(fn, "__qualname__", "")
    owner_name = getattr(owner, "__name__", None)
    if name == "__get__" and owner_name:  # a property getter such as Tensor.T
        return f"torch.Tensor.{owner_name}"
    if qualname.startswith("Tensor."):
        return f"torch.{qualname}"
    module = getattr(fn, "__module__", None)
    if module in (None, "torch._C._VariableFunctions", "torch._C", "torch._VariableFunctionsClass"):
        module = "torch"
    if module == "torch._C._nn":
        module = "torch._C._nn"
    return f"{module}.{name}"
