"""Run a kernel of the loop-level IR with PyTorch tensor ops (the scheduler's oracle).

Every position of the kernel's loops is computed at once: ``x`` is a column ``[X, 1]`` and
``r`` a row ``[1, R]`` of int64 positions, loads gather from the buffer's storage, elementwise
ops apply their registry row's reference implementation, and a reduction reduces over ``r``.
It is slow and memory-hungry, and exact: tests use it to check lowering and fusion apart from
any code generator, and the backend uses it for a kernel a generator cannot compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.errors import IndexOutOfBounds
from kiln.ir.op import Op, op_def
from kiln.ops.attrs import ConvertAttrs
from kiln.schedule.index import FloorDiv, Index, Indirect, Mod, Var
from kiln.schedule.loops import (
    Apply,
    Const,
    Expr,
    IndexValue,
    Kernel,
    Load,
    R,
    Rand,
    Reduce,
    ReduceKind,
    X,
    walk,
)
from kiln.schedule.program import kernel_arguments


def evaluate_kernel(
    kernel: Kernel, tensors: Sequence[torch.Tensor], seed: int | torch.Tensor | None = None
) -> None:
    """Run ``kernel`` on ``tensors`` (in :func:`kernel_arguments` order), writing its stores."""
    del seed  # random numbers are the code generators' (Philox); see _value
    arguments = kernel_arguments(kernel)
    storage = {id(b): t for b, t in zip(arguments, tensors, strict=True)}
    device = tensors[0].device if tensors else torch.device("cpu")
    # (a kernel in symbolic sizes never runs here: kiln/backends/kernels.py refuses it)
    x = torch.arange(int(kernel.xnumel), device=device).reshape(-1, 1)
    r = torch.arange(int(kernel.rnumel), device=device).reshape(1, -1)
    env: dict[int, torch.Tensor] = {}
    positions = {X: x, R: r}
    for expr in walk([s.value for s in kernel.stores]):
        env[id(expr)] = _value(expr, env, positions, storage, device)
    for store in kernel.stores:
        target = storage[id(store.buffer)]
        offset = _index(store.offset, env, positions)
        value = env[id(store.value)]
        offset, value = torch.broadcast_tensors(offset, value)
        flat = _flat(target)
        flat[offset.reshape(-1)] = value.reshape(-1).to(target.dtype)
    for part in kernel.parts:  # independent of this kernel's stores (kiln/schedule/combine.py)
        evaluate_kernel(part, [storage[id(b)] for b in kernel_arguments(part)])


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage from its first element on, as a 1-d tensor (offsets are element
    offsets from the data pointer)."""
    size = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    return tensor.as_strided((size,), (1,), tensor.storage_offset())


def _index(
    index: Index, env: dict[int, torch.Tensor], positions: dict[str, torch.Tensor]
) -> torch.Tensor:
    total: Any = index.const
    for atom, coef in index.terms:
        if isinstance(atom, Var):
            term = positions[atom.name]
        elif isinstance(atom, Indirect):
            term = env[id(atom.value)]
            if atom.checked:
                check_indices(term, int(atom.size), atom.wrapped)
        elif isinstance(atom, FloorDiv):
            term = torch.div(
                _index(atom.operand, env, positions), int(atom.divisor), rounding_mode="floor"
            )
        else:
            assert isinstance(atom, Mod)
            term = torch.remainder(_index(atom.operand, env, positions), int(atom.divisor))
        total = total + term * int(coef)
    if not isinstance(total, torch.Tensor):
        total = torch.full((), total, dtype=torch.int64, device=positions[X].device)
    return total.to(torch.int64)


def _value(
    expr: Expr,
    env: dict[int, torch.Tensor],
    positions: dict[str, torch.Tensor],
    storage: dict[int, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    if isinstance(expr, Const):  # (made on the device: a copy would break a CUDA graph's capture)
        return torch.full((), expr.value, dtype=expr.dtype, device=device)
    if isinstance(expr, IndexValue):
        return _index(expr.index, env, positions).to(device)
    if isinstance(expr, Load):
        return _load(expr, env, positions, storage[id(expr.buffer)])
    if isinstance(expr, Apply):
        args = [env[id(a)] for a in expr.args]
        if expr.op is Op.CONVERT:
            return op_def(Op.CONVERT).impl(ConvertAttrs(expr.dtype), *args)
        if expr.op is Op.WHERE:
            return torch.where(args[0], args[1], args[2])
        result = op_def(expr.op).impl(None, *args)
        return result.to(expr.dtype) if result.dtype != expr.dtype else result
    if isinstance(expr, Reduce):
        rows, columns = positions[X].shape[0], positions[R].shape[1]
        return _reduce(expr.kind, env[id(expr.value)].expand(rows, columns), expr.dtype)
    if isinstance(expr, Rand):
        raise NotImplementedError("random numbers come from the code generators (Philox)")
    raise TypeError(type(expr).__name__)


def check_indices(indices: torch.Tensor, size: int, wrapped: bool) -> None:
    """Eager's IndexError for a gathered index outside ``0 <= i < size`` (when ``wrapped``,
    negatives had ``size`` added: one still below 0 was below ``-size``)."""
    bad = (indices < 0) | (indices >= size)
    if bool(bad.any()):
        index = int(indices[bad].flatten()[0])
        raise IndexOutOfBounds.of(index - size if wrapped and index < 0 else index, size)


def _load(
    expr: Load,
    env: dict[int, torch.Tensor],
    positions: dict[str, torch.Tensor],
    tensor: torch.Tensor,
) -> torch.Tensor:
    offset = _index(expr.offset, env, positions)
    flat = _flat(tensor)
    if expr.mask is None:
        return flat[offset]
    mask = env[id(expr.mask)]
    offset, mask = torch.broadcast_tensors(offset, mask)
    safe = torch.where(mask, offset, torch.zeros_like(offset))
    values = flat[safe] if flat.numel() else flat.new_zeros(safe.shape)
    return torch.where(mask, values, flat.new_full((), expr.other))


def _reduce(kind: ReduceKind, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if kind is ReduceKind.SUM:
        return value.sum(1, keepdim=True, dtype=dtype)
    if kind is ReduceKind.PROD:
        return value.prod(1, keepdim=True, dtype=dtype)
    if kind is ReduceKind.MAX:
        return value.amax(1, keepdim=True).to(dtype)
    if kind is ReduceKind.MIN:
        return value.amin(1, keepdim=True).to(dtype)
    if kind is ReduceKind.ARGMAX:
        return value.argmax(1, keepdim=True)
    return value.argmin(1, keepdim=True)
