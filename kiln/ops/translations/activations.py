"""Activation functions in prims: ReLU and its clamps, GELU (erf and tanh forms), SiLU, Mish,
softplus, leaky ReLU, ELU/SELU/CELU, hard sigmoid/swish and log-sigmoid.

Each follows the formula of eager's CPU kernel, computed in float32 for float16/bfloat16 inputs
and rounded once, as eager does::

    F.gelu(x)                  # x: bf16[4]
    t1 = convert(x, dtype=torch.float32)
    t2 = mul(t1, 0.7071067811865476)
    t3 = erf(t2)
    ...
    t7 = convert(t6, dtype=torch.bfloat16)

``inplace=True`` (``F.relu(x, inplace=True)``) computes out of place and rebinds ``x`` through
``assign_input``; the ``relu_``-style keys are registered as in-place translations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import FLOATS, NUMERIC
from kiln.ops.translations import common
from kiln.ops.translations.elementwise_cases import ANYWHERE, unary_calls
from kiln.ops.translations.math import opmath_dtype
from kiln.ops.translations.table import assign_input, translation

Compute = Callable[[Value], Value]
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def in_opmath(x: Value, compute: Compute) -> Value:
    """``compute(x)`` in float32 for float16/bfloat16 ``x``, rounded once to its dtype."""
    if not x.type.dtype.is_floating_point:
        raise NotImplementedError(f"activation not implemented for {x.type.dtype}")
    wide = common.convert(x, opmath_dtype(x.type.dtype))
    return common.convert(compute(wide), x.type.dtype)


def finish(input: Value, result: Value, inplace: bool) -> Value:
    """With ``inplace``, the input tensor takes the result (the frontend rebinds it)."""
    if inplace:
        assign_input(input, result)
    return result


# ---------------------------------------------------------------------------------------------
# piecewise-linear


def relu(input: Value, inplace: bool = False) -> Value:
    if input.type.dtype == torch.bool:
        raise RuntimeError("Boolean inputs not supported for relu")
    # where, not maximum: eager's relu passes no gradient at 0 (maximum would split a tie).
    return finish(input, prims.where(prims.le(input, 0), 0, input), inplace)


def hardtanh(
    input: Value, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
) -> Value:
    if input.type.dtype == torch.bool:
        raise RuntimeError("Bool inputs not supported for hardtanh")
    dtype = input.type.dtype
    # Integer tensors truncate the bounds toward zero, as eager's cast to the tensor's dtype.
    low, high = (bound if dtype.is_floating_point else int(bound) for bound in (min_val, max_val))
    return finish(input, _clip_open(input, low, high), inplace)


def _clip_open(x: Value, low: float, high: float) -> Value:
    """``x`` clipped to ``[low, high]``, with eager's hardtanh gradient: none at the bounds."""
    inside = prims.where(prims.le(x, low), low, x)
    return prims.where(prims.ge(inside, high), high, inside)


def relu6(input: Value, inplace: bool = False) -> Value:
    return hardtanh(input, 0.0, 6.0, inplace)


def leaky_relu(input: Value, negative_slope: float = 0.01, inplace: bool = False) -> Value:
    def compute(x: Value) -> Value:
        return prims.where(prims.gt(x, 0), x, prims.mul(x, negative_slope))

    return finish(input, in_opmath(input, compute), inplace)


def _hard_gate(x: Value) -> Value:
    """``min(max(x + 3, 0), 6)``, shared by hardsigmoid and hardswish."""
    return _clip_open(prims.add(x, 3.0), 0.0, 6.0)


def hardsigmoid(input: Value, inplace: bool = False) -> Value:
    def compute(x: Value) -> Value:
        # eager's backward: 1/6 strictly inside (-3, 3), else 0 (NaN too)
        inside = prims.logical_and(prims.gt(x, -3.0), prims.lt(x, 3.0))
        weight = prims.mul(common.convert(inside, x.type.dtype), 1.0 / 6.0)
        return common.with_gradient(prims.div(_hard_gate(x), 6.0), x, weight)

    return finish(input, in_opmath(input, compute), inplace)


