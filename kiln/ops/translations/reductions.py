"""Reductions in prims: ``sum``, ``mean``, ``prod``, ``var``/``std``, ``amax``/``amin``,
``max``/``min``, ``argmax``/``argmin``, ``any``/``all``, ``count_nonzero``, ``logsumexp``.

Reduction prims remove the reduced dims and keep the dtype; these translations add PyTorch's
conveniences: ``dim`` as None/int/tuple (None and ``()`` mean every dim), negative dims,
``keepdim`` (an ``unsqueeze`` after the prim), dtype rules (bool and int sums are int64, means
are float only) and reduced precision: eager sums float16/bfloat16 with float32 accumulation and
rounds once, so the translations convert to float32, reduce and convert back::

    x.sum(1, keepdim=True)   # x: bf16[3, 4]
    t1 = convert(t0, dtype=torch.float32)
    t2 = sum(t1, dims=(1,))
    t3 = unsqueeze(t2, dims=(1,))
    t4 = convert(t3, dtype=torch.bfloat16)

The helpers at the top (``reduction_dims``, ``reduce``, ``keep``, ``mean_of``, ``variance_of``)
are shared with the normalization and loss translations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ir.types import Dim
from kiln.ops import prims
from kiln.ops.sampling import ALL, NUMERIC, make_tensor
from kiln.ops.translations import common
from kiln.ops.translations.cases import T, case_calls
from kiln.ops.translations.table import Call, CallFn, translation

Dims = int | Sequence[int] | None
LOW_PRECISION = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# shared helpers


def reduction_dims(x: Value, dim: Dims, op: str) -> tuple[int, ...]:
    """Sorted non-negative dims of ``x`` to reduce; None or an empty list means every dim, and a
    0-d tensor has none (its dim 0 or -1 names the tensor itself)."""
    rank = x.type.rank
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return tuple(range(rank))
    listed = (dim,) if isinstance(dim, int) else tuple(dim)
    dims = common.normalize_dims(listed, rank, op)
    if len(dims) != len(listed):
        raise RuntimeError(f"{op}: dim {listed} appears multiple times in the list of dims")
    return dims if rank else ()


def keep(result: Value, dims: tuple[int, ...], keepdim: bool) -> Value:
    """Re-insert the reduced ``dims`` as size-1 dims when ``keepdim``."""
    if not keepdim or not dims:
        return result
    return prims.unsqueeze(result, dims=dims)


def reduce(
    prim: Callable[..., Any], x: Value, dims: tuple[int, ...], keepdim: bool = False
) -> Value:
    """``prim`` (sum, prod, amax, amin) over ``dims`` with ``keepdim``; no dims: ``x``."""
    if not dims:
        return x
    return keep(prim(x, dims=dims), dims, keepdim)


def expand_back(reduced: Value, like: Value, dims: tuple[int, ...]) -> Value:
    """A reduction over ``dims`` (without keepdim) broadcast back to the shape of ``like``."""
    return common.broadcast_to(keep(reduced, dims, True), like.type.shape)


def numel(x: Value) -> Dim:
    return x.type.numel()


def reduced_count(x: Value, dims: tuple[int, ...]) -> Dim:
    return math.prod(x.type.shape[d] for d in dims)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager accumulates ``dtype`` in: float32 for float16/bfloat16."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def sum_of(x: Value, dims: tuple[int, ...], keepdim: bool = False) -> Value:
    """The sum in ``x``'s dtype, accumulated in float32 for float16/bfloat16."""
    total = reduce(prims.sum, common.convert(x, compute_dtype(x.type.dtype)), dims, keepdim)
    return common.convert(total, x.type.dtype)


def mean_of(x: Value, dims: tuple[int, ...], keepdim: bool = False) -> Value:
    """The mean of floating ``x`` in its dtype (float32 inside for float16/bfloat16)."""
    wide = common.convert(x, compute_dtype(x.type.dtype))
    mean = prims.div(
        reduce(prims.sum, wide, dims, keepdim), common.size_scalar(reduced_count(x, dims))
    )
    return common.convert(mean, x.type.dtype)


