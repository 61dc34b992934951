"""Translations of neural-network layers that only move data: F.embedding (an ``index`` of the
weight rows), F.pixel_shuffle/pixel_unshuffle (reshape, permute, reshape) and nearest-neighbour
F.interpolate.

Nearest interpolation is separable, and its source index along each spatial dim is found by
running eager's own kernel on an ``arange`` of that dim's length (so scale rounding matches
eager exactly). An index that repeats each element ``r`` times becomes unsqueeze, broadcast and
reshape; any other index becomes one ``index`` with a constant index tensor::

    F.interpolate(x, scale_factor=2)   # x: f32[1, 2, 3]
    t0 = unsqueeze(x, dims=(3,)); t1 = broadcast(t0, shape=(1, 2, 3, 2), dims=(0, 1, 2, 3))
    t2 = reshape(t1, shape=(1, 2, 6))

Other interpolation modes fall back to an extern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ir.types import Dim, hint_shape
from kiln.ops import prims
from kiln.ops.sampling import ALL, FLOATS
from kiln.ops.translations import common
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.linalg import reshape
from kiln.ops.translations.norms import vector_norm_of
from kiln.ops.translations.reductions import scalar_type_name
from kiln.ops.translations.shape import shape_of
from kiln.ops.translations.table import FallbackToExtern, assign_input, translation
from kiln.ops.untracked import emit_untracked_write

INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------
# embedding


def _lookup(weight: Value, indices: Value) -> Value:
    if indices.type.dtype not in INDEX_DTYPES:
        raise RuntimeError(
            "Expected tensor for argument #1 'indices' to have one of the following scalar "
            f"types: Long, Int; but got {indices.type.dtype} instead (while checking arguments "
            "for embedding)"
        )
    if weight.type.rank != 2:
        raise RuntimeError(f"embedding: 'weight' must be 2-D, got {weight.type.rank}-D")
    return prims.index(weight, common.convert(indices, torch.int64), dims=(0,), negative=False)


def _embedding_indices(count: int, shape: tuple[int, ...]) -> T:
    return T(shape, dtype=torch.int64, low=0, high=count)


@translation(
    F.embedding,
    samples=case_calls(
        ((_embedding_indices(6, (2, 3)), T((6, 4))), {}, ""),
        ((_embedding_indices(6, ()), T((6, 4))), {}, "0-d indices"),
        ((T((5,), dtype=torch.int32, low=0, high=6), T((6, 4))), {"padding_idx": 0}, "int32"),
        ((_embedding_indices(6, (0, 2)), T((6, 4))), {"padding_idx": -1}, "empty"),
    ),
    dtypes=ALL,
)
def embedding(
    input: Value,
    weight: Value,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Value:
    if scale_grad_by_freq:
        raise FallbackToExtern  # scales gradients by frequency
    rows = weight.type.shape[0]
    if padding_idx is not None and not -rows <= padding_idx < rows:
        raise AssertionError("Padding_idx must be within num_embeddings")
    if max_norm is not None:
        weight = _renormalized(weight, input, max_norm, norm_type)
    return _without_padding_gradient(_lookup(weight, input), input, padding_idx, rows)


def _renormalized(weight: Value, indices: Value, max_norm: float, norm_type: float) -> Value:
    """``max_norm``: eager first scales each looked-up row whose ``norm_type``-norm exceeds
    ``max_norm`` down to it (``max_norm / (norm + 1e-7)``), in place under ``no_grad``
    (``torch.embedding_renorm_``): the weight keeps requiring grad and its gradient flows as
    if it had always held the new rows. A row looked up twice is scaled once (the index_put
    writes the same row twice)."""
    if not weight.type.dtype.is_floating_point:
        name = scalar_type_name(weight.type.dtype)
        raise RuntimeError(
            f"norm(): input dtype should be either floating point or complex. Got {name} instead."
        )
    with torch.no_grad():
        flat = prims.reshape(indices, shape=(indices.type.numel(),))
        looked = _lookup(weight, flat)
        norms = common.broadcast_to(
            vector_norm_of(looked, norm_type, (1,), True), looked.type.shape
        )
        scale = prims.div(max_norm, prims.add(norms, 1e-7))
        scaled = prims.where(prims.gt(norms, max_norm), prims.mul(looked, scale), looked)
        rows = common.convert(flat, torch.int64)
        new = prims.index_put(weight, scaled, rows, dims=(0,), accumulate=False)
    assign_input(weight, new, untracked=True)
    if not weight.type.requires_grad:
        return new
    with torch.enable_grad():  # (the lookup's gradient goes to the weight, not the write)
        return emit_untracked_write(weight, new)


def _without_padding_gradient(
    result: Value, indices: Value, padding_idx: int | None, rows: Dim
) -> Value:
    """The looked-up rows, with no gradient flowing back into the padding row (as eager's
    embedding backward): where an index is the padding index, a detached copy is used."""
    if padding_idx is None or not result.type.requires_grad:
        return result
    hit = prims.eq(indices, padding_idx + rows if padding_idx < 0 else padding_idx)
    hit = common.broadcast_to(prims.reshape(hit, shape=(*hit.type.shape, 1)), result.type.shape)
    with torch.no_grad():
        frozen = prims.convert(result, dtype=result.type.dtype)
    return prims.where(hit, frozen, result)


@translation(
    torch.embedding,
    samples=case_calls(((T((6, 4)), _embedding_indices(6, (2, 3))), {}, "weight first")),
    dtypes=ALL,
)
def embedding_weight_first(
    weight: Value,
    indices: Value,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Value:
    if scale_grad_by_freq:
        raise FallbackToExtern
    rows = weight.type.shape[0]
    padding = padding_idx if padding_idx >= 0 else None
    return _without_padding_gradient(_lookup(weight, indices), indices, padding, rows)


# ---------------------------------------------------------------------------------------------
# pixel_shuffle, pixel_unshuffle


def _check_factor(op: str, input: Value, factor: int, what: str) -> None:
    if factor <= 0:
        raise RuntimeError(f"{op} expects a positive {what}, but got {factor}")
    if input.type.rank < 3:
        raise RuntimeError(
            f"{op} expects input to have at least 3 dimensions, but got input with "
            f"{input.type.rank} dimension(s)"
        )


@translation(
    torch.pixel_shuffle,
    samples=case_calls(
        ((T((2, 8, 3, 3)), 2), {}, ""),
        ((T((9, 2, 1)), 3), {}, "3-d"),
        ((T((2, 1, 4, 2, 2)), 2), {}, "5-d"),
    ),
    dtypes=ALL,
)
def pixel_shuffle(input: Value, upscale_factor: int) -> Value:
    _check_factor("pixel_shuffle", input, upscale_factor, "upscale_factor")
    *lead, channels, height, width = shape_of(input)
    r = upscale_factor
    if channels % (r * r):
        raise RuntimeError(
            "pixel_shuffle expects its input's 'channel' dimension to be divisible by the square "
            f"of upscale_factor, but input.size(-3)={channels} is not divisible by {r * r}"
        )
    split = reshape(input, (*lead, channels // (r * r), r, r, height, width))
    n = len(lead)
    moved = prims.permute(split, dims=(*range(n + 1), n + 3, n + 1, n + 4, n + 2))
    return reshape(moved, (*lead, channels // (r * r), height * r, width * r))


@translation(
    torch.pixel_unshuffle,
    samples=case_calls(((T((2, 2, 6, 4)), 2), {}, ""), ((T((1, 3, 3)), 3), {}, "3-d")),
    dtypes=ALL,
)
def pixel_unshuffle(input: Value, downscale_factor: int) -> Value:
    _check_factor("pixel_unshuffle", input, downscale_factor, "downscale_factor")
    *lead, channels, height, width = shape_of(input)
    r = downscale_factor
    if height % r or width % r:
        raise RuntimeError(
            f"pixel_unshuffle expects height ({height}) and width ({width}) to be divisible by "
            f"downscale_factor ({r})"
        )
    split = reshape(input, (*lead, channels, height // r, r, width // r, r))
    n = len(lead)
    moved = prims.permute(split, dims=(*range(n + 1), n + 2, n + 4, n + 1, n + 3))
    return reshape(moved, (*lead, channels * r * r, height // r, width // r))


# ---------------------------------------------------------------------------------------------
# interpolate (nearest)


def _per_dim(value: object, dim: int) -> object:
    return value[dim] if isinstance(value, Sequence) else value


def _source_index(size: int, dim: int, mode: str, arguments: dict[str, Any]) -> list[int]:
    """Eager's nearest source index along one dim, read off its kernel run on an arange."""
    probe = torch.arange(size, dtype=torch.float32).reshape(1, 1, size)
    per_dim = {name: _per_dim(value, dim) for name, value in arguments.items()}
    result = F.interpolate(probe, mode=mode, **per_dim)  # type: ignore[arg-type]
    return [int(i) for i in result.reshape(-1).tolist()]


