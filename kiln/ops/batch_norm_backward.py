"""A BatchNorm with batch statistics, differentiated in closed form: a marker over its output.

The forward applies ``x * scale + shift`` (``scale = inverse * weight``, ``shift = bias -
mean * scale``), as eager's kernels do. Differentiated as written, that form sums ``g * x``
for the weight's gradient and subtracts ``mean * sum(g)``, which cancels when the mean is
large against the spread (8-9x farther from float64 than eager at mean/spread 1000), and the
gradient reaches the input through the statistics' own derivatives. Eager's backward is the
closed form on the centred input ``xhat = (x - mean) * inverse``, per channel over the other
dims (``n`` values each)::

    d bias   = sum(g)
    d weight = sum(g * xhat)
    d x      = inverse * weight * (g - sum(g) / n - xhat * sum(g * xhat) / n)

which already holds what flows through the mean and the variance. Translation passes the
output through :func:`batch_norm_output`, whose VJP is that formula and gives the output's
own producers and the statistics no gradient::

    t9 = add(mul(x, scale), shift)
    t10, = extern(t9, x, mean, inverse, weight, bias, fn=batch_norm_output, ...)

After autodiff ``passes/markers.py`` replaces the marker by ``t9``: the forward is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ops import prims
from kiln.ops.attrs import ExternAttrs, Slot
from kiln.ops.extern_shapes import EXTERN_FORMULAS
from kiln.ops.externs import EXTERN_VJPS, Grads, extern_call


def batch_norm_output(
    y: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    inverse: torch.Tensor,
    *affine: torch.Tensor,
    weight: bool,
    bias: bool,
) -> torch.Tensor:
    """The marker's reference implementation: ``y`` (copied: an extern's result is fresh
    memory), differentiated in closed form when eager autograd runs the graph (the reference
    interpreter). Compiled graphs lose the marker. ``affine``: the weight, then the bias, those
    that ``weight`` and ``bias`` say are there."""
    return _BatchNormOutput.apply(weight, bias, y, x, mean, inverse, *affine)


class _BatchNormOutput(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, has_weight: bool, has_bias: bool, y: torch.Tensor, *operands: torch.Tensor
    ) -> torch.Tensor:
        ctx.has_weight, ctx.has_bias = has_weight, has_bias
        ctx.save_for_backward(*operands)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, inverse, *affine = ctx.saved_tensors
        weight = affine[0] if ctx.has_weight else None
        shape = [1] * x.dim()
        shape[1] = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        xhat = (x - mean.view(shape)) * inverse.view(shape)
        sum_g, sum_gx = grad.sum(dims), (grad * xhat).sum(dims)
        count = x.numel() / max(x.shape[1], 1)
        scale = inverse if weight is None else inverse * weight.to(inverse.dtype)
        dx = scale.view(shape) * (
            grad - (sum_g / count).view(shape) - xhat * (sum_gx / count).view(shape)
        )
        gradients: list[torch.Tensor | None] = []
        if ctx.has_weight:
            gradients.append(sum_gx.to(affine[0].dtype))
        if ctx.has_bias:
            gradients.append(sum_g.to(affine[-1].dtype))
        return (None, None, None, dx, None, None, *gradients)


def emit_batch_norm_output(
    y: Value, x: Value, mean: Value, inverse: Value, weight: Value | None, bias: Value | None
) -> Value:
    """The marker node over a BatchNorm's output (see the module docstring); ``mean`` and
    ``inverse`` per channel, of ``x``'s dtype."""
    affine = [v for v in (weight, bias) if v is not None]
    kwargs = {"weight": weight is not None, "bias": bias is not None}
    result: Value = extern_call(batch_norm_output, [y, x, mean, inverse, *affine], kwargs)
    return result


def _batch_norm_vjp(attrs: ExternAttrs, inputs: Sequence[Any], outputs: Any, grads: Any) -> Grads:
    """The closed form of the module docstring, for the input, the weight and the bias."""
    (grad,) = grads
    slots = [slot.index for slot in attrs.args if isinstance(slot, Slot)]
    _, x, mean, inverse, *affine = [inputs[index] for index in slots]
    weight = affine[0] if attrs.kwargs["weight"] else None
    bias = affine[-1] if attrs.kwargs["bias"] else None
    shape = x.type.shape
    dims = tuple(d for d in range(len(shape)) if d != 1)
    size = math.prod(shape[d] for d in dims)
    count = size if isinstance(size, Sym) else float(size)

    def per_channel(value: Value) -> Value:
        return prims.broadcast(value, shape=shape, dims=(1,))

    xhat = prims.mul(prims.sub(x, per_channel(mean)), per_channel(inverse))
    sum_g = prims.sum(grad, dims=dims)
    sum_gx = prims.sum(prims.mul(grad, xhat), dims=dims)
    gradients: dict[Value, Value] = {}
    if _needs(x):
        scale = inverse
        if weight is not None:
            scale = prims.mul(inverse, _as(weight, inverse.type.dtype))
        centred = prims.sub(grad, per_channel(prims.div(sum_g, count)))
        centred = prims.sub(centred, prims.mul(xhat, per_channel(prims.div(sum_gx, count))))
        gradients[x] = prims.mul(per_channel(scale), centred)
    if weight is not None and _needs(weight):
        gradients[weight] = _as(sum_gx, weight.type.dtype)
    if bias is not None and _needs(bias):
        gradients[bias] = _as(sum_g, bias.type.dtype)
    return tuple(
        gradients.get(operand) if isinstance(operand, Value) else None for operand in inputs
    )


def _as(value: Value, dtype: torch.dtype) -> Value:
    return value if value.type.dtype == dtype else prims.convert(value, dtype=dtype)


def _needs(value: Any) -> bool:
    return isinstance(value, Value) and value.type.requires_grad


def _batch_norm_output_type(attrs: ExternAttrs, *operands: Any) -> Any:
    return operands[0]  # (the output's type; no meta run)


EXTERN_VJPS[batch_norm_output] = _batch_norm_vjp
EXTERN_FORMULAS[batch_norm_output] = _batch_norm_output_type
