"""Dtype conversions and copies in prims: ``Tensor.to``, ``float()``/``half()``/... , ``type_as``,
``detach``, ``clone``, ``copy_``, ``cpu()`` (``contiguous`` lives with the shape translations).

Values are immutable, so a copy (``clone``) or a conversion to the same dtype is the value
itself. A conversion is one ``convert``::

    x.to(torch.float16)        # x: f32[3]
    t1 = convert(x, dtype=torch.float16)

A move to another device stays a PyTorch call (kiln graphs live on one device).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.ir.graph import Value
from kiln.ops import prims
from kiln.ops.sampling import ALL, make_tensor
from kiln.ops.translations import common
from kiln.ops.translations.creation import device_of
from kiln.ops.translations.table import Call, FallbackToExtern, translation

DeviceLike = torch.device | str | int


def same_device(device: DeviceLike, current: torch.device) -> bool:
    """Whether ``device`` names ``current`` (``"cuda"`` names the current CUDA device)."""
    target = device_of(device, current)
    if target.type != current.type:
        return False
    if target.index is None or current.index is None:
        index = torch.cuda.current_device() if target.type == "cuda" else None
        return (target.index if target.index is not None else index) == (
            current.index if current.index is not None else index
        )
    return target.index == current.index


def _converted(x: Value, dtype: torch.dtype | None, device: DeviceLike | None) -> Value:
    if device is not None and not same_device(device, x.type.device):
        raise FallbackToExtern  # a move between devices: PyTorch does it
    return common.convert(x, dtype or x.type.dtype)


def to(self: Value, *args: Any, **kwargs: Any) -> Value:
    """``to(dtype)``, ``to(device, dtype)``, ``to(other)``; ``copy``, ``non_blocking`` and
    ``memory_format`` change nothing for immutable values."""
    dtype: torch.dtype | None = kwargs.get("dtype")
    device: DeviceLike | None = kwargs.get("device")
    positional = list(args)
    if positional and isinstance(positional[0], Value):
        other = positional.pop(0)
        dtype, device = other.type.dtype, other.type.device
    elif positional and isinstance(positional[0], torch.dtype):
        dtype = positional.pop(0)
    elif positional and isinstance(positional[0], DeviceLike):
        device = positional.pop(0)
        if positional and isinstance(positional[0], torch.dtype):
            dtype = positional.pop(0)
    return _converted(self, dtype, device)


def _to_dtype(name: str, dtype: torch.dtype) -> Any:
    def translate(self: Value, memory_format: Any = None) -> Value:
        return _converted(self, dtype, None)

    translate.__name__ = translate.__qualname__ = name
    return translate


def type_as(self: Value, other: Value) -> Value:
    return _converted(self, other.type.dtype, None)


def cpu(self: Value, memory_format: Any = None) -> Value:
    return _converted(self, None, "cpu")


def detach(self: Value) -> Value:
    """The same numbers without autograd history: a ``convert`` to the same dtype, emitted with
    grad disabled so its result does not require grad."""
    with torch.no_grad():
        result = prims.convert(self, dtype=self.type.dtype)
    return result


def clone(self: Value, *, memory_format: Any = None) -> Value:
    """A copy: a same-dtype ``convert`` node, so the result never aliases ``self`` when it leaves
    the graph (returning ``self`` would hand the caller its own input tensor back)."""
    return prims.convert(self, dtype=self.type.dtype)


_TYPE_NAMES = {
    f"torch.{name}": dtype
    for name, dtype in (
        ("FloatTensor", torch.float32),
        ("DoubleTensor", torch.float64),
        ("HalfTensor", torch.float16),
        ("BFloat16Tensor", torch.bfloat16),
        ("LongTensor", torch.int64),
        ("IntTensor", torch.int32),
        ("ShortTensor", torch.int16),
        ("CharTensor", torch.int8),
        ("ByteTensor", torch.uint8),
        ("BoolTensor", torch.bool),
    )
}


def type_(self: Value, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Value:
    """``x.type(torch.float16)`` or ``x.type("torch.HalfTensor")``: a conversion. (``x.type()``
    with no argument returns a string and is answered by the frontend.)"""
    if isinstance(dtype, str):
        if dtype not in _TYPE_NAMES:
            raise FallbackToExtern(dtype)
        dtype = _TYPE_NAMES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise FallbackToExtern(dtype)
    return _converted(self, dtype, None)


def _type_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((3, 4), dtype, device)
    return [Call((x, torch.float16)), Call((x, "torch.LongTensor")), Call((x, torch.bool))]


def copy_(self: Value, src: Value, non_blocking: bool = False) -> Value:
    """``self.copy_(src)``: ``src`` broadcast to ``self``'s shape and cast to its dtype."""
    if not same_device(src.type.device, self.type.device):
        raise FallbackToExtern
    converted = common.convert(src, self.type.dtype)
    return common.broadcast_to(converted, self.type.shape)


