"""In-place writes during tracing, functionalized: the written tensor (and the root of a
written view) is rebound to a new graph value, under autograd's rules for writes (eager's error
for a leaf that requires grad, an untracked write under ``no_grad``, through ``.data`` or a
``detach()`` view); a constant tensor written with traced values becomes a graph value."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.errors import OpError, TraceError
from kiln.frontends.source import user_location
from kiln.ir.builder import require_builder
from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.untracked import emit_untracked_write

if TYPE_CHECKING:
    from kiln.frontends.proxy import ProxyTensor


def write_constant(target: torch.Tensor, result: Any, api: str) -> torch.Tensor:
    if not isinstance(result, Value) or tuple(result.type.shape) != tuple(target.shape):
        raise TraceError(f"{api}: in-place update of a constant tensor", user_location())
    if result.type.dtype != target.dtype:
        if not torch.can_cast(result.type.dtype, target.dtype):
            raise OpError(
                f"{api}: result type {result.type.dtype} can't be cast to the desired output "
                f"type {target.dtype}",
                user_location(),
            )
        result = prims.convert(result, dtype=target.dtype)
    require_builder().rebind_constant(target, result)
    return target


def assign(target: ProxyTensor, result: Any, api: str) -> ProxyTensor:
    """Functionalize an in-place op: rebind ``target`` (and its root) to ``result``."""
    if not isinstance(result, Value):
        raise TypeError(f"{api}: in-place translation returned {type(result).__name__}")
    old = target.current()
    if not torch.can_cast(result.type.dtype, old.type.dtype):
        raise OpError(
            f"{api}: result type {result.type.dtype} can't be cast to the desired output type "
            f"{old.type.dtype}",
            user_location(),
        )
    if result.type.shape != old.type.shape:
        raise OpError(
            f"{api}: output with shape {list(old.type.shape)} doesn't match the broadcast shape "
            f"{list(result.type.shape)}",
            user_location(),
        )
    if result.type.dtype != old.type.dtype:
        result = prims.convert(result, dtype=old.type.dtype)
    _refuse_leaf_write(target, api)
    untracked = not torch.is_grad_enabled()  # (a write under no_grad keeps requires_grad)
    root = target._root
    if root is None or target._replay is None:
        if untracked and old.type.requires_grad:
            with torch.enable_grad():  # (the new value requires grad, as the old one did)
                result = emit_untracked_write(old, result)
        target._value = result
        target._mutations += 1
        return target
    root_value = root.current()
    positions = prims.reshape(
        prims.iota(
            length=root_value.type.numel(),
            start=0,
            step=1,
            dtype=torch.int64,
            device=root_value.type.device,
        ),
        shape=root_value.type.shape,
    )
    view_positions = target._replay(positions)
    flat = prims.reshape(root_value, shape=(root_value.type.numel(),))
    numel = result.type.numel()
    updated = prims.index_put(
        flat,
        prims.reshape(result, shape=(numel,)),
        prims.reshape(view_positions, shape=(numel,)),
        dims=(0,),
        accumulate=False,
    )
    new_root = prims.reshape(updated, shape=root_value.type.shape)
    if root_value.type.requires_grad and (untracked or not target.requires_grad):
        # A write through ``.data`` or ``detach()``, or under no_grad: autograd does not see
        # it, so the root's gradient must not go through it either.
        with torch.enable_grad():
            new_root = emit_untracked_write(root_value, new_root)
    root._value = new_root
    root._mutations += 1
    target._value = result
    target._seen_version = root._mutations
    return target


# In-place ops eager lets write a leaf that requires grad (their results are not
# differentiable); every other one refuses (measured over 23 kinds of in-place op).
_UNDIFFERENTIATED_WRITES = frozenset(
    {"logical_and_", "logical_or_", "logical_xor_", "logical_not_"}
)


def _refuse_leaf_write(target: ProxyTensor, api: str) -> None:
    """Eager's error for an in-place write, with grad mode on, to a leaf that requires grad
    (an argument or parameter) or to a view of one."""
    if not target.requires_grad or not torch.is_grad_enabled():
        return
    if api.rsplit(".", 1)[-1] in _UNDIFFERENTIATED_WRITES:
        return
    root = target._root if target._root is not None and target._replay is not None else target
    if root._leaf:
        what = "a leaf Variable" if root is target else "a view of a leaf Variable"
        raise OpError(
            f"{what} that requires grad is being used in an in-place operation.", user_location()
        )
