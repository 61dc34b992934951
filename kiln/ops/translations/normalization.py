"""Normalizations in prims: ``softmax``/``log_softmax``/``softmin``, ``layer_norm``,
``group_norm``, ``batch_norm`` (with the in-place update of its running statistics),
``rms_norm`` and ``F.normalize``.

Each is a decomposition into reductions and elementwise prims. float16/bfloat16 inputs compute in
float32 and round once, as eager's kernels do. Softmax subtracts the max first, so large inputs
do not overflow::

    torch.softmax(x, 1)   # x: f32[3, 4]
    t0 = amax(x, dims=(1,))
    t1 = unsqueeze(t0, dims=(1,))
    t2 = broadcast(t1, shape=(3, 4), dims=(0, 1))
    t3 = sub(x, t2)
    t4 = exp(t3)
    ...
    t8 = div(t4, t7)

``batch_norm`` in training mode reports its new running mean and variance through
``assign_input``; the frontend rebinds the module's buffers (``graph.mutations``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ir.types import Dim
from kiln.ops import prims
from kiln.ops.batch_norm_backward import emit_batch_norm_output
from kiln.ops.translations import common
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.norms import vector_norm_of
from kiln.ops.translations.reductions import (
    compute_dtype,
    moments,
    reduce,
    reduced_count,
    require_float,
    scalar_type_name,
)
from kiln.ops.translations.table import FallbackToExtern, assign_input, translation

# ---------------------------------------------------------------------------------------------
# softmax, log_softmax, softmin


def _legacy_softmax_dim(name: str, rank: int) -> int:
    warnings.warn(
        f"Implicit dimension choice for {name} has been deprecated. "
        "Change the call to include dim=X as an argument.",
        stacklevel=4,
    )
    return 0 if rank in (0, 1, 3) else 1


def softmax_of(x: Value, dim: int, dtype: torch.dtype | None, log: bool, op: str) -> Value:
    """``softmax`` (or ``log_softmax``) of ``x`` along ``dim``, in ``dtype`` if given."""
    if dtype is None:
        (x,) = common.autocast(op, x)
    x = common.convert(x, dtype) if dtype is not None else x
    if not x.type.dtype.is_floating_point:
        raise NotImplementedError(
            f"\"{op}\" not implemented for '{scalar_type_name(x.type.dtype)}'"
        )
    axis = common.normalize_dim(dim, x.type.rank, op)
    if x.type.numel() == 0:
        return x
    wide = common.convert(x, compute_dtype(x.type.dtype))
    dims = (axis,) if x.type.rank else ()
    with torch.no_grad():  # (the result does not depend on the shift: no gradient through it)
        high = common.broadcast_to(reduce(prims.amax, wide, dims, True), wide.type.shape)
    shifted = prims.sub(wide, high)
    exps = prims.exp(shifted)
    total = common.broadcast_to(reduce(prims.sum, exps, dims, True), wide.type.shape)
    result = prims.sub(shifted, prims.log(total)) if log else prims.div(exps, total)
    return common.convert(result, x.type.dtype)


def _softmax_calls(functional: bool) -> Any:
    cases: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        ((T((3, 4)), 1), {}, ""),
        ((T((2, 3, 4)), -1), {}, ""),
        ((T((2, 3, 4)), 0), {}, ""),
        ((T((4, 1)), 1), {}, "size-1 dim"),
        ((T((0, 4)), 0), {}, "empty"),
        ((T(()), 0), {}, "0-d"),
        ((T((3, 4), high=90.0), 1), {}, "large values"),
        ((T((3, 4)), 1), {"dtype": torch.float32}, "dtype"),
    ]
    if functional:
        cases.append(((T((3, 4)),), {}, "implicit dim"))
    return case_calls(*cases)


@translation(F.softmax, samples=_softmax_calls(True))
def softmax_functional(
    input: Value, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> Value:
    if dim is None:
        dim = _legacy_softmax_dim("softmax", input.type.rank)
    return softmax_of(input, dim, dtype, False, "softmax")


@translation(
    torch.softmax, torch.Tensor.softmax, torch.special.softmax, samples=_softmax_calls(False)
)
def softmax(input: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    return softmax_of(input, dim, dtype, False, "softmax")


@translation(F.log_softmax, samples=_softmax_calls(True))
def log_softmax_functional(
    input: Value, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> Value:
    if dim is None:
        dim = _legacy_softmax_dim("log_softmax", input.type.rank)
    return softmax_of(input, dim, dtype, True, "log_softmax")


@translation(
    torch.log_softmax,
    torch.Tensor.log_softmax,
    torch.special.log_softmax,
    samples=_softmax_calls(False),
)
def log_softmax(input: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    return softmax_of(input, dim, dtype, True, "log_softmax")


@translation(F.softmin, samples=_softmax_calls(True))
def softmin(
    input: Value, dim: int | None = None, _stacklevel: int = 3, dtype: torch.dtype | None = None
) -> Value:
    if dim is None:
        dim = _legacy_softmax_dim("softmin", input.type.rank)
    (input,) = common.autocast("softmin", input)
    return softmax_of(prims.neg(input), dim, dtype, False, "softmax")


# ---------------------------------------------------------------------------------------------
# layer_norm, group_norm, rms_norm


def _affine(x: Value, weight: Value | None, bias: Value | None, dims: Sequence[int]) -> Value:
    """``x * weight + bias`` in ``x``'s dtype, the parameters' dims placed at ``dims`` of x."""
    shape = x.type.shape
    if weight is not None:
        w = common.convert(weight, x.type.dtype)
        x = prims.mul(x, prims.broadcast(w, shape=shape, dims=tuple(dims)))
    if bias is not None:
        b = common.convert(bias, x.type.dtype)
        x = prims.add(x, prims.broadcast(b, shape=shape, dims=tuple(dims)))
    return x


def _standardize(x: Value, dims: tuple[int, ...], eps: float) -> Value:
    """``(x - mean) / sqrt(var + eps)`` over ``dims`` with the biased variance."""
    mean, squares = moments(x, dims)
    variance = prims.div(squares, common.size_scalar(reduced_count(x, dims)))
    inverse = prims.rsqrt(prims.add(variance, eps))
    centered = prims.sub(x, common.broadcast_to(mean, x.type.shape))
    return prims.mul(centered, common.broadcast_to(inverse, x.type.shape))


def _trailing_dims(op: str, x: Value, normalized_shape: Sequence[int] | int) -> tuple[int, ...]:
    shape = (
        (normalized_shape,) if isinstance(normalized_shape, int | Sym) else tuple(normalized_shape)
    )
    rank = x.type.rank
    if len(shape) > rank or tuple(x.type.shape[rank - len(shape) :]) != shape:
        raise RuntimeError(
            f"{op}: Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size{list(x.type.shape)}"
        )
    return tuple(range(rank - len(shape), rank))


@translation(
    F.layer_norm,
    torch.layer_norm,
    samples=case_calls(
        ((T((3, 4)), (4,)), {}, ""),
        ((T((2, 3, 4)), [3, 4], T((3, 4)), T((3, 4))), {}, "weight, bias"),
        ((T((2, 5)), (5,)), {"weight": T((5,)), "eps": 1e-3}, "weight only"),
        ((T((2, 5)), (5,)), {"bias": T((5,))}, "bias only"),
        ((T((0, 4)), (4,), T((4,)), T((4,))), {}, "empty"),
        ((T((3, 1)), (1,)), {}, "one element per row"),
    ),
)
def layer_norm(
    input: Value,
    normalized_shape: Sequence[int],
    weight: Value | None = None,
    bias: Value | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,
) -> Value:
    x, weight, bias = common.autocast("layer_norm", input, weight, bias)
    require_float(x, "layer_norm")
    dims = _trailing_dims("layer_norm", x, normalized_shape)
    wide = _standardize(common.convert(x, compute_dtype(x.type.dtype)), dims, eps)
    return common.convert(_affine(wide, weight, bias, dims), x.type.dtype)


@translation(
    F.rms_norm,
    torch.rms_norm,
    samples=case_calls(
        ((T((3, 4)), (4,)), {}, ""),
        ((T((2, 3, 4)), [3, 4], T((3, 4))), {}, "weight"),
        ((T((2, 5)), (5,)), {"weight": T((5,)), "eps": 1e-3}, "eps"),
        ((T((2, 3), low=-1e-3, high=1e-3), (3,)), {}, "tiny values: the default eps matters"),
        ((T((0, 4)), (4,)), {}, "empty"),
    ),
)
def rms_norm(
    input: Value,
    normalized_shape: Sequence[int],
    weight: Value | None = None,
    eps: float | None = None,
) -> Value:
    require_float(input, "rms_norm")
    dims = _trailing_dims("rms_norm", input, normalized_shape)
    wide = common.convert(input, compute_dtype(input.type.dtype))
    if eps is None:  # eager uses the epsilon of the type it computes in (float32 for bf16)
        eps = torch.finfo(wide.type.dtype).eps
    squares = reduce(prims.sum, prims.mul(wide, wide), dims, True)
    mean_square = prims.div(squares, common.size_scalar(reduced_count(wide, dims)))
    inverse = prims.rsqrt(prims.add(mean_square, eps))
    result = prims.mul(wide, common.broadcast_to(inverse, wide.type.shape))
    return common.convert(_affine(result, weight, None, dims), input.type.dtype)


@translation(
    F.group_norm,
    samples=case_calls(
        ((T((2, 4, 3)), 2), {}, ""),
        ((T((2, 6, 2, 3)), 3), {"weight": T((6,)), "bias": T((6,))}, "affine"),
        ((T((3, 4)), 1), {"weight": T((4,)), "eps": 1e-3}, "one group"),
        ((T((1, 4, 5)), 4), {"bias": T((4,))}, "a group per channel"),
    ),
)
def group_norm(
    input: Value,
    num_groups: int,
    weight: Value | None = None,
    bias: Value | None = None,
    eps: float = 1e-5,
) -> Value:
    x, weight, bias = common.autocast("group_norm", input, weight, bias)
    require_float(x, "group_norm")
    shape = x.type.shape
    if x.type.rank < 2:
        raise RuntimeError(
            f"Expected at least 2 dimensions for input tensor but received {x.type.rank}"
        )
    batch, channels = shape[0], shape[1]
    if channels % num_groups:
        raise RuntimeError(
            f"Expected number of channels in input to be divisible by num_groups, but got "
            f"input of shape {list(shape)} and num_groups={num_groups}"
        )
    rest = list(shape[2:])
    _verify_batch_size([batch * channels // num_groups, num_groups, *rest])
    wide = common.convert(x, compute_dtype(x.type.dtype))
    group_size = channels // num_groups * math.prod(rest)
    grouped = prims.reshape(wide, shape=(batch, num_groups, group_size))
    normalized = prims.reshape(_standardize(grouped, (2,), eps), shape=shape)
    return common.convert(_affine(normalized, weight, bias, (1,)), x.type.dtype)


# ---------------------------------------------------------------------------------------------
# batch_norm


def _verify_batch_size(sizes: Sequence[Dim]) -> None:
    """Eager's check (``F._verify_batch_size``) that training sees more than one value per
    channel: the batch size times the spatial sizes."""
    if math.prod([*sizes[:1], *sizes[2:]]) == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {list(sizes)}"
        )


def _update_running(running: Value, statistic: Value, momentum: float) -> None:
    """``running <- (1 - momentum) * running + momentum * statistic``, in place."""
    stat = common.convert(statistic, compute_dtype(running.type.dtype))
    old = common.convert(running, stat.type.dtype)
    new = prims.add(prims.mul(stat, momentum), prims.mul(old, 1.0 - momentum))
    assign_input(running, common.convert(new, running.type.dtype))


def _statistics_dtype(
    input: Value, running_mean: Value | None, weight: Value | None
) -> torch.dtype:
    """The dtype eager keeps batch statistics in: the parameters' (float32 in mixed precision),
    else the input's."""
    for parameter in (running_mean, weight):
        if parameter is not None:
            return parameter.type.dtype
    return input.type.dtype


