"""Sample-call factories for translation tables: cases written as shapes, called with tensors.

A case is ``(args, kwargs, note)`` where every :class:`T` placeholder (anywhere in ``args`` or
``kwargs``, nested in lists or tuples too) becomes a fresh random tensor of the dtype under test
(or of the placeholder's own dtype)::

    samples=case_calls(((T((2, 3)), T((3, 4))), {}, ""), ((T((5,)), 2), {"dim": 0}, "int arg"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.ops.sampling import make_tensor
from kiln.ops.translations.table import Call, CallFn

# A sample case: positional arguments, keyword arguments, note.
Case = tuple[tuple[Any, ...], dict[str, Any], str]


@dataclass(frozen=True)
class T:
    """A fresh random tensor of ``shape`` in a sample case (``dtype`` None: the sampled one)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    low: float | None = None
    high: float | None = None

    def make(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        chosen = self.dtype or dtype
        return make_tensor(self.shape, chosen, device, low=self.low, high=self.high)


def materialize(tree: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``tree`` with every :class:`T` replaced by a fresh tensor."""
    return pytree.tree_map(
        lambda leaf: leaf.make(dtype, device) if isinstance(leaf, T) else leaf, tree
    )


def case_calls(*cases: Case) -> CallFn:
    """A ``samples=`` function: one :class:`Call` per case, with fresh tensors each time."""

    def samples(dtype: torch.dtype, device: torch.device) -> Sequence[Call]:
        calls = []
        for args, kwargs, note in cases:
            filled_args, filled_kwargs = materialize((args, kwargs), dtype, device)
            calls.append(Call(tuple(filled_args), dict(filled_kwargs), note))
        return calls

    return samples
