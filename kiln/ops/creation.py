"""Registry rows of the creation prims: ``full``, ``iota``, ``random_uniform``, ``random_normal``.

``full`` and ``iota`` take no operands, only attributes; inside a ``GraphBuilder`` they still
become nodes (see ``kiln.ops.prims.call``). The random prims take the graph's int64 seed as
their one operand, and their numbers are a pure function of (seed value, ``offset``), so a
backward pass or a replay regenerates exactly the same tensor::

    t0 = full(shape=(2, 3), value=0.5, dtype=torch.float32, device=torch.device('cpu'))
    t1 = iota(length=4, start=0, step=2, dtype=torch.int64, device=torch.device('cpu'))
    t2 = random_normal(rng_seed, shape=(8,), dtype=torch.float16, device=..., offset=16)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from kiln.ir.op import Op, OpDef, Sample, Tag, register
from kiln.ir.symbolic import Sym
from kiln.ir.types import FLOATING, Scalar, Shape, TensorType, concrete
from kiln.ops.attrs import FullAttrs, IotaAttrs, RandomAttrs
from kiln.ops.sampling import ALL, FLOATS, NUMERIC, make_tensor

SHAPES: tuple[tuple[int, ...], ...] = ((2, 3), (), (0, 4), (1,), (2, 1, 3))

# The random stream of (seed, offset) starts from this seed of a torch.Generator: an LCG step
# spreads neighbouring seeds apart, and the offset selects a stream of its own.
_SEED_MULTIPLIER = 6364136223846793005
_SEED_MODULUS = 2**63


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_shape(op: Op, shape: Shape) -> None:
    for size in shape:
        if not isinstance(size, int | Sym) or isinstance(size, bool):
            raise TypeError(f"{op.printed_name}: size {size!r} in {list(shape)} is not an int")
        if size < 0:
            raise RuntimeError(f"{op.printed_name}: negative dimension {size} in {list(shape)}")


def _sizes(shape: Shape) -> tuple[int, ...]:
    """The sizes of a shape, ints by the time it runs (the pipeline specializes a graph first)."""
    sizes = tuple(size for size in shape if isinstance(size, int))
    if len(sizes) != len(shape):
        raise NotImplementedError(f"a creation op of symbolic shape {shape} cannot run")
    return sizes


def _check_scalar(op: Op, value: Scalar | Sym, dtype: torch.dtype) -> None:
    """A float value needs a floating dtype (prims never truncate silently); a symbolic size
    counts as an int."""
    if not isinstance(value, bool | int | float | Sym):
        raise TypeError(f"{op.printed_name}: {value!r} is not a Python scalar")
    if isinstance(value, float) and not dtype.is_floating_point:
        raise TypeError(f"{op.printed_name}: float value {value!r} for a {_name(dtype)} tensor")


def _creation(
    op: Op,
    meta: Callable[..., TensorType],
    impl: Callable[..., torch.Tensor],
    attrs: type,
    dtypes: frozenset[torch.dtype],
    samples: Callable[[torch.dtype, torch.device], list[Sample]],
    doc: str,
    tags: frozenset[Tag] = frozenset(),
) -> OpDef:
    return register(
        OpDef(
            op,
            meta=meta,
            impl=impl,
            attrs=attrs,
            tags=frozenset({Tag.CREATION, Tag.NONDIFFERENTIABLE}) | tags,
            dtypes=dtypes,
            samples=samples,
            doc=doc,
        )
    )


# ---------------------------------------------------------------------------------------------
# full


def _full_meta(attrs: FullAttrs) -> TensorType:
    _check_shape(Op.FULL, attrs.shape)
    _check_scalar(Op.FULL, attrs.value, attrs.dtype)
    return TensorType(tuple(attrs.shape), attrs.dtype, attrs.device)


def _full_impl(attrs: FullAttrs) -> torch.Tensor:
    value = cast(Scalar, attrs.value)  # (a graph that runs has no symbolic sizes left)
    return torch.full(_sizes(attrs.shape), value, dtype=attrs.dtype, device=attrs.device)


def _random_scalar(dtype: torch.dtype) -> Scalar:
    value = make_tensor((), dtype).item()
    return round(value, 3) if isinstance(value, float) else value


def _full_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    cases = [Sample((), FullAttrs(shape, _random_scalar(dtype), dtype, device)) for shape in SHAPES]
    if dtype.is_floating_point:
        cases.append(Sample((), FullAttrs((2, 2), float("-inf"), dtype, device), note="-inf"))
        cases.append(Sample((), FullAttrs((3,), 2, dtype, device), note="int value"))
    if dtype == torch.bool:
        cases += [Sample((), FullAttrs((2,), value, dtype, device)) for value in (True, False)]
    return cases


_creation(
    Op.FULL,
    _full_meta,
    _full_impl,
    FullAttrs,
    ALL,
    _full_samples,
    "full(shape, value, dtype, device): a tensor filled with value",
)


# ---------------------------------------------------------------------------------------------
# iota


def _iota_meta(attrs: IotaAttrs) -> TensorType:
    length = attrs.length
    if not isinstance(length, int | Sym) or isinstance(length, bool) or length < 0:
        raise RuntimeError(f"iota: length must be a non-negative size, got {length!r}")
    if attrs.dtype not in NUMERIC | FLOATING:
        raise TypeError(f"iota: {_name(attrs.dtype)} is not supported (takes numbers)")
    _check_scalar(Op.IOTA, attrs.start, attrs.dtype)
    _check_scalar(Op.IOTA, attrs.step, attrs.dtype)
    return TensorType((attrs.length,), attrs.dtype, attrs.device)


def _iota_impl(attrs: IotaAttrs) -> torch.Tensor:
    # Exact in int64, or float64 rounded once to the dtype (what torch.arange does for float32).
    wide = torch.float64 if attrs.dtype.is_floating_point else torch.int64
    index = torch.arange(concrete(attrs.length), dtype=wide, device=attrs.device)
    return (attrs.start + attrs.step * index).to(attrs.dtype)


def _iota_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    start, step = _random_scalar(dtype), _random_scalar(dtype)
    cases = [(5, start, step), (0, start, step), (1, start, step), (7, 0, 1), (4, 3, -2)]
    return [Sample((), IotaAttrs(n, a, s, dtype, device)) for n, a, s in cases]


_creation(
    Op.IOTA,
    _iota_meta,
    _iota_impl,
    IotaAttrs,
    NUMERIC,
    _iota_samples,
    "iota(length, start, step, dtype, device): start + step * arange(length)",
)


# ---------------------------------------------------------------------------------------------
# random_uniform, random_normal


def _random_meta(op: Op) -> Callable[[RandomAttrs, TensorType], TensorType]:
    def meta(attrs: RandomAttrs, seed: TensorType) -> TensorType:
        if not isinstance(seed, TensorType) or seed.dtype != torch.int64:
            raise TypeError(f"{op.printed_name}: the seed must be an int64 tensor, got {seed}")
        if seed.shape != ():
            raise RuntimeError(f"{op.printed_name}: the seed must be 0-d, got {list(seed.shape)}")
        if attrs.dtype not in FLOATING:
            raise TypeError(f"{op.printed_name}: makes floats, not {_name(attrs.dtype)}")
        _check_shape(op, attrs.shape)
        return TensorType(tuple(attrs.shape), attrs.dtype, attrs.device)

    return meta


def generator_for(seed: int, offset: int, device: torch.device) -> torch.Generator:
    """The generator whose stream is the random numbers of ``(seed, offset)`` on ``device``."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MULTIPLIER + offset) % _SEED_MODULUS)
    return generator


