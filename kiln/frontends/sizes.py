"""Size queries on proxies with symbolic sizes: ``x.shape``, ``x.size(d)``, ``x.numel()``,
``x.stride()`` answered with :class:`~kiln.ir.symbolic.Sym` values (``torch.Size`` holds only
ints, so a shape is a :class:`SymbolicShape`)."""

from __future__ import annotations

from typing import Any

from kiln.ir.types import Shape


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
    if name == "stride":
        strides: list[Any] = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        which: int | None = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return tuple(strides) if which is None else strides[which]
    return NotImplemented
