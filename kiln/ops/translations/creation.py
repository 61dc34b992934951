"""Tensor factories in prims: ``*_like`` and ``Tensor.new_*`` (``full``), random factories and
dropout (``random_uniform``/``random_normal`` on the graph's seed).

``torch.zeros(3)`` with Python sizes needs no translation: it runs while tracing and becomes a
constant. Random factories are traced even without a traced argument (the tracer routes them
here), so every call of the graph draws new numbers: each one reserves its own stretch of the
graph's random stream::

    F.dropout(x, 0.1)          # x: f32[4]
    t0 = random_uniform(rng_seed, shape=(4,), dtype=torch.float32, device=..., offset=0)
    t1 = lt(t0, 0.9)
    t2 = convert(t1, dtype=torch.float32)
    t3 = div(t2, 0.9)
    t4 = mul(x, t3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.builder import require_builder
from kiln.ir.graph import Value
from kiln.ir.symbolic import Sym
from kiln.ir.types import Shape
from kiln.ops import prims
from kiln.ops.sampling import ALL, FLOATS, NUMERIC, make_tensor
from kiln.ops.translations import common
from kiln.ops.translations.activations import finish
from kiln.ops.translations.math import div, keys, methods, mul
from kiln.ops.translations.slicing import fill_scalar
from kiln.ops.translations.table import Call, CallFn, FallbackToExtern, translation

# Factories that draw random numbers: traced even with no proxy argument, so each call of the
# graph draws new numbers instead of replaying the ones drawn while tracing.
RANDOM_FACTORIES = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.bernoulli,
    torch.normal,
    torch.multinomial,
    torch.poisson,
    # In place on any tensor: a constant's numbers must not be drawn once, while tracing.
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.bernoulli_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.cauchy_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
}

Scalar = bool | int | float
DeviceLike = torch.device | str | int | None


# ---------------------------------------------------------------------------------------------
# shared helpers


def device_of(device: DeviceLike, default: torch.device) -> torch.device:
    if device is None:
        return default
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def sizes(args: Sequence[Any], op: str) -> Shape:
    """A size given as varargs ``(2, 3)`` or one sequence ``((2, 3),)``; ints or symbolic
    sizes."""
    size = tuple(args[0]) if len(args) == 1 and isinstance(args[0], Sequence) else tuple(args)
    if not all(isinstance(s, int | Sym) and not isinstance(s, bool) for s in size):
        raise FallbackToExtern  # a size computed from traced values
    for s in size:
        if s < 0:
            raise RuntimeError(f"{op}: Trying to create tensor with negative dimension {s}")
    return size


def filled(
    shape: Shape, value: Scalar | Sym | Value, dtype: torch.dtype, device: torch.device
) -> Value:
    """A tensor of ``shape`` filled with ``value`` (a scalar, or a 0-d traced tensor)."""
    if isinstance(value, Value):
        converted = common.convert(value, dtype)
        return common.broadcast_to(converted, shape)
    return common.full(shape, fill_scalar(value, dtype), dtype, device)


def random(kind: str, shape: Shape, dtype: torch.dtype, device: torch.device) -> Value:
    """Fresh ``uniform`` [0, 1) or ``normal`` numbers from the graph's random stream."""
    builder = require_builder()
    count = math.prod(shape)
    prim = prims.random_uniform if kind == "uniform" else prims.random_normal
    return prim(
        builder.rng_seed(),
        shape=tuple(shape),
        dtype=dtype,
        device=device,
        offset=builder.rng_offset(count),
    )


def unsupported(options: dict[str, Any], op: str) -> None:
    """Keyword arguments kiln cannot honour send the call to PyTorch."""
    if options.get("out") is not None or options.get("generator") is not None:
        raise FallbackToExtern
    if options.get("layout") not in (None, torch.strided):
        raise FallbackToExtern


# ---------------------------------------------------------------------------------------------
# *_like and Tensor.new_*


def _like(input: Value, value: Scalar | Value, options: dict[str, Any], op: str) -> Value:
    unsupported(options, op)
    dtype = options.get("dtype") or input.type.dtype
    device = device_of(options.get("device"), input.type.device)
    return filled(input.type.shape, value, dtype, device)


