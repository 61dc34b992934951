"""Translations of F.conv1d/2d/3d and F.conv_transpose1d/2d/3d to the ``convolution`` prim.

The prim is ``torch.convolution`` on batched floating operands of one dtype, with every
geometry argument spelled out per spatial dim. The translations add what the functional API
allows on top: int-or-tuple arguments, unbatched inputs (a batch dim of 1 comes and goes), and
``padding='valid'``/``'same'``; ``'same'`` with an odd total padding pads the extra element on
the high side first, as eager does::

    F.conv1d(x, w, padding="same")     # x: f32[2, 3, 8], w: f32[4, 3, 4] (total padding 3)
    t0 = pad(x, low=(0, 0, 0), high=(0, 0, 1), value=0)
    t1 = convolution(t0, w, None, stride=(1,), padding=(1,), dilation=(1,), ...)

Integer convolutions (which eager runs on CPU, slowly) fall back to an extern.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.types import Dim
from kiln.ops import prims
from kiln.ops.translations import common
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.shape import shape_of
from kiln.ops.translations.table import FallbackToExtern, translation

IntArg = int | Sequence[int]


def expand_param(value: IntArg, count: int, name: str) -> tuple[int, ...]:
    """An int or a 1- or ``count``-sequence as a ``count``-tuple, as eager's ``expand_param``."""
    values = (value,) if isinstance(value, int) else tuple(value)
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise RuntimeError(
            f"expected {name} to be a single integer value or a list of {count} values to match "
            f"the convolution dimensions, but got {name}={list(values)}"
        )
    return values


def _check_operands(op: str, input: Value, weight: Value, bias: Value | None, spatial: int) -> None:
    for other, name in ((weight, "weight"), (bias, "bias")):
        if other is not None and other.type.dtype != input.type.dtype:
            raise RuntimeError(
                f"{op}: Input type ({input.type.dtype}) and {name} type ({other.type.dtype}) "
                "should be the same"
            )
    if input.type.rank not in (spatial + 1, spatial + 2):
        raise RuntimeError(
            f"Expected {spatial + 1}D (unbatched) or {spatial + 2}D (batched) input to {op}, but "
            f"got input of size: {list(input.type.shape)}"
        )
    if weight.type.rank != spatial + 2:
        raise RuntimeError(f"{op}: expected weight to be {spatial + 2}-D, got {weight.type.rank}-D")
    if not input.type.dtype.is_floating_point:
        raise FallbackToExtern  # the convolution prim takes floating operands


