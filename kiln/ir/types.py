"""Tensor types of the IR: shape, dtype, device and whether the value requires grad.

A shape entry is an ``int`` or a :class:`~kiln.ir.symbolic.Sym`, a symbolic size (see
:mod:`kiln.ir.symbolic`): arithmetic on dims works on both, and a question about a symbolic dim
(``dim == 1``) is answered for every size or guarded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kiln.ir.symbolic import Dim, Sym, hint, statically

Shape = tuple[Dim, ...]

_DTYPE_ABBREVIATIONS = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_abbreviation(dtype: torch.dtype) -> str:
    return _DTYPE_ABBREVIATIONS.get(dtype, str(dtype).removeprefix("torch."))


CPU = torch.device("cpu")


@dataclass(frozen=True)
class TensorType:
    """The static type of a tensor value."""

    shape: Shape
    dtype: torch.dtype
    device: torch.device = CPU
    requires_grad: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self) -> Dim:
        """Number of elements; an int when every dim is."""
        count: Dim = 1
        for dim in self.shape:
            count = count * dim
        return count

    @property
    def is_symbolic(self) -> bool:
        return any(isinstance(dim, Sym) for dim in self.shape)

    def with_(self, **changes: object) -> TensorType:
        """A copy with some fields changed: ``t.with_(dtype=torch.float16)``."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def __str__(self) -> str:
        dims = ", ".join(map(repr, self.shape))
        grad = ", grad" if self.requires_grad else ""
        device = "" if self.device.type == "cpu" else f", {self.device}"
        return f"{dtype_abbreviation(self.dtype)}[{dims}]{device}{grad}"

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorType:
        """The type of a concrete tensor."""
        return TensorType(tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad)


FLOATING = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
INTEGRAL = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def carries_gradient(dtype: torch.dtype) -> bool:
    """Whether values of ``dtype`` can require grad: floating and complex ones (complex values
    only pass between PyTorch calls, which differentiate them)."""
    return dtype.is_floating_point or dtype.is_complex


def dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one range of its storage, each once: contiguous in
    some order of its dims (a transposed attention key, say)."""
    expected = 1
    dims = zip(tensor.size(), tensor.stride(), strict=True)
    for stride, size in sorted((stride, size) for size, stride in dims if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


Scalar = bool | int | float


def concrete(dim: Dim) -> int:
    """``dim`` as an int: a symbolic dim is specialized to its hint, guarded (the caller needs
    one size; the code it builds holds for that size only)."""
    return int(dim) if isinstance(dim, Sym) else dim


def concrete_shape(shape: Shape) -> tuple[int, ...]:
    """``shape`` with every dim concrete (see :func:`concrete`)."""
    return tuple(concrete(dim) for dim in shape)


def hint_shape(shape: Shape) -> tuple[int, ...]:
    """``shape`` at the sizes of the call being captured (no guard: for stand-ins only)."""
    return tuple(hint(dim) for dim in shape)


def same_size(a: Dim, b: Dim) -> bool:
    """Whether two sizes are equal for every binding of the symbols (no guard: False when that
    depends on the sizes). For a test that only saves work, such as skipping a no-op node."""
    return statically(a - b, "==") is True


def same_shape(a: Shape, b: Shape) -> bool:
    """Whether two shapes are equal for every binding of the symbols (no guard)."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b, strict=True))