def _batch_normalizers(
    wide: Value,
    running_mean: Value | None,
    running_var: Value | None,
    momentum: float,
    eps: float,
    statistics_dtype: torch.dtype,
) -> tuple[Value, Value]:
    """(mean, 1 / sqrt(biased variance + eps)) per channel, rounded to ``statistics_dtype`` as
    eager's saved statistics are; updates the running statistics with the mean and the unbiased
    variance."""
    dims = tuple(d for d in range(wide.type.rank) if d != 1)
    mean, squares = moments(wide, dims)
    count = reduced_count(wide, dims)
    channels = (wide.type.shape[1],)
    mean, squares = (prims.reshape(v, shape=channels) for v in (mean, squares))

    def rounded(value: Value) -> Value:
        return common.convert(common.convert(value, statistics_dtype), wide.type.dtype)

    if statistics_dtype == torch.bfloat16:  # eager's CPU kernel keeps this sum in bf16 too
        squares = rounded(squares)
    if running_mean is not None:
        _update_running(running_mean, mean, momentum)
    if running_var is not None:
        _update_running(running_var, prims.div(squares, common.size_scalar(count - 1)), momentum)
    inverse = prims.rsqrt(prims.add(prims.div(squares, common.size_scalar(count)), eps))
    return rounded(mean), rounded(inverse)


