"""Loss functions in prims: ``cross_entropy``, ``nll_loss``, ``mse_loss``, ``l1_loss``,
``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy`` and its ``_with_logits`` form.

Each follows eager PyTorch's definition (``aten/src/ATen/native/Loss*.cpp``), including the
legacy ``size_average``/``reduce`` arguments, ``ignore_index`` (ignored targets weigh 0 and do
not count in the mean), class weights and label smoothing. Elementwise losses compute in
float32 for float16/bfloat16 and round once. ``nll_loss`` picks each target's log-probability
with ``gather``::

    F.nll_loss(logp, target)   # logp: f32[3, 5], target: i64[3]
    t0 = ne(target, -100)
    t1 = where(t0, target, 0)
    t2 = unsqueeze(t1, dims=(1,))
    t3 = gather(logp, t2, dim=1)
    ...
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ir.types import concrete_shape
from kiln.ops import prims
from kiln.ops.translations import common
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.normalization import softmax_of
from kiln.ops.translations.reductions import (
    compute_dtype,
    numel,
    reduce,
    scalar_type_name,
    sum_of,
)
from kiln.ops.translations.table import translation

REDUCTIONS = ("none", "mean", "sum")


def _reduction(size_average: bool | None, reduce_: bool | None, reduction: str) -> str:
    if size_average is not None or reduce_ is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce_)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return reduction


def _everything(x: Value) -> tuple[int, ...]:
    return tuple(range(x.type.rank))


def reduce_loss(loss: Value, reduction: str) -> Value:
    """``loss`` as is, summed or averaged over every element (``mean`` of nothing is nan)."""
    if reduction == "none":
        return loss
    total = sum_of(loss, _everything(loss))
    if reduction == "sum":
        return total
    return common.convert(
        prims.div(
            common.convert(total, compute_dtype(loss.type.dtype)), common.size_scalar(numel(loss))
        ),
        loss.type.dtype,
    )


def _size(value: Value) -> torch.Size:
    return torch.Size(concrete_shape(value.type.shape))


def _promoted(*operands: Value) -> tuple[list[Value], torch.dtype]:
    """The operands promoted and broadcast as eager elementwise ops do, and their dtype."""
    converted, dtype = common.elementwise(*operands)
    return cast(list[Value], converted), dtype


def _pair(op: str, input: Value, target: Value) -> tuple[Value, Value, torch.dtype]:
    """Both operands promoted, broadcast and widened to the compute dtype, and the result dtype;
    warns like eager when their sizes differ."""
    if input.type.shape != target.type.shape:
        warnings.warn(
            f"Using a target size ({_size(target)}) that is different to the "
            f"input size ({_size(input)}). This will likely lead to incorrect "
            "results due to broadcasting. Please ensure they have the same size.",
            stacklevel=4,
        )
    (x, y), dtype = _promoted(input, target)
    wide = compute_dtype(dtype)
    return common.convert(x, wide), common.convert(y, wide), dtype


def _weighted(loss: Value, weight: Value | None, reduction: str, mean_by_weight: bool) -> Value:
    """Eager's manual weighting: ``sum(loss * w) / sum(w)`` for a weighted mean when
    ``mean_by_weight`` (mse, l1), else the plain mean of the weighted losses (huber)."""
    if weight is None:
        return reduce_loss(loss, reduction)
    if weight.type.shape != loss.type.shape:
        raise ValueError("Weights and input must have the same size.")
    w = common.convert(weight, loss.type.dtype)
    weighted = prims.mul(loss, w)
    if reduction != "mean" or not mean_by_weight:
        return reduce_loss(weighted, reduction)
    everything = _everything(loss)
    return prims.div(reduce(prims.sum, weighted, everything), reduce(prims.sum, w, everything))


# ---------------------------------------------------------------------------------------------
# regression losses


REGRESSION_CASES: tuple[Case, ...] = (
    ((T((3, 4)), T((3, 4))), {}, ""),
    ((T((3, 4)), T((3, 4))), {"reduction": "sum"}, ""),
    ((T((2, 3, 4)), T((2, 3, 4))), {"reduction": "none"}, ""),
    ((T((3, 4)), T((4,))), {}, "broadcast target"),
    ((T((0, 4)), T((0, 4))), {"reduction": "sum"}, "empty"),
)
LEGACY: tuple[Case, ...] = (((T((3, 4)), T((3, 4))), {"size_average": False}, "legacy arguments"),)


WEIGHTED: tuple[Case, ...] = (
    ((T((3, 4)), T((3, 4))), {"weight": T((3, 4), low=0.1, high=2.0)}, "weight"),
    ((T((3, 4)), T((3, 4))), {"weight": T((3, 4)), "reduction": "none"}, "weight, none"),
)


def _regression_loss(name: str, loss_of: Callable[[Value], Value]) -> Callable[..., Value]:
    """The translation of ``F.{name}``: ``loss_of(input - target)``, weighted and reduced."""

    def loss(
        input: Value,
        target: Value,
        size_average: bool | None = None,
        reduce: bool | None = None,
        reduction: str = "mean",
        weight: Value | None = None,
    ) -> Value:
        input, target, weight = common.autocast(name, input, target, weight)
        x, y, dtype = _pair(name, input, target)
        pointwise = loss_of(prims.sub(x, y))
        result = _weighted(pointwise, weight, _reduction(size_average, reduce, reduction), True)
        return common.convert(result, dtype)

    loss.__name__ = loss.__qualname__ = name
    return loss


mse_loss = translation(F.mse_loss, samples=case_calls(*REGRESSION_CASES, *LEGACY, *WEIGHTED))(
    _regression_loss("mse_loss", lambda difference: prims.mul(difference, difference))
)
# F.l1_loss drops ``weight`` when it hands the call to __torch_function__ (torch 2.13), so a
# weight never reaches this translation while tracing: no weighted samples.
l1_loss = translation(F.l1_loss, samples=case_calls(*REGRESSION_CASES, *LEGACY))(
    _regression_loss("l1_loss", lambda difference: prims.abs(difference))
)


def _quadratic_below(
    distance: Value, threshold: float, scale_quadratic: float, linear_scale: float
) -> Value:
    """``0.5 * d * d * scale_quadratic`` where ``d < threshold``, else
    ``linear_scale * (d - 0.5 * threshold)``: the shared shape of smooth L1 and Huber."""
    quadratic = prims.mul(prims.mul(distance, distance), 0.5 * scale_quadratic)
    linear = prims.mul(prims.sub(distance, 0.5 * threshold), linear_scale)
    return prims.where(prims.lt(distance, threshold), quadratic, linear)


@translation(
    F.smooth_l1_loss,
    samples=case_calls(
        *REGRESSION_CASES,
        *LEGACY,
        ((T((3, 4)), T((3, 4))), {"beta": 0.5}, "beta"),
        ((T((3, 4)), T((3, 4))), {"beta": 0.0, "reduction": "none"}, "beta 0: l1"),
    ),
)
def smooth_l1_loss(
    input: Value,
    target: Value,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    beta: float = 1.0,
) -> Value:
    input, target = common.autocast("smooth_l1_loss", input, target)
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    x, y, dtype = _pair("smooth_l1_loss", input, target)
    distance = prims.abs(prims.sub(x, y))
    loss = distance if beta == 0 else _quadratic_below(distance, beta, 1.0 / beta, 1.0)
    return common.convert(reduce_loss(loss, _reduction(size_average, reduce, reduction)), dtype)


@translation(
    F.huber_loss,
    samples=case_calls(
        *REGRESSION_CASES,
        ((T((3, 4)), T((3, 4))), {"delta": 0.5}, "delta"),
        ((T((3, 4)), T((3, 4))), {"weight": T((3, 4), low=0.1, high=2.0)}, "weight"),
    ),
)
def huber_loss(
    input: Value,
    target: Value,
    reduction: str = "mean",
    delta: float = 1.0,
    weight: Value | None = None,
) -> Value:
    input, target, weight = common.autocast("huber_loss", input, target, weight)
    x, y, dtype = _pair("huber_loss", input, target)
    loss = _quadratic_below(prims.abs(prims.sub(x, y)), delta, 1.0, delta)
    result = _weighted(loss, weight, _reduction(None, None, reduction), False)
    return common.convert(result, dtype)


# ---------------------------------------------------------------------------------------------
# binary cross entropy


def _same_size(input: Value, target: Value, message: str) -> None:
    if input.type.shape != target.type.shape:
        raise ValueError(message.format(_size(target), _size(input)))


def _scale(loss: Value, weight: Value | None) -> Value:
    if weight is None:
        return loss
    (scaled, w), _ = _promoted(loss, common.convert(weight, loss.type.dtype))
    return prims.mul(scaled, w)


BCE_CASES: tuple[Case, ...] = (
    ((T((3, 4), low=0.05, high=0.95), T((3, 4), low=0.0, high=1.0)), {}, ""),
    ((T((3, 4), low=0.05, high=0.95), T((3, 4), low=0.0, high=1.0)), {"reduction": "sum"}, ""),
    ((T((2, 3), low=0.05, high=0.95), T((2, 3), low=0.0, high=1.0)), {"reduction": "none"}, ""),
    (
        (T((3, 4), low=0.05, high=0.95), T((3, 4), low=0.0, high=1.0)),
        {"weight": T((4,), low=0.1, high=2.0)},
        "broadcast weight",
    ),
    ((T((0, 3), low=0.05, high=0.95), T((0, 3), low=0.0, high=1.0)), {}, "empty: nan"),
)


@translation(F.binary_cross_entropy, samples=case_calls(*BCE_CASES))
def binary_cross_entropy(
    input: Value,
    target: Value,
    weight: Value | None = None,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Value:
    """``-(t * max(log x, -100) + (1 - t) * max(log(1 - x), -100))``, the clamp as in eager."""
    input, target, weight = common.autocast("binary_cross_entropy", input, target, weight)
    _same_size(
        input,
        target,
        "Using a target size ({}) that is different to the input size ({}) "
        "is deprecated. Please ensure they have the same size.",
    )
    x, t, dtype = _pair("binary_cross_entropy", input, target)
    log_x = prims.maximum(prims.log(x), -100.0)
    log_rest = prims.maximum(prims.log1p(prims.neg(x)), -100.0)
    loss = prims.sub(prims.mul(prims.sub(t, 1.0), log_rest), prims.mul(t, log_x))
    loss = _scale(loss, weight)
    return common.convert(reduce_loss(loss, _reduction(size_average, reduce, reduction)), dtype)


BCE_LOGITS_CASES: tuple[Case, ...] = (
    ((T((3, 4)), T((3, 4), low=0.0, high=1.0)), {}, ""),
    ((T((3, 4)), T((3, 4), low=0.0, high=1.0)), {"reduction": "none"}, ""),
    ((T((3, 4), low=-30, high=30), T((3, 4), low=0.0, high=1.0)), {}, "large logits"),
    (
        (T((3, 4)), T((3, 4), low=0.0, high=1.0)),
        {"weight": T((3, 1), low=0.1, high=2.0), "pos_weight": T((4,), low=0.5, high=3.0)},
        "weight, pos_weight",
    ),
    ((T((2, 3)), T((2, 3), low=0.0, high=1.0)), {"reduction": "sum", "reduce": True}, "legacy"),
)


@translation(F.binary_cross_entropy_with_logits, samples=case_calls(*BCE_LOGITS_CASES))
def binary_cross_entropy_with_logits(
    input: Value,
    target: Value,
    weight: Value | None = None,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    pos_weight: Value | None = None,
) -> Value:
    """``(1 - t) * x - log_sigmoid(x) * (1 + (pos_weight - 1) * t)``, times ``weight``, with
    the stable ``log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|))``."""
    input, target, weight, pos_weight = common.autocast(
        "binary_cross_entropy_with_logits", input, target, weight, pos_weight
    )
    _same_size(input, target, "Target size ({}) must be the same as input size ({})")
    x, t, dtype = _pair("binary_cross_entropy_with_logits", input, target)
    log_sigmoid = prims.sub(prims.minimum(x, 0.0), prims.log1p(prims.exp(prims.neg(prims.abs(x)))))
    if pos_weight is not None:
        (p, targets), _ = _promoted(common.convert(pos_weight, x.type.dtype), t)
        log_weight = prims.add(prims.mul(prims.sub(p, 1.0), targets), 1.0)
        (log_sigmoid, log_weight), _ = _promoted(log_sigmoid, log_weight)
        log_sigmoid = prims.mul(log_sigmoid, log_weight)
    loss = prims.sub(prims.mul(prims.sub(1.0, t), x), log_sigmoid)
    loss = _scale(loss, weight)
    return common.convert(reduce_loss(loss, _reduction(size_average, reduce, reduction)), dtype)


# ---------------------------------------------------------------------------------------------
# nll_loss, cross_entropy


def _class_dim(input: Value) -> int:
    return 0 if input.type.rank == 1 else 1


def _check_targets(op: str, input: Value, target: Value) -> None:
    if target.type.dtype not in (torch.int64, torch.uint8):
        name = scalar_type_name(target.type.dtype)
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {name}")
    if input.type.rank < 1:
        raise ValueError(f"{op}: Expected 1 or more dimensions (got 0)")
    expected = tuple(s for i, s in enumerate(input.type.shape) if i != _class_dim(input))
    if tuple(target.type.shape) != expected:
        raise ValueError(
            f"{op}: Expected target size {list(expected)}, got {list(target.type.shape)}"
        )


def _target_weights(
    input: Value, target: Value, weight: Value | None, ignore_index: int
) -> tuple[Value, Value]:
    """(target with ignored entries replaced by class 0, each target's weight: 0 if ignored)."""
    index = common.convert(target, torch.int64)
    valid = prims.ne(index, ignore_index)
    safe = prims.where(valid, index, 0)
    if weight is None:
        weights = common.convert(valid, input.type.dtype)
    else:
        picked = prims.index(common.convert(weight, input.type.dtype), safe, dims=(0,))
        weights = prims.where(valid, picked, 0.0)
    return safe, weights


def _nll(
    logp: Value, target: Value, weight: Value | None, reduction: str, ignore_index: int
) -> Value:
    """``-w[t] * logp[t]`` per target, reduced; the mean divides by the targets' total weight."""
    dim = _class_dim(logp)
    safe, weights = _target_weights(logp, target, weight, ignore_index)
    picked = prims.gather(logp, prims.unsqueeze(safe, dims=(dim,)), dim=dim)
    loss = prims.mul(prims.neg(prims.squeeze(picked, dims=(dim,))), weights)
    if reduction != "mean":
        return reduce_loss(loss, reduction)
    everything = _everything(loss)
    return prims.div(reduce(prims.sum, loss, everything), reduce(prims.sum, weights, everything))


def _class_calls(extra: tuple[Any, ...] = ()) -> Any:
    """nll_loss and cross_entropy samples: class 1 doubles as the ignored index."""

    def target(*shape: int) -> T:
        return T(shape, dtype=torch.int64, low=0, high=4)

    return case_calls(
        ((T((3, 4)), target(3)), {}, ""),
        ((T((3, 4)), target(3)), {"reduction": "sum"}, ""),
        ((T((3, 4)), target(3)), {"reduction": "none", "ignore_index": 1}, "ignore_index"),
        (
            (T((5, 4)), target(5)),
            {"ignore_index": 1, "weight": T((4,), low=0.1, high=2.0)},
            "weight, ignore_index, mean",
        ),
        ((T((2, 4, 3)), target(2, 3)), {}, "(N, C, d1)"),
        (
            (T((2, 4, 2, 3)), target(2, 2, 3)),
            {"weight": T((4,), low=0.1, high=2.0), "reduction": "none"},
            "(N, C, d1, d2)",
        ),
        ((T((4,)), target()), {}, "(C,)"),
        ((T((3, 4)), target(3)), {"size_average": False}, "legacy"),
        *extra,
    )


@translation(F.nll_loss, samples=_class_calls())
def nll_loss(
    input: Value,
    target: Value,
    weight: Value | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
) -> Value:
    input, weight = common.autocast("nll_loss", input, weight)
    _check_targets("nll_loss", input, target)
    logp = common.convert(input, compute_dtype(input.type.dtype))
    loss = _nll(logp, target, weight, _reduction(size_average, reduce, reduction), ignore_index)
    return common.convert(loss, input.type.dtype)


def _smoothed(
    logp: Value,
    target: Value,
    weight: Value | None,
    reduction: str,
    ignore_index: int,
    smoothing: float,
) -> Value:
    """Eager's label smoothing of class-index targets: ``(1 - s) * nll + s / C * smooth``,
    where ``smooth`` is the (weighted) negative sum of all log-probabilities per target."""
    dim = _class_dim(logp)
    classes = logp.type.shape[dim]
    nll = _nll(logp, target, weight, reduction, ignore_index)
    terms = logp
    if weight is not None:
        w = common.convert(weight, logp.type.dtype)
        terms = prims.mul(logp, prims.broadcast(w, shape=logp.type.shape, dims=(dim,)))
    ignored = prims.eq(common.convert(target, torch.int64), ignore_index)
    smooth = prims.where(ignored, 0.0, prims.neg(prims.sum(terms, dims=(dim,))))
    if reduction == "mean":
        _, weights = _target_weights(logp, target, weight, ignore_index)
        everything = _everything(smooth)
        smooth = prims.div(
            reduce(prims.sum, smooth, everything), reduce(prims.sum, weights, everything)
        )
    elif reduction == "sum":
        smooth = reduce(prims.sum, smooth, _everything(smooth))
    return prims.add(prims.mul(nll, 1.0 - smoothing), prims.mul(smooth, smoothing / classes))


def _soft_targets(
    logp: Value, target: Value, weight: Value | None, reduction: str, smoothing: float
) -> Value:
    """Class-probability targets: ``-sum(logp * target * weight)`` per sample."""
    dim = _class_dim(logp)
    classes = logp.type.shape[dim]
    (logp, probabilities), _ = _promoted(logp, target)
    if smoothing > 0:
        probabilities = prims.add(prims.mul(probabilities, 1.0 - smoothing), smoothing / classes)
    terms = prims.mul(logp, probabilities)
    if weight is not None:
        w = common.convert(weight, terms.type.dtype)
        terms = prims.mul(terms, prims.broadcast(w, shape=terms.type.shape, dims=(dim,)))
    if reduction == "none":
        return prims.neg(prims.sum(terms, dims=(dim,)))
    total = prims.neg(reduce(prims.sum, terms, _everything(terms)))
    if reduction == "sum":
        return total
    samples = numel(terms) // classes if classes else 0
    return prims.div(total, common.size_scalar(samples))


def _probabilities(*shape: int) -> T:
    return T(shape, low=0.0, high=1.0)


CROSS_ENTROPY_EXTRA: tuple[Case, ...] = (
    ((T((3, 4)), _probabilities(3, 4)), {}, "probabilities"),
    (
        (T((2, 4, 3)), _probabilities(2, 4, 3)),
        {"reduction": "none", "label_smoothing": 0.2, "weight": T((4,), low=0.1, high=2.0)},
        "probabilities, smoothing, weight",
    ),
    ((T((4,)), _probabilities(4)), {"reduction": "sum"}, "(C,) probabilities"),
    (
        (T((5, 4)), T((5,), dtype=torch.int64, low=0, high=4)),
        {"label_smoothing": 0.1, "ignore_index": 1},
        "smoothing, mean",
    ),
    (
        (T((5, 4)), T((5,), dtype=torch.int64, low=0, high=4)),
        {"label_smoothing": 0.3, "ignore_index": 1, "weight": T((4,), low=0.1, high=2.0)},
        "smoothing, weight, mean",
    ),
    (
        (T((2, 4, 3)), T((2, 3), dtype=torch.int64, low=0, high=4)),
        {"label_smoothing": 0.2, "reduction": "none", "weight": T((4,), low=0.1, high=2.0)},
        "smoothing, none",
    ),
    (
        (T((5, 4)), T((5,), dtype=torch.int64, low=0, high=4)),
        {"label_smoothing": 0.2, "reduction": "sum"},
        "smoothing, sum",
    ),
)


@translation(F.cross_entropy, samples=_class_calls(CROSS_ENTROPY_EXTRA))
def cross_entropy(
    input: Value,
    target: Value,
    weight: Value | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Value:
    input, weight = common.autocast("cross_entropy", input, weight)
    reduction = _reduction(size_average, reduce, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    dim = _class_dim(input) if input.type.rank else 0
    logp = softmax_of(input, dim, None, True, "log_softmax")
    if input.type.shape == target.type.shape and target.type.dtype.is_floating_point:
        return _soft_targets(logp, target, weight, reduction, label_smoothing)
    _check_targets("cross_entropy", input, target)
    wide = common.convert(logp, compute_dtype(logp.type.dtype))
    if label_smoothing > 0:
        loss = _smoothed(wide, target, weight, reduction, ignore_index, label_smoothing)
    else:
        loss = _nll(wide, target, weight, reduction, ignore_index)
    return common.convert(loss, input.type.dtype)
