"""Tensor types of the IR: shape, dtype, device and whether the value requires grad.

A shape entry is an ``int`` or a :class:`SymDim`. Kiln specializes every dim for now, but code
that reads shapes goes through :data:`Dim` so symbolic dims can appear later without rewrites.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SymDim:
    """A symbolic dimension, named like ``s0``; equal names are equal sizes."""

    name: str

    def __repr__(self) -> str:
        return self.name


Dim = int | SymDim
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
        count = 1
        for dim in self.shape:
            if not isinstance(dim, int):
                return SymDim("numel(" + ",".join(map(repr, self.shape)) + ")")
            count *= dim
        return count

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


def is_integral(dtype: torch.dtype) -> bool:
    return dtype in INTEGRAL


Scalar = bool | int | float


def concrete(dim: Dim) -> int:
    """``dim`` as an int; a symbolic dim raises (the caller needs a specialized shape)."""
    if isinstance(dim, SymDim):
        raise TypeError(f"symbolic dim {dim} where a concrete size is required")
    return dim


def concrete_shape(shape: Shape) -> tuple[int, ...]:
    """``shape`` with every dim concrete (see :func:`concrete`)."""
    return tuple(concrete(dim) for dim in shape)