def _below_one(values: torch.Tensor) -> torch.Tensor:
    """Uniform numbers drawn in float32 may round up to 1.0 in a narrower dtype: keep [0, 1)."""
    largest = 1.0 - torch.finfo(values.dtype).eps / 2
    return values.clamp_(max=largest)


def _random_impl(
    draw: Callable[..., torch.Tensor], finish: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[RandomAttrs, torch.Tensor], torch.Tensor]:
    def impl(attrs: RandomAttrs, seed: torch.Tensor) -> torch.Tensor:
        generator = generator_for(int(seed), concrete(attrs.offset), attrs.device)
        # Drawn in float32 whatever the dtype, so one seed gives the same numbers in every dtype.
        values = draw(
            _sizes(attrs.shape), generator=generator, device=attrs.device, dtype=torch.float32
        )
        return finish(values.to(attrs.dtype))

    return impl


def _random_samples(dtype: torch.dtype, device: torch.device) -> list[Sample]:
    shapes = ((1000,), (3, 4), (), (0, 3), (2, 1, 5))
    return [
        Sample(
            (torch.randint(-(2**62), 2**62, (), dtype=torch.int64, device=device),),
            RandomAttrs(shape, dtype, device, offset=int(torch.randint(0, 2**20, ()))),
        )
        for shape in shapes
    ]


_RANDOM_TAGS = frozenset({Tag.RANDOM})
_creation(
    Op.RANDOM_UNIFORM,
    _random_meta(Op.RANDOM_UNIFORM),
    _random_impl(torch.rand, _below_one),
    RandomAttrs,
    FLOATS,
    _random_samples,
    "random_uniform(seed, shape, dtype, device, offset): uniform in [0, 1)",
    _RANDOM_TAGS,
)
_creation(
    Op.RANDOM_NORMAL,
    _random_meta(Op.RANDOM_NORMAL),
    _random_impl(torch.randn, lambda values: values),
    RandomAttrs,
    FLOATS,
    _random_samples,
    "random_normal(seed, shape, dtype, device, offset): standard normal",
    _RANDOM_TAGS,
)
