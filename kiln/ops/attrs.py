"""Attribute dataclasses of the prims, one per op kind.

Attributes are the static (non-tensor) arguments of an op. They are typed fields, never
positional tuples, and print as keywords: ``sum(t0, dims=(1,))``. Dims are non-negative
(translations normalize negative dims); shapes are tuples of ints or symbolic dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ir.symbolic import Dim, Sym
from kiln.ir.types import Scalar, Shape


@dataclass(frozen=True)
class ConvertAttrs:
    dtype: torch.dtype


@dataclass(frozen=True)
class ReduceAttrs:
    """SUM, PROD, AMAX, AMIN: reduce over ``dims`` (removed from the shape; no keepdim)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class ArgReduceAttrs:
    """ARGMAX, ARGMIN: int64 index of the extreme along ``dim`` (removed from the shape)."""

    dim: int


@dataclass(frozen=True)
class ReshapeAttrs:
    shape: Shape


@dataclass(frozen=True)
class PermuteAttrs:
    dims: tuple[int, ...]


@dataclass(frozen=True)
class BroadcastAttrs:
    """BROADCAST (broadcast_in_dim): input dim i becomes output dim ``dims[i]`` of ``shape``;
    its size must equal that output size or be 1. Other output dims are new."""

    shape: Shape
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ExpandAttrs:
    """EXPAND: same rank; size-1 dims grow to ``shape``."""

    shape: Shape


@dataclass(frozen=True)
class SliceAttrs:
    """SLICE: ``x[..., start:stop:step, ...]`` along ``dim``.

    Normalized: 0 <= start <= stop <= size and step >= 1.
    """

    dim: int
    start: Dim
    stop: Dim
    step: int = 1


@dataclass(frozen=True)
class SqueezeAttrs:
    """SQUEEZE removes ``dims`` (each of size 1)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class UnsqueezeAttrs:
    """UNSQUEEZE inserts size-1 dims at ``dims`` (positions in the output)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class CatAttrs:
    dim: int


@dataclass(frozen=True)
class PadAttrs:
    """PAD with a constant: ``low[i]``/``high[i]`` elements before/after dim i (negative crops),
    and ``interior[i]`` between neighbours along it (a strided slice's adjoint; () for none)."""

    low: tuple[Dim, ...]
    high: tuple[Dim, ...]
    value: Scalar = 0
    interior: tuple[int, ...] = ()


@dataclass(frozen=True)
class FlipAttrs:
    dims: tuple[int, ...]


@dataclass(frozen=True)
class GatherAttrs:
    """GATHER(x, index): ``torch.gather(x, dim, index)``."""

    dim: int


@dataclass(frozen=True)
class ScatterAttrs:
    """SCATTER / SCATTER_ADD (x, index, src): ``torch.scatter[_add](x, dim, index, src)``."""

    dim: int


@dataclass(frozen=True)
class IndexAttrs:
    """INDEX(x, *indices): advanced indexing with int64 index tensors of one shape at ``dims``
    (full slices elsewhere), placed as PyTorch places them (adjacent dims in place, else first).
    ``negative``: whether a negative index counts from the end (``x[i]``, ``take``); eager's
    ``index_select`` and ``embedding`` reject one."""

    dims: tuple[int, ...]
    negative: bool = True


@dataclass(frozen=True)
class IndexPutAttrs:
    """INDEX_PUT(x, values, *indices): ``x[indices] = values`` (``+=`` when ``accumulate``);
    ``values`` has exactly the shape ``INDEX`` would return."""

    dims: tuple[int, ...]
    accumulate: bool = False
    # index_copy's put: eager raises for an index outside [0, size), so it may run as
    # ``index_copy`` (a third of ``index_put``'s host time a call: a static cache's update)
    in_range: bool = False


@dataclass(frozen=True)
class FullAttrs:
    """FULL: ``shape`` filled with ``value`` (a symbolic size too: ``torch.full((), n)``)."""

    shape: Shape
    value: Scalar | Sym
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class IotaAttrs:
    """IOTA: ``start + step * arange(length)`` as a 1-d tensor."""

    length: Dim
    start: Scalar
    step: Scalar
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class RandomAttrs:
    """RANDOM_UNIFORM / RANDOM_NORMAL(seed): the stream is a pure function of the int64 ``seed``
    operand and ``offset``, so a backward or a replay regenerates the same numbers."""

    shape: Shape
    dtype: torch.dtype
    device: torch.device
    offset: Dim = 0


@dataclass(frozen=True)
class GemmAttrs:
    """ADDMM / BADDBMM(bias, a, b): ``beta * bias + alpha * (a @ b)``."""

    beta: Scalar = 1
    alpha: Scalar = 1


@dataclass(frozen=True)
class ConvolutionAttrs:
    """CONVOLUTION(x, weight, bias or None): ``torch.convolution`` semantics, 1d/2d/3d."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool = False
    output_padding: tuple[int, ...] = (0,)
    groups: int = 1


@dataclass(frozen=True)
class SdpaAttrs:
    """SDPA(q, k, v, mask or None): ``F.scaled_dot_product_attention`` without dropout."""

    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False


@dataclass(frozen=True)
class CumsumAttrs:
    dim: int


@dataclass(frozen=True)
class SortAttrs:
    dim: int
    descending: bool = False
    stable: bool = False


@dataclass(frozen=True)
class TopkAttrs:
    k: int
    dim: int
    largest: bool = True
    sorted: bool = True


@dataclass(frozen=True)
class Slot:
    """Where the i-th tensor operand of an EXTERN node goes in its call's arguments."""

    index: int

    def __repr__(self) -> str:
        return f"Slot({self.index})"


@dataclass(frozen=True)
class ExternAttrs:
    """EXTERN(*tensors): ``fn(*args, **kwargs)`` with each ``Slot(i)`` replaced by operand i.
    Output types come from running ``fn`` on meta tensors."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