def hardswish(input: Value, inplace: bool = False) -> Value:
    def compute(x: Value) -> Value:
        # eager's backward: 0 up to -3, x/3 + 1/2 below 3, else 1 (NaN and +inf too)
        ramp = prims.where(prims.lt(x, 3.0), prims.add(prims.div(x, 3.0), 0.5), 1.0)
        weight = prims.where(prims.le(x, -3.0), 0.0, ramp)
        value = prims.div(prims.mul(x, _hard_gate(x)), 6.0)
        # -inf gives NaN without a gradient, +inf and NaN themselves with the gradient 1
        nonfinite = prims.where(prims.eq(x, -math.inf), prims.mul(x, 0.0), x)
        return common.with_gradient(value, x, weight, nonfinite)

    return finish(input, in_opmath(input, compute), inplace)


# ---------------------------------------------------------------------------------------------
# smooth


def gelu(input: Value, approximate: str = "none") -> Value:
    """``x/2 * (1 + erf(x/sqrt(2)))``, or with ``approximate='tanh'``
    ``x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``."""
    if approximate == "none":

        def compute(x: Value) -> Value:
            gate = prims.add(prims.erf(prims.mul(x, math.sqrt(0.5))), 1.0)
            return prims.mul(prims.mul(x, 0.5), gate)

    elif approximate == "tanh":

        def compute(x: Value) -> Value:
            cube = prims.mul(prims.mul(x, x), x)
            inner = prims.mul(prims.add(x, prims.mul(cube, 0.044715)), math.sqrt(2 / math.pi))
            return prims.mul(prims.mul(x, 0.5), prims.add(prims.tanh(inner), 1.0))

    else:
        raise RuntimeError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return in_opmath(input, compute)


def silu(input: Value, inplace: bool = False) -> Value:
    """``x / (1 + exp(-x))`` (eager's formula, rather than ``x * sigmoid(x)``)."""

    def compute(x: Value) -> Value:
        return prims.div(x, prims.add(prims.exp(prims.neg(x)), 1.0))

    return finish(input, in_opmath(input, compute), inplace)


def mish(input: Value, inplace: bool = False) -> Value:
    """``x * tanh(log1p(exp(x)))``."""

    def compute(x: Value) -> Value:
        return prims.mul(x, prims.tanh(prims.log1p(prims.exp(x))))

    return finish(input, in_opmath(input, compute), inplace)


def softplus(input: Value, beta: float = 1.0, threshold: float = 20.0) -> Value:
    """``log1p(exp(beta x)) / beta``, and ``x`` itself where ``beta x > threshold``."""
    (input,) = common.autocast("softplus", input)

    def compute(x: Value) -> Value:
        scaled = prims.mul(x, beta)
        linear = prims.gt(scaled, threshold)
        # exp reads 0 where the linear branch is taken: x = inf passes no inf / inf back.
        safe = prims.where(linear, 0.0, scaled)
        smooth = prims.div(prims.log1p(prims.exp(safe)), beta)
        return prims.where(linear, x, smooth)

    return in_opmath(input, compute)


def logsigmoid(input: Value) -> Value:
    """``min(x, 0) - log1p(exp(-|x|))``: stable for large ``|x|``."""

    def compute(x: Value) -> Value:
        tail = prims.log1p(prims.exp(prims.neg(prims.abs(x))))
        return prims.sub(prims.minimum(x, 0.0), tail)

    return in_opmath(input, compute)


def _elu(x: Value, alpha: float, scale: float, input_scale: float) -> Value:
    """Eager's ELU kernel: ``alpha scale expm1(input_scale x)`` for ``x <= 0``, else ``scale x``
    (so NaN takes the linear branch and its gradient, as in eager). The exponential reads 0
    where it is not taken: ``x = inf`` passes no ``0 * inf`` back."""
    negative_side = prims.le(x, 0)
    safe = prims.where(negative_side, x, 0.0)
    negative = prims.mul(prims.expm1(prims.mul(safe, input_scale)), alpha * scale)
    return prims.where(negative_side, negative, prims.mul(x, scale))


