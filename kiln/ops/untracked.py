"""Writes autograd does not see: ``w.data.clamp_(-0.1, 0.1)``, ``w.detach().mul_(2)``, and any
in-place write under ``torch.no_grad()``.

In eager, an in-place write through a tensor's ``.data`` or a ``detach()`` view (or under
``no_grad``, where the tensor keeps requiring grad) changes the values of a tensor that
requires grad without entering autograd's graph: later gradients flow to the tensor as if it
had always held the new values. Functionalized, the write makes a
new value of the tensor; :func:`untracked_write` gives it those values while its VJP passes
the gradient straight to the old one, never through the write::

    t5 = index_put(w, ...)                 # the clamped values
    t6, = extern(w, t5, fn=untracked_write)  # = t5; gradient to w, none to t5

After autodiff, ``passes/markers.py`` replaces the marker by the written values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops.attrs import ExternAttrs
from kiln.ops.externs import EXTERN_VJPS, Grads, extern_call


def untracked_write(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The marker's reference implementation: ``new``'s values, differentiated as ``old``."""
    return _Untracked.apply(old, new)


class _Untracked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def emit_untracked_write(old: Value, new: Value) -> Value:
    return extern_call(untracked_write, (old, new))


def _untracked_vjp(attrs: ExternAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    old = inputs[attrs.args[0].index]
    return tuple(grads[0] if operand is old else None for operand in inputs)


EXTERN_VJPS[untracked_write] = _untracked_vjp