def _same_padding(
    input: Value, weight: Value, stride: tuple[int, ...], dilation: tuple[int, ...]
) -> tuple[Value, tuple[Dim, ...]]:
    """The input padded on the high side where ``'same'`` needs an odd total, and the
    symmetric padding the convolution adds."""
    if any(s != 1 for s in stride):
        raise RuntimeError("padding='same' is not supported for strided convolutions")
    spatial = len(stride)
    kernel = shape_of(weight)[-spatial:]
    totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
    low = tuple(total // 2 for total in totals)
    extra = [total - 2 * left for total, left in zip(totals, low, strict=True)]
    if any(extra):
        lead = input.type.rank - spatial
        zeros = (0,) * input.type.rank
        padded = prims.pad(input, low=zeros, high=(*(0,) * lead, *extra), value=0)
        input = padded
    return input, low


def _run(
    input: Value,
    weight: Value,
    bias: Value | None,
    geometry: dict[str, Any],
) -> Value:
    """The convolution prim on ``input``, adding and dropping a batch dim if it has none."""
    spatial = len(weight.type.shape) - 2
    unbatched = input.type.rank == spatial + 1
    if unbatched:
        input = prims.unsqueeze(input, dims=(0,))
    result = prims.convolution(input, weight, bias, **geometry)
    return prims.squeeze(result, dims=(0,)) if unbatched else result


def convolution(
    input: Value,
    weight: Value,
    bias: Value | None,
    stride: IntArg,
    padding: IntArg | str,
    dilation: IntArg,
    groups: int,
    spatial: int,
) -> Value:
    """``F.conv{spatial}d``."""
    op = f"conv{spatial}d"
    input, weight, bias = common.autocast("conv", input, weight, bias)
    _check_operands(op, input, weight, bias, spatial)
    strides = expand_param(stride, spatial, "stride")
    dilations = expand_param(dilation, spatial, "dilation")
    pads: tuple[Dim, ...]
    if padding == "valid":
        pads = (0,) * spatial
    elif padding == "same":
        input, pads = _same_padding(input, weight, strides, dilations)
    elif isinstance(padding, str):
        raise RuntimeError(f"Invalid padding string: '{padding}'")
    else:
        pads = expand_param(padding, spatial, "padding")
    geometry: dict[str, Any] = {
        "stride": strides,
        "padding": pads,
        "dilation": dilations,
        "transposed": False,
        "output_padding": (0,) * spatial,
        "groups": groups,
    }
    return _run(input, weight, bias, geometry)


def conv_transpose(
    input: Value,
    weight: Value,
    bias: Value | None,
    stride: IntArg,
    padding: IntArg,
    output_padding: IntArg,
    groups: int,
    dilation: IntArg,
    spatial: int,
) -> Value:
    """``F.conv_transpose{spatial}d``."""
    op = f"conv_transpose{spatial}d"
    input, weight, bias = common.autocast("conv_transpose", input, weight, bias)
    _check_operands(op, input, weight, bias, spatial)
    geometry: dict[str, Any] = {
        "stride": expand_param(stride, spatial, "stride"),
        "padding": expand_param(padding, spatial, "padding"),
        "dilation": expand_param(dilation, spatial, "dilation"),
        "transposed": True,
        "output_padding": expand_param(output_padding, spatial, "output_padding"),
        "groups": groups,
    }
    return _run(input, weight, bias, geometry)


# ---------------------------------------------------------------------------------------------
# the functional entry points, one per rank


def _conv_cases(spatial: int) -> list[Case]:
    """Sample cases for F.conv{spatial}d: sizes shrink with the rank to stay small."""
    size = (9, 6, 4)[spatial - 1]
    dims = (size,) * spatial
    kernel = (3,) * spatial
    return [
        ((T((2, 3, *dims)), T((4, 3, *kernel)), T((4,))), {}, ""),
        (
            (T((2, 4, *dims)), T((6, 2, *kernel))),
            {"stride": 2, "padding": 1, "groups": 2},
            "groups",
        ),
        (
            (T((1, 3, *dims)), T((2, 3, *kernel))),
            {"dilation": 2, "padding": (1,) * spatial},
            "dilated",
        ),
        ((T((3, *dims)), T((2, 3, *kernel)), T((2,))), {}, "unbatched"),
        ((T((1, 2, *dims)), T((3, 2, *(2,) * spatial))), {"padding": "same"}, "same, even kernel"),
        ((T((1, 2, *dims)), T((3, 2, *kernel))), {"padding": "valid", "bias": T((3,))}, "valid"),
        ((T((0, 3, *dims)), T((4, 3, *kernel))), {}, "0-size batch"),
    ]


def _conv_transpose_cases(spatial: int) -> list[Case]:
    size = (7, 5, 3)[spatial - 1]
    dims = (size,) * spatial
    kernel = (3,) * spatial
    return [
        ((T((2, 3, *dims)), T((3, 4, *kernel)), T((4,))), {}, ""),
        (
            (T((1, 4, *dims)), T((4, 1, *kernel))),
            {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2},
            "strided, groups",
        ),
        ((T((1, 2, *dims)), T((2, 3, *kernel))), {"dilation": 2, "bias": T((3,))}, "dilated"),
        ((T((2, *dims)), T((2, 3, *kernel))), {}, "unbatched"),
    ]


def _conv_entry(spatial: int) -> Any:
    """The translation of ``F.conv{spatial}d``, with eager's signature."""

    def conv(
        input: Value,
        weight: Value,
        bias: Value | None = None,
        stride: IntArg = 1,
        padding: IntArg | str = 0,
        dilation: IntArg = 1,
        groups: int = 1,
    ) -> Value:
        return convolution(input, weight, bias, stride, padding, dilation, groups, spatial=spatial)

    conv.__name__ = conv.__qualname__ = f"conv{spatial}d"
    return conv


def _conv_transpose_entry(spatial: int) -> Any:
    """The translation of ``F.conv_transpose{spatial}d``, with eager's signature."""

    def conv_transpose_nd(
        input: Value,
        weight: Value,
        bias: Value | None = None,
        stride: IntArg = 1,
        padding: IntArg = 0,
        output_padding: IntArg = 0,
        groups: int = 1,
        dilation: IntArg = 1,
    ) -> Value:
        geometry = (stride, padding, output_padding, groups, dilation)
        return conv_transpose(input, weight, bias, *geometry, spatial=spatial)

    conv_transpose_nd.__name__ = conv_transpose_nd.__qualname__ = f"conv_transpose{spatial}d"
    return conv_transpose_nd


# One registry row per rank, in the order conv1d..3d, then conv_transpose1d..3d.
conv1d, conv2d, conv3d = (
    translation(key, samples=case_calls(*_conv_cases(spatial)))(_conv_entry(spatial))
    for spatial, key in ((1, torch.conv1d), (2, torch.conv2d), (3, torch.conv3d))
)
conv_transpose1d, conv_transpose2d, conv_transpose3d = (
    translation(key, samples=case_calls(*_conv_transpose_cases(spatial)))(
        _conv_transpose_entry(spatial)
    )
    for spatial, key in (
        (1, torch.conv_transpose1d),
        (2, torch.conv_transpose2d),
        (3, torch.conv_transpose3d),
    )
)