def zeros_like(input: Value, **options: Any) -> Value:
    return _like(input, 0, options, "zeros_like")


def ones_like(input: Value, **options: Any) -> Value:
    return _like(input, 1, options, "ones_like")


def empty_like(input: Value, **options: Any) -> Value:
    """Uninitialized memory in eager; zeros here (any value is correct)."""
    return _like(input, 0, options, "empty_like")


def full_like(input: Value, fill_value: Scalar | Value, **options: Any) -> Value:
    return _like(input, fill_value, options, "full_like")


def _new(self: Value, size: Sequence[Any], value: Scalar | Value, options: dict[str, Any]) -> Value:
    unsupported(options, "new_*")
    dtype = options.get("dtype") or self.type.dtype
    device = device_of(options.get("device"), self.type.device)
    return filled(sizes(size, "new_full"), value, dtype, device)


def new_zeros(self: Value, *size: Any, **options: Any) -> Value:
    return _new(self, options.pop("size", None) or size, 0, options)


def new_ones(self: Value, *size: Any, **options: Any) -> Value:
    return _new(self, options.pop("size", None) or size, 1, options)


def new_empty(self: Value, *size: Any, **options: Any) -> Value:
    return _new(self, options.pop("size", None) or size, 0, options)


def new_full(self: Value, size: Sequence[int], fill_value: Scalar | Value, **options: Any) -> Value:
    return _new(self, (size,), fill_value, options)


def new_tensor(self: Value, data: Any, **options: Any) -> Value:
    """Python data becomes a graph constant of ``self``'s dtype and device by default."""
    unsupported(options, "new_tensor")
    if any(isinstance(leaf, Value) for leaf in torch.utils._pytree.tree_leaves(data)):
        raise FallbackToExtern  # copies a traced tensor: rare, and PyTorch warns against it
    dtype = options.get("dtype") or self.type.dtype
    device = device_of(options.get("device"), self.type.device)
    return common.constant(torch.tensor(data, dtype=dtype, device=device))


def _like_calls(value: Scalar | None, floats_only: bool = False) -> CallFn:
    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        fill = () if value is None else (value,)
        other = torch.int64 if dtype.is_floating_point else torch.float32
        if floats_only:
            other = torch.float16 if dtype != torch.float16 else torch.float32
        return [
            Call((make_tensor((3, 4), dtype, device), *fill)),
            Call((make_tensor((0, 2), dtype, device), *fill), note="0-size"),
            Call((make_tensor((), dtype, device), *fill), note="0-d"),
            Call((make_tensor((2, 3), dtype, device), *fill), {"dtype": other}, note=str(other)),
            Call((make_tensor((2,), dtype, device), *fill), {"device": "cpu"}, note="device"),
        ]

    return samples


def _new_calls(value: Scalar | None) -> CallFn:
    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        fill = () if value is None else (value,)
        x = make_tensor((3,), dtype, device)
        cases = [
            Call((x, (2, 3), *fill)),
            Call((x, (0, 2), *fill), {"dtype": torch.float16}, note="dtype"),
            Call((x, (), *fill), note="0-d"),
        ]
        if value is None:  # new_zeros(2, 3): sizes as varargs
            cases.append(Call((x, 2, 3), note="varargs"))
        return cases

    return samples


# empty_like and new_empty return unspecified values: the test compares their types only.
for _fn in (zeros_like, ones_like, empty_like):
    translation(
        *keys([_fn.__name__]), samples=_like_calls(None), dtypes=ALL, random=_fn is empty_like
    )(_fn)
translation(torch.full_like, samples=_like_calls(2.5), dtypes=ALL)(full_like)
for _new_fn in (new_zeros, new_ones, new_empty):
    translation(
        *methods([_new_fn.__name__]),
        samples=_new_calls(None),
        dtypes=ALL,
        random=_new_fn is new_empty,
    )(_new_fn)
translation(torch.Tensor.new_full, samples=_new_calls(-3), dtypes=ALL)(new_full)