def moments(x: Value, dims: tuple[int, ...]) -> tuple[Value, Value]:
    """(mean, sum of squared deviations) of floating ``x`` over ``dims``, both keeping the
    reduced dims, computed in ``x``'s dtype (two passes: the mean, then the deviations)."""
    count = reduced_count(x, dims)
    mean = (
        keep(prims.div(reduce(prims.sum, x, dims), common.size_scalar(count)), dims, True)
        if dims
        else x
    )
    deviation = prims.sub(x, common.broadcast_to(mean, x.type.shape))
    return mean, reduce(prims.sum, prims.mul(deviation, deviation), dims, True)


def variance_of(
    x: Value, dims: tuple[int, ...], correction: float, keepdim: bool = False
) -> tuple[Value, Value]:
    """(variance, mean) of floating ``x`` over ``dims`` in ``x``'s dtype (float32 inside for
    float16/bfloat16): squared deviations over ``max(N - correction, 0)``, inf or nan at 0 as
    in eager."""
    wide = common.convert(x, compute_dtype(x.type.dtype))
    mean, squares = moments(wide, dims)
    count = reduced_count(x, dims)
    remaining: Dim | float
    if isinstance(count, Sym) and float(correction).is_integer():
        remaining = count - int(correction)  # (N - 1 stays a symbolic size)
    elif isinstance(count, Sym):
        remaining = float(count) - correction  # (what a symbolic size minus a float gives)
    else:
        remaining = count - correction
    variance = prims.div(squares, common.size_scalar(max(remaining, 0)))
    if not keepdim and dims:
        variance, mean = (prims.squeeze(v, dims=dims) for v in (variance, mean))
    return common.convert(variance, x.type.dtype), common.convert(mean, x.type.dtype)


_SCALAR_TYPE_NAMES = {
    torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
    torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
    torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
}  # fmt: skip


def scalar_type_name(dtype: torch.dtype) -> str:
    """The name PyTorch's C++ errors give ``dtype``: ``Long``, ``Float``, ``BFloat16``..."""
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def require_float(x: Value, op: str, message: str | None = None) -> None:
    if not x.type.dtype.is_floating_point:
        name = scalar_type_name(x.type.dtype)
        raise RuntimeError(message or f"{op}: expected a floating point tensor, got {name}")


def _integer_result(dtype: torch.dtype) -> torch.dtype:
    """Sums and products of bool and integer tensors are int64, as in eager."""
    return dtype if dtype.is_floating_point else torch.int64


# ---------------------------------------------------------------------------------------------
# samples

Case = tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]


def calls(cases: Sequence[Case], low: float | None = None, high: float | None = None) -> CallFn:
    """Samples: for each (shape, extra positional args, kwargs) one fresh random tensor."""
    return case_calls(
        *(((T(shape, low=low, high=high), *args), kwargs, "") for shape, args, kwargs in cases)
    )


DIM_CASES: tuple[Case, ...] = (
    ((3, 4), (), {}),
    ((3, 4), (1,), {}),
    ((2, 3, 4), (-1,), {"keepdim": True}),
    ((2, 3, 4), ((0, 2),), {}),
    ((2, 3, 4), (), {"dim": (-1, 0), "keepdim": True}),
    ((4, 1, 3), (1,), {}),
    ((), (), {}),
    ((), (0,), {"keepdim": True}),
)
EMPTY_CASES: tuple[Case, ...] = (((0, 4), (0,), {}), ((2, 0), (), {"dim": None}))
ONE_DIM_CASES: tuple[Case, ...] = (
    ((3, 4), (), {}),
    ((3, 4), (1,), {}),
    ((2, 3, 4), (-1,), {"keepdim": True}),
    ((2, 3, 4), (), {"dim": 0}),
    ((4, 1, 3), (1,), {}),
    ((), (0,), {"keepdim": True}),
)


# ---------------------------------------------------------------------------------------------
# sum, mean, prod