def elu(input: Value, alpha: float = 1.0, inplace: bool = False) -> Value:
    return finish(input, in_opmath(input, lambda x: _elu(x, alpha, 1.0, 1.0)), inplace)


def selu(input: Value, inplace: bool = False) -> Value:
    return finish(input, in_opmath(input, lambda x: _elu(x, SELU_ALPHA, SELU_SCALE, 1.0)), inplace)


def celu(input: Value, alpha: float = 1.0, inplace: bool = False) -> Value:
    if alpha == 0:
        raise RuntimeError("ZeroDivisionError: celu alpha must not be 0")
    return finish(input, in_opmath(input, lambda x: _elu(x, alpha, 1.0, 1 / alpha)), inplace)


# ---------------------------------------------------------------------------------------------
# registration

_NN = torch._C._nn
Variants = Callable[[torch.dtype], list[dict[str, Any]]]


def _register(
    fn: Callable[..., Value],
    functional: tuple[Any, ...],
    natives: tuple[Any, ...] = (),
    inplace: tuple[Any, ...] = (),
    *,
    dtypes: frozenset[torch.dtype] = FLOATS,
    options: tuple[dict[str, Any], ...] = (),
    has_inplace: bool = True,
) -> None:
    """``functional`` keys (``F.elu``) take the keyword ``options`` and ``inplace=True``;
    ``natives`` (``torch.celu``) and ``inplace`` keys (``F.elu_``) the options alone."""
    plain = unary_calls(ANYWHERE, _variants(options, False))
    translation(
        *functional, samples=unary_calls(ANYWHERE, _variants(options, has_inplace)), dtypes=dtypes
    )(fn)
    if natives:
        translation(*natives, samples=plain, dtypes=dtypes)(fn)
    if inplace:
        translation(*inplace, samples=plain, dtypes=dtypes, inplace=True)(fn)


def _variants(options: tuple[dict[str, Any], ...], with_inplace: bool) -> Variants:
    extra = [{**option, "inplace": True} for option in ({}, *options)] if with_inplace else []
    return lambda dtype: [*options, *extra]


_register(
    relu,
    (F.relu,),
    (torch.relu, torch.Tensor.relu),
    (torch.relu_, torch.Tensor.relu_),
    dtypes=NUMERIC,
)
_register(
    hardtanh,
    (F.hardtanh,),
    (),
    (F.hardtanh_,),
    dtypes=NUMERIC,
    options=({"min_val": -0.5, "max_val": 2.0},),
)
_register(relu6, (F.relu6,), dtypes=NUMERIC)
_register(leaky_relu, (F.leaky_relu,), (), (F.leaky_relu_,), options=({"negative_slope": 0.2},))
_register(hardsigmoid, (F.hardsigmoid,), (_NN.hardsigmoid,))
_register(hardswish, (F.hardswish,), (_NN.hardswish,))
_register(
    gelu, (F.gelu,), options=({"approximate": "tanh"}, {"approximate": "none"}), has_inplace=False
)
_register(silu, (F.silu,), (_NN.silu,))
_register(mish, (F.mish,), (_NN.mish,))
_register(
    softplus,
    (F.softplus,),
    options=({"beta": 2.0, "threshold": 1.0}, {"beta": 0.5}, {"threshold": 0.5}),
    has_inplace=False,
)
_register(logsigmoid, (F.logsigmoid,), has_inplace=False)
_register(elu, (F.elu,), (), (F.elu_,), options=({"alpha": 0.5},))
_register(selu, (F.selu,), (torch.selu,), (torch.selu_,))
_register(celu, (F.celu,), (torch.celu,), (torch.celu_,), options=({"alpha": 2.0},))