def _new_tensor_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((2,), dtype, device)
    return [Call((x, [[1, 0], [3, 1]])), Call((x, [2.0, 1.0]), {"dtype": torch.float32})]


translation(torch.Tensor.new_tensor, samples=_new_tensor_calls, dtypes=NUMERIC)(new_tensor)


def fill(self: Value, value: Scalar | Value) -> Value:
    """``x.fill_(v)``/``torch.fill``: ``x``'s shape, dtype and device, every element ``v``."""
    if isinstance(value, Value) and value.type.shape != ():
        raise RuntimeError(
            "fill_ only supports 0-dimension value tensor but got tensor with "
            f"{len(value.type.shape)} dimensions."
        )
    return _keeping_gradient(
        self, filled(self.type.shape, value, self.type.dtype, self.type.device)
    )


def zero(self: Value) -> Value:
    return _keeping_gradient(self, filled(self.type.shape, 0, self.type.dtype, self.type.device))


def _keeping_gradient(self: Value, result: Value) -> Value:
    """``result`` replacing ``self``: when ``self`` requires grad, eager's fill still does (with
    a zero gradient), so the values are selected over ``self`` rather than made from nothing."""
    if not self.type.requires_grad:
        return result
    everywhere = prims.full(
        shape=self.type.shape, value=True, dtype=torch.bool, device=self.type.device
    )
    return prims.where(everywhere, result, self)


def _fill_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((3, 4), dtype, device)
    return [
        Call((x, 2)),
        Call((make_tensor((0, 2), dtype, device), 1), note="0-size"),
        Call((x, make_tensor((), dtype, device)), note="0-d tensor value"),
    ]


def _zero_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [Call((make_tensor((3, 4), dtype, device),))]


translation(torch.fill, samples=_fill_calls, dtypes=ALL)(fill)
translation(torch.Tensor.fill_, torch.fill_, samples=_fill_calls, dtypes=ALL, inplace=True)(fill)
translation(torch.Tensor.zero_, torch.zero_, samples=_zero_calls, dtypes=ALL, inplace=True)(zero)


# ---------------------------------------------------------------------------------------------
# random factories


def _random_options(options: dict[str, Any], op: str) -> tuple[torch.dtype, torch.device]:
    unsupported(options, op)
    dtype = options.get("dtype") or torch.get_default_dtype()
    return dtype, device_of(options.get("device"), torch.get_default_device())


def rand(*size: Any, **options: Any) -> Value:
    dtype, device = _random_options(options, "rand")
    return random("uniform", sizes(options.pop("size", None) or size, "rand"), dtype, device)


def randn(*size: Any, **options: Any) -> Value:
    dtype, device = _random_options(options, "randn")
    return random("normal", sizes(options.pop("size", None) or size, "randn"), dtype, device)


def rand_like(input: Value, **options: Any) -> Value:
    unsupported(options, "rand_like")
    dtype = options.get("dtype") or input.type.dtype
    return random(
        "uniform", input.type.shape, dtype, device_of(options.get("device"), input.type.device)
    )


def randn_like(input: Value, **options: Any) -> Value:
    unsupported(options, "randn_like")
    dtype = options.get("dtype") or input.type.dtype
    return random(
        "normal", input.type.shape, dtype, device_of(options.get("device"), input.type.device)
    )


def _integers(low: int, high: int, shape: Shape, dtype: torch.dtype, device: torch.device) -> Value:
    """Uniform integers in [low, high): ``low + floor(u * (high - low))``, in float64 so every
    integer of a wide range is reachable."""
    if high <= low:
        raise RuntimeError(
            f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}"
        )
    u = random("uniform", shape, torch.float64, device)
    drawn = prims.minimum(prims.floor(prims.mul(u, float(high - low))), float(high - low - 1))
    return common.convert(prims.add(drawn, float(low)), dtype)