@translation(
    torch.sum,
    torch.Tensor.sum,
    samples=calls(
        DIM_CASES
        + EMPTY_CASES
        + (((3, 4), (1,), {"dtype": torch.float32}), ((2, 3), (), {"dtype": torch.int64}))
    ),
    dtypes=ALL,
)
def sum_(
    input: Value, dim: Dims = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Value:
    if dtype is None:
        (input,) = common.autocast("sum", input)
    dims = reduction_dims(input, dim, "sum")
    x = common.convert(input, dtype or _integer_result(input.type.dtype))
    return sum_of(x, dims, keepdim)


@translation(torch.nansum, torch.Tensor.nansum, samples=calls(DIM_CASES), dtypes=NUMERIC)
def nansum(
    input: Value, dim: Dims = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Value:
    if input.type.dtype.is_floating_point:
        input = prims.where(prims.isnan(input), 0.0, input)
    return sum_(input, dim, keepdim, dtype=dtype)


@translation(
    torch.mean,
    torch.Tensor.mean,
    samples=calls(DIM_CASES + EMPTY_CASES + (((3, 4), (0,), {"dtype": torch.float32}),)),
)
def mean(
    input: Value, dim: Dims = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Value:
    x = common.convert(input, dtype) if dtype is not None else input
    require_float(
        x,
        "mean",
        "mean(): could not infer output dtype. Input dtype must be either a floating point or "
        f"complex dtype. Got: {scalar_type_name(x.type.dtype)}",
    )
    return mean_of(x, reduction_dims(x, dim, "mean"), keepdim)


@translation(
    torch.prod,
    torch.Tensor.prod,
    samples=calls((*ONE_DIM_CASES, ((2, 3), (1,), {"dtype": torch.float32})), low=-2, high=3),
    dtypes=ALL,
)
def prod(
    input: Value, dim: int | None = None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> Value:
    if dtype is None:
        (input,) = common.autocast("prod", input)
    x = common.convert(input, dtype or _integer_result(input.type.dtype))
    dims = reduction_dims(x, dim, "prod")
    wide = torch.int64 if x.type.dtype == torch.bool else compute_dtype(x.type.dtype)
    product = reduce(prims.prod, common.convert(x, wide), dims, keepdim)
    return common.convert(product, x.type.dtype)


# ---------------------------------------------------------------------------------------------
# var, std


def _correction(dim: Any, unbiased: bool | None, correction: float | None) -> tuple[Any, float]:
    """PyTorch's var/std overloads: ``var(x, unbiased)``, ``var(x, dim, unbiased, keepdim)`` and
    ``var(x, dim, correction=..., keepdim=...)``; returns (dim, correction)."""
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    if unbiased is not None and correction is not None:
        raise TypeError("var/std: pass either unbiased or correction, not both")
    if unbiased is not None:
        return dim, 1.0 if unbiased else 0.0
    return dim, 1.0 if correction is None else correction


def _moments(
    op: str, input: Value, dim: Any, unbiased: bool | None, keepdim: bool, correction: float | None
) -> tuple[Value, Value]:
    require_float(input, op, "std and var only support floating point and complex dtypes")
    dim, correction = _correction(dim, unbiased, correction)
    return variance_of(input, reduction_dims(input, dim, op), correction, keepdim)


VAR_CASES: tuple[Case, ...] = (
    *DIM_CASES,
    ((3, 4), (1, False), {}),
    ((3, 4), (False,), {}),
    ((2, 3, 4), ((0, 2),), {"correction": 0, "keepdim": True}),
    ((5, 3), (), {"dim": 0, "correction": 2}),
    ((1, 3), (0,), {}),
)


def _moment_entry(name: str, finish: Callable[[Value, Value], Any]) -> Callable[..., Any]:
    """The translation of ``torch.{name}``: ``finish(variance, mean)`` of ``_moments``."""

    def moment(
        input: Value,
        dim: Any = None,
        unbiased: bool | None = None,
        keepdim: bool = False,
        *,
        correction: float | None = None,
    ) -> Any:
        return finish(*_moments(name, input, dim, unbiased, keepdim, correction))

    moment.__name__ = moment.__qualname__ = name
    return moment


var = translation(torch.var, torch.Tensor.var, samples=calls(VAR_CASES))(
    _moment_entry("var", lambda variance, mean_: variance)
)
std = translation(torch.std, torch.Tensor.std, samples=calls(VAR_CASES))(
    _moment_entry("std", lambda variance, mean_: std_of_variance(variance))
)
var_mean = translation(torch.var_mean, samples=calls(VAR_CASES))(
    _moment_entry("var_mean", lambda variance, mean_: (variance, mean_))
)
std_mean = translation(torch.std_mean, samples=calls(VAR_CASES))(
    _moment_entry("std_mean", lambda variance, mean_: (std_of_variance(variance), mean_))
)


def std_of_variance(variance: Value) -> Value:
    wide = common.convert(variance, compute_dtype(variance.type.dtype))
    return common.convert(common.root(wide), variance.type.dtype)


# ---------------------------------------------------------------------------------------------
# amax, amin, max, min, argmax, argmin


EXTREME_CASES: tuple[Case, ...] = (*DIM_CASES, ((0, 4), (1,), {}))


@translation(torch.amax, torch.Tensor.amax, samples=calls(EXTREME_CASES), dtypes=ALL)
def amax(input: Value, dim: Dims = (), keepdim: bool = False) -> Value:
    return reduce(prims.amax, input, reduction_dims(input, dim, "amax"), keepdim)


@translation(torch.amin, torch.Tensor.amin, samples=calls(EXTREME_CASES), dtypes=ALL)
def amin(input: Value, dim: Dims = (), keepdim: bool = False) -> Value:
    return reduce(prims.amin, input, reduction_dims(input, dim, "amin"), keepdim)


def _arg_extreme(
    prim: Callable[..., Any], x: Value, dim: int | None, keepdim: bool, op: str
) -> Value:
    """Index of the first extreme along ``dim``; None flattens first, as eager does."""
    if x.type.dtype == torch.bool:
        x = common.convert(x, torch.int32)  # same order and ties; the prims take no bool
    if dim is None or x.type.rank == 0:
        if dim is not None:
            common.normalize_dim(dim, 0, op)
        flat = prims.reshape(x, shape=(numel(x),))
        index = prim(flat, dim=0)
        return prims.reshape(index, shape=(1,) * x.type.rank) if keepdim else index
    axis = common.normalize_dim(dim, x.type.rank, op)
    return keep(prim(x, dim=axis), (axis,), keepdim)


def _argmax_check(input: Value, op: str) -> None:
    if input.type.dtype == torch.bool:
        raise RuntimeError(f"{op}(): does not support bool input")


ARG_CASES: tuple[Case, ...] = (
    ((3, 4), (), {}),
    ((3, 4), (1,), {}),
    ((2, 3, 4), (-1,), {"keepdim": True}),
    ((2, 3, 4), (), {"keepdim": True}),
    ((4, 1, 3), (), {"dim": 1}),
    ((), (), {}),
    ((), (0,), {"keepdim": True}),
)


@translation(torch.argmax, torch.Tensor.argmax, samples=calls(ARG_CASES), dtypes=NUMERIC)
def argmax(input: Value, dim: int | None = None, keepdim: bool = False) -> Value:
    _argmax_check(input, "argmax")
    return _arg_extreme(prims.argmax, input, dim, keepdim, "argmax")


@translation(torch.argmin, torch.Tensor.argmin, samples=calls(ARG_CASES), dtypes=NUMERIC)
def argmin(input: Value, dim: int | None = None, keepdim: bool = False) -> Value:
    _argmax_check(input, "argmin")
    return _arg_extreme(prims.argmin, input, dim, keepdim, "argmin")


def _extreme(name: str, input: Value, dim: Any, keepdim: bool, other: Value | None) -> Any:
    """``max``/``min`` in all three forms: of everything, along a dim (values and indices), and
    elementwise of two tensors."""
    largest = name == "max"
    if isinstance(dim, Value) or other is not None:
        (x, y), _ = common.elementwise(input, other if other is not None else dim)
        return prims.maximum(x, y) if largest else prims.minimum(x, y)
    if dim is None:
        if input.type.numel() == 0:
            raise RuntimeError(
                f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                "Specify the reduction dim with the 'dim' argument."
            )
        everything = tuple(range(input.type.rank))
        extreme = prims.amax if largest else prims.amin
        if not input.type.requires_grad or not input.type.dtype.is_floating_point:
            return reduce(extreme, input, everything)
        return _extreme_of_all(extreme, input, everything, largest)
    axis = common.normalize_dim(dim, input.type.rank, name)
    dims = (axis,) if input.type.rank else ()
    indices = _arg_extreme(prims.argmax if largest else prims.argmin, input, dim, keepdim, name)
    if input.type.requires_grad and input.type.rank:
        # The values at the indices: eager's backward sends a row's gradient to the one
        # index it returned, where amax's would split it between ties.
        kept = indices if keepdim else prims.unsqueeze(indices, dims=(axis,))
        values = prims.gather(input, kept, dim=axis)
        values = values if keepdim else prims.squeeze(values, dims=(axis,))
    else:
        values = reduce(prims.amax if largest else prims.amin, input, dims, keepdim)
    result_type = torch.return_types.max if largest else torch.return_types.min
    return result_type((values, indices))  # type: ignore[arg-type]


def _extreme_of_all(extreme: Any, x: Value, dims: tuple[int, ...], largest: bool) -> Value:
    """``max()``/``min()`` of everything, differentiable as eager's: the gradient split among
    the elements equal to the result, and, when the result is NaN, among the NaNs (amax's
    rule, which compares with ==, would give NaN everywhere)."""
    nan = prims.ne(x, x)
    beyond = -math.inf if largest else math.inf
    clean = reduce(extreme, prims.where(nan, beyond, x), dims)  # no NaN: amax's own gradient
    nans = reduce(prims.sum, common.convert(nan, x.type.dtype), dims)
    through_nans = prims.div(reduce(prims.sum, prims.where(nan, x, 0.0), dims), nans)
    with torch.no_grad():
        any_nan = prims.gt(nans, 0.0)
    return prims.where(any_nan, through_nans, clean)


def _extreme_samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(*shape: int) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    return [
        Call((x(3, 4),)),
        Call((x(3, 4), 1)),
        Call((x(2, 3, 4), -1, True)),
        Call((x(2, 3, 4),), {"dim": 0, "keepdim": True}),
        Call((x(4, 1, 3), 1)),
        Call((x(), 0)),
        Call((x(), -1, True)),
        Call((x(3, 4), x(3, 4)), note="elementwise"),
        Call((x(3, 4), x(4)), note="elementwise, broadcast"),
        Call((x(2, 3), make_tensor((2, 3), torch.float32, device)), note="elementwise, promote"),
    ]


@translation(torch.max, torch.Tensor.max, samples=_extreme_samples, dtypes=ALL)
def max_(
    input: Value, dim: Any = None, keepdim: bool = False, *, other: Value | None = None
) -> Any:
    return _extreme("max", input, dim, keepdim, other)


@translation(torch.min, torch.Tensor.min, samples=_extreme_samples, dtypes=ALL)
def min_(
    input: Value, dim: Any = None, keepdim: bool = False, *, other: Value | None = None
) -> Any:
    return _extreme("min", input, dim, keepdim, other)


AMINMAX_CASES: tuple[Case, ...] = (
    ((3, 4), (), {}),
    ((3, 4), (), {"dim": 1}),
    ((2, 3, 4), (), {"dim": -1, "keepdim": True}),
    ((2, 3, 4), (), {"keepdim": True}),
    ((), (), {"dim": 0}),
)


@translation(torch.aminmax, torch.Tensor.aminmax, samples=calls(AMINMAX_CASES), dtypes=ALL)
def aminmax(input: Value, *, dim: int | None = None, keepdim: bool = False) -> Any:
    dims = reduction_dims(input, dim, "aminmax")
    low = reduce(prims.amin, input, dims, keepdim)
    high = reduce(prims.amax, input, dims, keepdim)
    if dim is None and keepdim:
        low, high = (prims.reshape(v, shape=(1,) * input.type.rank) for v in (low, high))
    return torch.return_types.aminmax((low, high))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# any, all, count_nonzero


def _truth(input: Value, dim: Dims, keepdim: bool, op: str) -> Value:
    """``any`` (``op == "any"``) or ``all`` of ``input != 0`` over ``dim``, as bool."""
    dims = reduction_dims(input, dim, op)
    nonzero = input if input.type.dtype == torch.bool else prims.ne(input, 0)
    if reduced_count(input, dims) == 0:  # no identity in amax/amin: fill instead
        result = reduced_full(nonzero, dims, keepdim, op == "all")
    else:
        result = reduce(prims.amax if op == "any" else prims.amin, nonzero, dims, keepdim)
    return common.convert(result, torch.uint8) if input.type.dtype == torch.uint8 else result


TRUTH_CASES: tuple[Case, ...] = (
    ((3, 4), (), {}),
    ((3, 4), (1,), {}),
    ((2, 3, 4), (-1, True), {}),
    ((2, 3, 4), (), {"dim": (0, 2)}),
    ((4, 1, 3), (1,), {}),
    ((), (), {}),
    ((0, 4), (0,), {}),
    ((0, 4), (0,), {"keepdim": True}),
    ((2, 0), (), {}),
)


@translation(torch.any, torch.Tensor.any, samples=calls(TRUTH_CASES, low=-1, high=2), dtypes=ALL)
def any_(input: Value, dim: Dims = None, keepdim: bool = False) -> Value:
    return _truth(input, dim, keepdim, "any")


@translation(torch.all, torch.Tensor.all, samples=calls(TRUTH_CASES, low=-1, high=2), dtypes=ALL)
def all_(input: Value, dim: Dims = None, keepdim: bool = False) -> Value:
    return _truth(input, dim, keepdim, "all")


@translation(
    torch.count_nonzero,
    torch.Tensor.count_nonzero,
    samples=calls(
        (
            ((3, 4), (), {}),
            ((3, 4), (1,), {}),
            ((2, 3, 4), ((0, -1),), {}),
            ((), (), {}),
            ((0, 3), (0,), {}),
        ),
        low=-1,
        high=2,
    ),
    dtypes=ALL,
)
def count_nonzero(input: Value, dim: Dims = None) -> Value:
    dims = reduction_dims(input, dim, "count_nonzero")
    nonzero = input if input.type.dtype == torch.bool else prims.ne(input, 0)
    return reduce(prims.sum, common.convert(nonzero, torch.int64), dims)


# ---------------------------------------------------------------------------------------------
# logsumexp


@translation(
    torch.logsumexp,
    torch.Tensor.logsumexp,
    torch.special.logsumexp,
    samples=calls(
        (
            ((3, 4), (1,), {}),
            ((2, 3, 4), ((0, -1),), {"keepdim": True}),
            ((), (0,), {}),
            ((4, 1, 3), (1,), {}),
            ((0, 3), (0,), {}),
            ((3, 0), (1,), {"keepdim": True}),
        )
    ),
    dtypes=NUMERIC,
)
def logsumexp(input: Value, dim: Dims, keepdim: bool = False) -> Value:
    """``max + log(sum(exp(x - max)))``, with an infinite max replaced by 0 (as eager does), so
    rows of -inf give -inf rather than nan."""
    x = common.convert(input, common.float_dtype(input.type.dtype))
    dims = reduction_dims(x, dim, "logsumexp")
    if reduced_count(x, dims) == 0:  # no max to subtract: log(0) = -inf
        return reduced_full(x, dims, keepdim, -math.inf)
    wide = common.convert(x, compute_dtype(x.type.dtype))
    high = reduce(prims.amax, wide, dims)
    finite = prims.where(prims.isinf(high), 0.0, high)
    shifted = prims.exp(prims.sub(wide, expand_back(finite, wide, dims)))
    result = prims.add(prims.log(reduce(prims.sum, shifted, dims)), finite)
    return common.convert(keep(result, dims, keepdim), x.type.dtype)


def reduced_full(x: Value, dims: tuple[int, ...], keepdim: bool, value: bool | float) -> Value:
    """A tensor of ``value`` shaped like a reduction of ``x`` over ``dims``."""
    shape = tuple(
        1 if i in dims else size for i, size in enumerate(x.type.shape) if keepdim or i not in dims
    )
    return common.full(shape, value, x.type.dtype, x.type.device)
