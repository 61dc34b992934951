"""Size queries on proxies with symbolic sizes: ``x.shape``, ``x.size(d)``, ``x.numel()``,
answered with :class:`~kiln.ir.symbolic.Sym` values (``torch.Size`` holds only ints, so a
shape is a :class:`SymbolicShape`); and layout queries (``x.stride()``, ``x.is_contiguous()``)
answered where capture knows eager's answer: for inputs."""

from __future__ import annotations

from typing import Any

import torch

from kiln.ir.symbolic import Sym
from kiln.ir.types import Shape, hint_shape


class SymbolicShape(tuple[Any, ...]):
    """``x.shape`` of a tensor with symbolic sizes (``torch.Size`` holds only ints)."""

    def numel(self) -> Any:
        count: Any = 1
        for size in self:
            count = count * size
        return count

    def __getitem__(self, index: Any) -> Any:
        item = super().__getitem__(index)
        return SymbolicShape(item) if isinstance(index, slice) else item

    def __repr__(self) -> str:
        return f"torch.Size([{', '.join(map(repr, self))}])"


def size_query(func: Any, shape: Shape, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The answer of a metadata query ``func`` (``x.shape``, ``x.size(d)``, ``numel``, ``len``,
    ``stride``) on a proxy of symbolic ``shape``, or ``NotImplemented`` for another query."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    if name == "shape" or (name == "size" and len(args) == 1 and "dim" not in kwargs):
        return SymbolicShape(shape)
    if name == "size":
        dim: int = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        return shape[dim]
    if name in ("numel", "nelement"):
        return SymbolicShape(shape).numel()
    if name == "__len__":
        return shape[0]  # (len() specializes it: Python needs an int)
    return NotImplemented


LAYOUT_QUERIES = frozenset(
    {torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.storage_offset}
)


def layout_query(
    func: Any,
    shape: Shape,
    strides: tuple[int, ...] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The answer of ``x.stride()``, ``x.stride(d)`` or ``x.is_contiguous(...)`` for a proxy
    of ``shape`` whose eager strides are ``strides`` (an input's, guarded: exactly, or, with
    symbolic sizes, its dim order), or ``NotImplemented`` where capture cannot know eager's
    answer: a value the graph computes (``strides`` None), an offset into storage (unguarded),
    or the stride of a size-1 dim of a symbolic input (its guard lets any stride pass)."""
    if strides is None or func is torch.Tensor.storage_offset:
        return NotImplemented
    hints = hint_shape(shape)
    if func is torch.Tensor.is_contiguous:
        # (a function of the guarded dim order, static sizes, and symbolic ones above 1)
        twin = torch.empty_strided(hints, strides, device="meta")
        return twin.is_contiguous(*args, **kwargs)
    which: int | None = kwargs.get("dim", args[0] if args else None)
    if not any(isinstance(size, Sym) for size in shape):
        return strides if which is None else strides[which]
    # A symbolic input is dense in the order of its strides: each is the product of the
    # sizes of the dims inside it.
    order = sorted((d for d, n in enumerate(hints) if n > 1), key=lambda d: -strides[d])
    symbolic: dict[int, Any] = {}
    running: Any = 1
    for dim in reversed(order):
        symbolic[dim] = running
        running = running * shape[dim]
    wanted = range(len(shape)) if which is None else [which % len(shape)]
    if any(dim not in symbolic for dim in wanted):
        return NotImplemented
    return tuple(symbolic[d] for d in wanted) if which is None else symbolic[wanted[0]]