def randint(*args: Any, **options: Any) -> Value:
    """``randint(high, size)`` or ``randint(low, high, size)``; int64 unless ``dtype`` says."""
    unsupported(options, "randint")
    bounds = [options.pop(name) for name in ("low", "high") if name in options]
    values = [*args[:-1], *bounds] if "size" not in options else [*args, *bounds]
    size = options.pop("size", None) or args[-1]
    low, high = (0, values[0]) if len(values) == 1 else values
    dtype = options.get("dtype") or torch.int64
    device = device_of(options.get("device"), torch.get_default_device())
    return _integers(low, high, sizes((size,), "randint"), dtype, device)


def randint_like(input: Value, *bounds: int, **options: Any) -> Value:
    unsupported(options, "randint_like")
    low, high = (0, bounds[0]) if len(bounds) == 1 else bounds
    dtype = options.get("dtype") or input.type.dtype
    device = device_of(options.get("device"), input.type.device)
    return _integers(low, high, input.type.shape, dtype, device)


def bernoulli(input: Value, p: float | None = None, **options: Any) -> Value:
    """1 with probability ``input`` (or ``p``), else 0, in ``input``'s dtype."""
    unsupported(options, "bernoulli")
    u = random("uniform", input.type.shape, torch.float32, input.type.device)
    chance = p if p is not None else common.convert(input, torch.float32)
    drawn = prims.convert(prims.lt(u, chance), dtype=input.type.dtype)
    return _keeping_gradient(input, drawn)  # eager: requires grad, with a zero gradient


def bernoulli_(self: Value, p: float | Value = 0.5, **options: Any) -> Value:
    """``x.bernoulli_(p)``: x filled with 1 with probability ``p`` (a float or a tensor
    broadcast to x), else 0; stochastic depth draws its per-sample noise this way."""
    unsupported(options, "bernoulli_")
    u = random("uniform", self.type.shape, torch.float32, self.type.device)
    if isinstance(p, Value):
        p = common.broadcast_to(common.convert(p, torch.float32), self.type.shape)
    return prims.convert(prims.lt(u, p), dtype=self.type.dtype)


def _factory_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    cases = [
        Call((1000,), {"dtype": dtype}),
        Call((2, 3), {"dtype": dtype, "device": device}, note="varargs"),
        Call(((0, 3),), {"dtype": dtype}, note="tuple, 0-size"),
        Call((), {"size": (4,), "dtype": dtype}, note="size="),
    ]
    if dtype == torch.get_default_dtype():
        cases += [Call((3, 4), note="default dtype"), Call(((),), note="0-d")]
    return cases


def _randint_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [
        Call((10, (1000,)), {"dtype": dtype}),
        Call((-5, 5, (3, 4)), {"dtype": dtype}, note="low, high"),
        Call((3,), {"size": (2,), "dtype": dtype}, note="size="),
    ]


def _randint_like_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((3, 4), dtype, device)
    return [Call((x, 10)), Call((x, -3, 4), note="low, high")]


def _bernoulli_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    p = make_tensor((3, 4), dtype, device, low=0.0, high=1.0)
    return [Call((p,)), Call((make_tensor((5,), dtype, device),), {"p": 0.3}, note="p")]


translation(torch.rand, samples=_factory_calls, dtypes=FLOATS, random=True)(rand)
translation(torch.randn, samples=_factory_calls, dtypes=FLOATS, random=True)(randn)
_RANDOM_LIKE = _like_calls(None, floats_only=True)
translation(torch.rand_like, samples=_RANDOM_LIKE, dtypes=FLOATS, random=True)(rand_like)
translation(torch.randn_like, samples=_RANDOM_LIKE, dtypes=FLOATS, random=True)(randn_like)
translation(torch.randint, samples=_randint_calls, dtypes=NUMERIC, random=True)(randint)
translation(torch.randint_like, samples=_randint_like_calls, dtypes=NUMERIC, random=True)(
    randint_like
)
translation(*keys(["bernoulli"]), samples=_bernoulli_calls, dtypes=FLOATS, random=True)(bernoulli)


def _bernoulli_inplace_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((4, 1, 1), dtype, device)
    p = make_tensor((4, 1, 1), dtype, device, low=0.0, high=1.0)
    return [Call((x, 0.8)), Call((x,), note="p=0.5"), Call((x, p), note="tensor p")]