def _repeats(index: list[int], size: Dim) -> Dim:
    """``k`` when ``index`` repeats each source position ``k`` times in order, else 0."""
    repeats = len(index) // size if size else 0
    return repeats if repeats and index == [i // repeats for i in range(len(index))] else 0


def _repeat_dim(x: Value, dim: int, repeats: Dim) -> Value:
    """Each element of ``x`` along ``dim`` ``repeats`` times in a row, as movement."""
    shape = x.type.shape
    grown = (*shape[: dim + 1], repeats, *shape[dim + 1 :])
    widened = common.broadcast_to(prims.unsqueeze(x, dims=(dim + 1,)), grown)
    return reshape(widened, (*shape[:dim], shape[dim] * repeats, *shape[dim + 1 :]))


def _integral_scale(dim: int, mode: str, arguments: dict[str, Any]) -> int:
    """The scale factor of ``dim`` when nearest mode repeats each element that many times for
    every input size (an integral factor, not recomputed from an output size), else 0."""
    factor = _per_dim(arguments["scale_factor"], dim)
    fixed = arguments["size"] is None and not arguments["recompute_scale_factor"]
    if mode != "nearest" or not fixed or not isinstance(factor, int | float):
        return 0
    return int(factor) if float(factor).is_integer() and factor >= 1 else 0


def _gather_dim(x: Value, dim: int, index: list[int]) -> Value:
    """``x`` with ``x[..., index, ...]`` along ``dim``, as movement when the index allows."""
    size = x.type.shape[dim]
    if index == list(range(size)):
        return x
    repeats = _repeats(index, size)
    if repeats:
        return _repeat_dim(x, dim, repeats)
    positions = common.constant(torch.tensor(index, dtype=torch.int64, device=x.type.device))
    return prims.index(x, positions, dims=(dim,))


@translation(
    F.interpolate,
    samples=case_calls(
        ((T((1, 2, 3)),), {"scale_factor": 2}, "1-d, repeat"),
        ((T((1, 2, 3, 4)),), {"scale_factor": (3, 2)}, "2-d, repeat"),
        ((T((1, 2, 4, 4)),), {"size": (6, 3)}, "2-d, any size"),
        ((T((1, 1, 2, 3, 2)),), {"scale_factor": 1.5, "mode": "nearest-exact"}, "3-d exact"),
        ((T((2, 1, 5, 5)),), {"scale_factor": 0.5, "recompute_scale_factor": True}, "down"),
    ),
    dtypes=FLOATS,
)
def interpolate(
    input: Value,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Value:
    if mode not in ("nearest", "nearest-exact") or antialias:
        raise FallbackToExtern  # linear modes weigh neighbours: not expressed in prims yet
    arguments: dict[str, Any] = {
        "size": size,
        "scale_factor": scale_factor,
        "align_corners": align_corners,
        "recompute_scale_factor": recompute_scale_factor,
    }
    # Eager's own argument checks, on a meta tensor (of the captured sizes: they decide none).
    meta = torch.empty(hint_shape(input.type.shape), dtype=input.type.dtype, device="meta")
    F.interpolate(meta, mode=mode, **arguments)
    result = input
    for dim in range(input.type.rank - 2):
        extent = input.type.shape[dim + 2]
        repeats = _integral_scale(dim, mode, arguments) if isinstance(extent, Sym) else 0
        if (
            repeats
            and isinstance(extent, Sym)
            and _repeats(_source_index(extent.hint, dim, mode, arguments), extent.hint)
        ):
            result = _repeat_dim(result, dim + 2, repeats)
        else:  # (a symbolic size specializes: the source index is eager's float arithmetic)
            index = _source_index(int(extent), dim, mode, arguments)
            result = _gather_dim(result, dim + 2, index)
    return result