def _scale(inverse: Value, weight: Value | None) -> Value:
    """Per channel ``inverse * weight``: what multiplies a centred (or raw) input."""
    if weight is None:
        return inverse
    return prims.mul(inverse, common.convert(weight, inverse.type.dtype))


def _scale_shift(
    mean: Value, inverse: Value, weight: Value | None, bias: Value | None
) -> tuple[Value, Value]:
    """Per channel ``scale = inverse * weight`` and ``shift = bias - mean * scale``, so that
    ``x * scale + shift`` normalizes; eager's kernels apply batch norm in this form."""
    scale = _scale(inverse, weight)
    shift = prims.neg(prims.mul(mean, scale))
    if bias is not None:
        shift = prims.add(shift, common.convert(bias, inverse.type.dtype))
    return scale, shift


@translation(
    F.batch_norm,
    samples=case_calls(
        ((T((4, 3)), T((3,)), T((3,), low=0.5, high=2.0)), {}, "eval"),
        ((T((4, 3, 5)), T((3,)), T((3,), low=0.5, high=2.0), T((3,)), T((3,))), {}, "eval, affine"),
        ((T((4, 3)), T((3,)), T((3,), low=0.5, high=2.0)), {"training": True}, "train"),
        (
            (T((2, 3, 2, 2)), T((3,)), T((3,), low=0.5, high=2.0)),
            {"weight": T((3,)), "bias": T((3,)), "training": True, "momentum": 0.3, "eps": 1e-3},
            "train, affine",
        ),
        ((T((4, 3)), None, None), {"training": True}, "no running statistics"),
    ),
)
def batch_norm(
    input: Value,
    running_mean: Value | None,
    running_var: Value | None,
    weight: Value | None = None,
    bias: Value | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Value:
    require_float(input, "batch_norm")
    if training:
        _verify_batch_size(list(input.type.shape))
    if not isinstance(momentum, int | float):
        raise TypeError(
            f"batch_norm(): argument 'momentum' must be float, not {type(momentum).__name__}"
        )
    if input.type.rank < 2:
        if input.type.rank == 1 and input.type.shape[0] == 0:
            return prims.convert(input, dtype=input.type.dtype)  # (eager: nothing to normalize)
        raise ValueError(f"batch_norm: expected 2D or more input (got {input.type.rank}D input)")
    wide = common.convert(input, compute_dtype(input.type.dtype))
    shape = wide.type.shape
    if batch_statistics := training or running_mean is None or running_var is None:
        mean, inverse = _batch_normalizers(
            wide,
            running_mean if training else None,
            running_var if training else None,
            momentum,
            eps,
            _statistics_dtype(input, running_mean, weight),
        )
    else:
        assert running_mean is not None and running_var is not None
        mean = common.convert(running_mean, wide.type.dtype)
        inverse = prims.rsqrt(prims.add(common.convert(running_var, wide.type.dtype), eps))
    differentiated = torch.is_grad_enabled() and any(
        v is not None and v.type.requires_grad for v in (input, weight, bias)
    )
    if differentiated and not batch_statistics:
        # frozen statistics, centred: the weight's gradient sums g * (x - mean), as eager's
        return common.convert(_centred(wide, mean, inverse, weight, bias), input.type.dtype)
    scale, shift = _scale_shift(mean, inverse, weight, bias)
    scaled = prims.mul(wide, prims.broadcast(scale, shape=shape, dims=(1,)))
    shifted = prims.add(scaled, prims.broadcast(shift, shape=shape, dims=(1,)))
    if differentiated:  # (batch statistics: eager's closed-form backward, centred)
        shifted = emit_batch_norm_output(shifted, wide, mean, inverse, weight, bias)
    return common.convert(shifted, input.type.dtype)


def _centred(
    wide: Value, mean: Value, inverse: Value, weight: Value | None, bias: Value | None
) -> Value:
    """``(x - mean) * (inverse * weight) + bias``. Differentiated, ``x * scale + shift``
    sums ``g * x - mean * g`` for the weight: when the mean is large against the spread that
    difference cancels (a frozen BatchNorm at mean/spread 1000: the weight's gradient 2500x
    farther from float64 than eager's). Batch statistics keep the other form for now: there
    the gap is 8-9x, 3.2x centred, but centred ResNet-50's reduce-overhead training step took
    11.29 ms against 11.06 on an H200: every BatchNorm kernel loads the mean besides the scale
    and bias, forward and backward (13% more element loads in the step's kernels)."""
    shape = wide.type.shape
    scale = _scale(inverse, weight)
    centred = prims.sub(wide, prims.broadcast(mean, shape=shape, dims=(1,)))
    result = prims.mul(centred, prims.broadcast(scale, shape=shape, dims=(1,)))
    if bias is not None:
        result = prims.add(
            result,
            prims.broadcast(common.convert(bias, inverse.type.dtype), shape=shape, dims=(1,)),
        )
    return result


@translation(
    F.instance_norm,
    samples=case_calls(
        ((T((2, 3, 5)),), {}, "no running statistics"),
        ((T((2, 3, 4, 4)), T((3,)), T((3,), low=0.5, high=2.0)), {}, "running statistics"),
        (
            (T((2, 3, 5)), T((3,)), T((3,), low=0.5, high=2.0), T((3,)), T((3,))),
            {"momentum": 0.3, "eps": 1e-3},
            "affine",
        ),
        (
            (T((2, 3, 5)), T((3,)), T((3,), low=0.5, high=2.0)),
            {"use_input_stats": False},
            "running statistics only",
        ),
    ),
)
def instance_norm(
    input: Value,
    running_mean: Value | None = None,
    running_var: Value | None = None,
    weight: Value | None = None,
    bias: Value | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Value:
    """Each (sample, channel) standardized over its spatial dims. Eager runs batch norm on the
    input seen as one sample of ``N * C`` channels with the running statistics repeated, then
    averages them back: the running mean moves toward the mean of the instances' means (and
    the variance toward their unbiased variances')."""
    require_float(input, "instance_norm")
    shape = input.type.shape
    if input.type.rank < 3:
        raise ValueError(f"instance_norm: expected 3D or more input (got {input.type.rank}D)")
    if not use_input_stats:
        if running_mean is None or running_var is None:
            raise RuntimeError(
                "Expected running_mean and running_var to be defined when use_input_stats is false"
            )
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    batch, channels = shape[0], shape[1]
    if math.prod(shape[2:]) <= 1:
        raise ValueError(
            f"Expected more than 1 spatial element when training, got input size {list(shape)}"
        )
    wide = common.convert(input, compute_dtype(input.type.dtype))
    dims = tuple(range(2, wide.type.rank))
    mean, squares = moments(wide, dims)
    count = reduced_count(wide, dims)
    inverse = prims.rsqrt(prims.add(prims.div(squares, common.size_scalar(count)), eps))
    centered = prims.sub(wide, common.broadcast_to(mean, wide.type.shape))
    normalized = prims.mul(centered, common.broadcast_to(inverse, wide.type.shape))

    def across_batch(value: Value) -> Value:
        per_instance = prims.reshape(value, shape=(batch, channels))
        return prims.div(prims.sum(per_instance, dims=(0,)), common.size_scalar(batch))

    if running_mean is not None:
        _update_running(running_mean, across_batch(mean), momentum)
    if running_var is not None:
        unbiased = prims.div(squares, common.size_scalar(count - 1))
        _update_running(running_var, across_batch(unbiased), momentum)
    return common.convert(_affine(normalized, weight, bias, (1,)), input.type.dtype)


# ---------------------------------------------------------------------------------------------
# F.normalize


@translation(
    F.normalize,
    samples=case_calls(
        ((T((3, 4)),), {}, ""),
        ((T((2, 3, 4)),), {"dim": -1}, ""),
        ((T((3, 4)), 1.0), {"dim": 0}, "p=1"),
        ((T((3, 4)), float("inf")), {}, "p=inf"),
        ((T((3, 4)), 3), {"dim": 1, "eps": 0.5}, "p=3, large eps"),
        ((T((4,)),), {"dim": 0}, "vector"),
        ((T((0, 3)),), {}, "empty"),
    ),
)
def normalize(
    input: Value, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Any = None
) -> Value:
    """``input / max(norm(input, p, dim), eps)``, the norm rounded to the input's dtype first as
    in eager (``input.norm(...).clamp_min(eps)``)."""
    if out is not None:
        raise FallbackToExtern  # writes into ``out``
    (x,) = common.autocast("normalize", input)
    require_float(x, "normalize")
    axis = common.normalize_dim(dim, x.type.rank, "normalize")
    dims = (axis,) if x.type.rank else ()
    norm = prims.maximum(vector_norm_of(x, p, dims, True), eps)
    return prims.div(x, common.broadcast_to(norm, x.type.shape))