# ---------------------------------------------------------------------------------------------
# registration

_TARGETS = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool)


def _to_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
        return make_tensor(shape, dtype, device)

    cases = [Call((x(), target), note=str(target)) for target in _TARGETS]
    return [
        *cases,
        Call((x(),), {"dtype": torch.int32}, note="dtype="),
        Call((x(), "cpu"), note="device"),
        Call((x(), device, torch.float16), note="device, dtype"),
        Call((x(),), {"device": device, "dtype": torch.float32}, note="keywords"),
        Call((x(), make_tensor((2,), torch.float16, device)), note="other"),
        Call((x(), dtype), {"copy": True, "non_blocking": True}, note="copy"),
        Call((x((0, 2)), torch.float32), note="0-size"),
    ]


def _self_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    return [Call((make_tensor(shape, dtype, device),)) for shape in ((3, 4), (), (0, 3))]


def _type_as_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    x = make_tensor((3, 4), dtype, device)
    return [Call((x, make_tensor((2,), target, device)), note=str(target)) for target in _TARGETS]


def _copy_calls(dtype: torch.dtype, device: torch.device) -> list[Call]:
    def x(shape: tuple[int, ...], kind: torch.dtype = dtype) -> torch.Tensor:
        return make_tensor(shape, kind, device)

    return [
        Call((x((3, 4)), x((3, 4)))),
        Call((x((3, 4)), x((4,))), note="broadcast"),
        Call((x((3, 4)), x((3, 1), torch.float32)), note="float32 source"),
        Call((x((2, 3)), x((2, 3), torch.int64)), note="int64 source"),
        Call((x(()), x(())), note="0-d"),
    ]


translation(torch.Tensor.to, samples=_to_calls, dtypes=ALL)(to)
for _name, _dtype in (
    ("float", torch.float32),
    ("half", torch.float16),
    ("bfloat16", torch.bfloat16),
    ("double", torch.float64),
    ("int", torch.int32),
    ("long", torch.int64),
    ("bool", torch.bool),
    ("short", torch.int16),
    ("char", torch.int8),
    ("byte", torch.uint8),
):
    translation(getattr(torch.Tensor, _name), samples=_self_calls, dtypes=ALL)(
        _to_dtype(_name, _dtype)
    )
translation(torch.Tensor.type_as, samples=_type_as_calls, dtypes=ALL)(type_as)
translation(torch.Tensor.cpu, samples=_self_calls, dtypes=ALL)(cpu)
translation(torch.detach, torch.Tensor.detach, samples=_self_calls, dtypes=ALL, view=True)(detach)
translation(torch.Tensor.detach_, samples=_self_calls, dtypes=ALL, inplace=True)(detach)
translation(torch.clone, torch.Tensor.clone, samples=_self_calls, dtypes=ALL)(clone)
translation(torch.Tensor.type, samples=_type_calls, dtypes=ALL)(type_)
translation(torch.Tensor.copy_, samples=_copy_calls, dtypes=ALL, inplace=True)(copy_)