translation(
    torch.Tensor.bernoulli_,
    samples=_bernoulli_inplace_calls,
    dtypes=FLOATS,
    random=True,
    inplace=True,
)(bernoulli_)


# ---------------------------------------------------------------------------------------------
# dropout


def _check_p(p: float) -> None:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def _dropped(input: Value, p: float, mask_shape: Shape) -> Value:
    """Eager's ``input * (bernoulli(1 - p) / (1 - p))``, the noise broadcast over ``input``."""
    if p == 1.0:
        return prims.mul(input, common.convert(0, input.type.dtype))  # NaN stays NaN, as eager
    u = random("uniform", mask_shape, torch.float32, input.type.device)
    keep = prims.convert(prims.lt(u, 1.0 - p), dtype=input.type.dtype)
    noise = common.broadcast_to(div(keep, 1.0 - p), input.type.shape)
    return mul(input, noise)


def dropout(input: Value, p: float = 0.5, training: bool = True, inplace: bool = False) -> Value:
    _check_p(p)
    if not training or p == 0.0:
        return input
    return finish(input, _dropped(input, p, input.type.shape), inplace)


def native_dropout(input: Value, p: float, train: bool) -> Value:
    """``torch.dropout(input, p, train)``."""
    return dropout(input, p, train)


def _feature_dropout(spatial: int, name: str) -> Any:
    """``F.dropout{1,2,3}d``: one draw per channel, for batched (N, C, ...) or unbatched input."""

    def translate(
        input: Value, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> Value:
        _check_p(p)
        rank = input.type.rank
        if rank not in (spatial + 1, spatial + 2) and not (spatial == 2 and rank == 3):
            raise RuntimeError(
                f"{name}: Expected {spatial + 1}D or {spatial + 2}D input, got {rank}D"
            )
        if not training or p == 0.0:
            return input
        # dropout2d reads 3-D input as (N, C, L), as eager does (with a warning).
        batched = rank == spatial + 2 or spatial == 2
        channels = 2 if batched else 1
        mask_shape = tuple(input.type.shape[:channels]) + (1,) * (rank - channels)
        return finish(input, _dropped(input, p, mask_shape), inplace)

    translate.__name__ = translate.__qualname__ = name
    return translate


def _dropout_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(shape: tuple[int, ...] = (64, 16)) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    return [
        Call((x(),), note="default p"),
        Call((x(), 0.2), note="p"),
        Call((x(), 0.0), note="p=0"),
        Call((x(), 1.0), note="p=1"),
        Call((x(), 0.5, False), note="eval"),
        Call((x(), 0.3), {"inplace": True}, note="inplace"),
        Call((x((0, 3)), 0.5), note="0-size"),
    ]


def _native_dropout_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((8, 8), dtype, device)
    return [Call((x, 0.25, True)), Call((x, 0.25, False), note="eval")]


def _feature_dropout_calls(spatial: int) -> CallFn:
    def samples(dtype: torch.dtype, device: torch.device) -> list[Call]:
        batched = (2, 8) + (3,) * spatial
        unbatched = (8,) + (3,) * spatial
        cases = [
            Call((make_tensor(batched, dtype, device), 0.4)),
            Call((make_tensor(batched, dtype, device),), {"training": False}, note="eval"),
        ]
        if spatial != 2:  # eager warns on 3-D dropout2d input
            cases.append(Call((make_tensor(unbatched, dtype, device), 0.4), note="unbatched"))
        return cases

    return samples


translation(F.dropout, samples=_dropout_calls, dtypes=FLOATS, random=True)(dropout)
translation(torch.dropout, samples=_native_dropout_calls, dtypes=FLOATS, random=True)(
    native_dropout
)
for _spatial, _key in ((1, F.dropout1d), (2, F.dropout2d), (3, F.dropout3d)):
    translation(_key, samples=_feature_dropout_calls(_spatial), dtypes=FLOATS, random=True)(
        _feature_dropout(_spatial, _key.__name__)
    )
