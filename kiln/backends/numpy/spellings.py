"""The numpy backend's capability table: each prim it runs, spelled as a NumPy expression.

A row is either a ufunc name (``UFUNCS``: the kernel generator may pass it an ``out=`` buffer
to reuse) or a function of the node's attributes and operand expressions (``EXPRESSIONS``).
What is in neither table, a dtype NumPy lacks (bfloat16) and the cases ``refuse`` names run
on the default backend. Adding an op to the backend is adding its row here::

    >>> spell(add_node, ["v_x", "v_y"])
    'np.add(v_x, v_y)'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.backends.registry import Capabilities
from kiln.ir.graph import Node
from kiln.ir.op import Op, Tag, op_def

DTYPES: dict[torch.dtype, str] = {
    torch.bool: "bool_",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
}
NUMPY_DTYPES = {dtype: np.dtype(getattr(np, name)) for dtype, name in DTYPES.items()}

# Ops whose NumPy ufunc has the prim's name.
SAME_NAMES: tuple[Op, ...] = (
    Op.EXP,
    Op.EXP2,
    Op.EXPM1,
    Op.LOG,
    Op.LOG1P,
    Op.LOG2,
    Op.SQRT,
    Op.SIN,
    Op.COS,
)
SAME_NAMES += (Op.TAN, Op.TANH, Op.SINH, Op.COSH, Op.FLOOR, Op.CEIL, Op.TRUNC, Op.ISNAN)
SAME_NAMES += (Op.ISINF, Op.LOGICAL_NOT, Op.ADD, Op.MAXIMUM, Op.MINIMUM, Op.FMOD, Op.REMAINDER)
SAME_NAMES += (Op.LOGICAL_AND, Op.LOGICAL_OR, Op.LOGICAL_XOR, Op.BITWISE_AND, Op.BITWISE_OR)
SAME_NAMES += (Op.BITWISE_XOR,)
UFUNCS: dict[Op, str] = {op: op.printed_name for op in SAME_NAMES} | {
    Op.NEG: "negative",
    Op.ABS: "absolute",
    Op.ASIN: "arcsin",
    Op.ACOS: "arccos",
    Op.ATAN: "arctan",
    Op.BITWISE_NOT: "invert",
    Op.SUB: "subtract",
    Op.MUL: "multiply",
    Op.DIV: "true_divide",
    Op.FLOOR_DIV: "floor_divide",
    Op.POW: "power",
    Op.ATAN2: "arctan2",
    Op.EQ: "equal",
    Op.NE: "not_equal",
    Op.LT: "less",
    Op.LE: "less_equal",
    Op.GT: "greater",
    Op.GE: "greater_equal",
}

Spelling = Callable[[Any, list[str], Node], str]


def _dtype(dtype: torch.dtype) -> str:
    return f"np.{DTYPES[dtype]}"


def _reduce(function: str) -> Spelling:
    """SUM and PROD in the result's dtype (NumPy widens int32); a float16 SUM accumulates in
    float32, as PyTorch's CPU kernel does (PROD does not)."""

    def spelling(attrs: Any, args: list[str], node: Node) -> str:
        dtype = node.output.type.dtype
        if function == "sum" and dtype == torch.float16:
            return f"np.sum({args[0]}, axis={attrs.dims}, dtype=np.float32).astype(np.float16)"
        return f"np.{function}({args[0]}, axis={attrs.dims}, dtype={_dtype(dtype)})"

    return spelling


def _broadcast(attrs: Any, args: list[str], node: Node) -> str:
    """broadcast_in_dim: place the input's dims at ``attrs.dims``, then broadcast."""
    shape = [1] * len(attrs.shape)
    for dim, size in zip(attrs.dims, node.inputs[0].type.shape, strict=True):  # type: ignore[union-attr]
        shape[dim] = size
    return f"np.broadcast_to(np.reshape({args[0]}, {tuple(shape)}), {tuple(attrs.shape)})"


def _slice(attrs: Any, args: list[str], node: Node) -> str:
    index = ":, " * attrs.dim + f"{attrs.start}:{attrs.stop}:{attrs.step}"
    return f"{args[0]}[{index}]"


def _gemm(attrs: Any, args: list[str], node: Node) -> str:
    bias, product = args[0], f"np.matmul({args[1]}, {args[2]})"
    scaled = product if attrs.alpha == 1 else f"{literal(attrs.alpha)} * {product}"
    if attrs.beta == 0:  # PyTorch ignores the bias then, NaNs included
        return scaled
    return f"{bias if attrs.beta == 1 else f'{literal(attrs.beta)} * {bias}'} + {scaled}"


def _pad(attrs: Any, args: list[str], node: Node) -> str:
    widths = tuple(zip(attrs.low, attrs.high, strict=True))
    return f"np.pad({args[0]}, {widths}, constant_values={literal(attrs.value)})"


EXPRESSIONS: dict[Op, Spelling] = {
    Op.RSQRT: lambda attrs, a, node: f"1 / np.sqrt({a[0]})",
    Op.RECIPROCAL: lambda attrs, a, node: f"1 / {a[0]}",
    Op.ROUND: lambda attrs, a, node: (  # half to even, as torch.round; integers unchanged
        f"np.rint({a[0]})" if node.output.type.dtype.is_floating_point else f"np.array({a[0]})"
    ),
    Op.SIGMOID: lambda attrs, a, node: f"1 / (1 + np.exp(-{a[0]}))",
    Op.SIGN: lambda attrs, a, node: (
        f"np.array({a[0]})" if node.output.type.dtype == torch.bool else f"np.sign({a[0]})"
    ),
    Op.SHIFT_LEFT: lambda attrs, a, node: f"np.left_shift({a[0]}, {a[1]})",
    Op.SHIFT_RIGHT: lambda attrs, a, node: f"np.right_shift({a[0]}, {a[1]})",
    Op.WHERE: lambda attrs, a, node: f"np.where({a[0]}, {a[1]}, {a[2]})",
    Op.CONVERT: lambda attrs, a, node: f"np.asarray({a[0]}).astype({_dtype(attrs.dtype)})",
    Op.SUM: _reduce("sum"),
    Op.PROD: _reduce("prod"),
    Op.AMAX: lambda attrs, a, node: f"np.amax({a[0]}, axis={attrs.dims})",
    Op.AMIN: lambda attrs, a, node: f"np.amin({a[0]}, axis={attrs.dims})",
    Op.ARGMAX: lambda attrs, a, node: f"np.argmax({a[0]}, axis={attrs.dim})",
    Op.ARGMIN: lambda attrs, a, node: f"np.argmin({a[0]}, axis={attrs.dim})",
    Op.RESHAPE: lambda attrs, a, node: f"np.reshape({a[0]}, {tuple(attrs.shape)})",
    Op.PERMUTE: lambda attrs, a, node: f"np.transpose({a[0]}, {attrs.dims})",
    Op.BROADCAST: _broadcast,
    Op.EXPAND: lambda attrs, a, node: f"np.broadcast_to({a[0]}, {tuple(attrs.shape)})",
    Op.SLICE: _slice,
    Op.SQUEEZE: lambda attrs, a, node: f"np.squeeze({a[0]}, axis={attrs.dims})",
    Op.UNSQUEEZE: lambda attrs, a, node: f"np.expand_dims({a[0]}, {attrs.dims})",
    Op.FLIP: lambda attrs, a, node: f"np.flip({a[0]}, {attrs.dims})",
    Op.CAT: lambda attrs, a, node: f"np.concatenate([{', '.join(a)}], axis={attrs.dim})",
    Op.PAD: _pad,
    Op.FULL: lambda attrs, a, node: (
        f"np.full({tuple(attrs.shape)}, {literal(attrs.value)}, dtype={_dtype(attrs.dtype)})"
    ),
    Op.IOTA: lambda attrs, a, node: (
        f"({literal(attrs.start)} + {literal(attrs.step)}"
        f" * np.arange({attrs.length})).astype({_dtype(attrs.dtype)})"
    ),
    Op.MM: lambda attrs, a, node: f"np.matmul({a[0]}, {a[1]})",
    Op.BMM: lambda attrs, a, node: f"np.matmul({a[0]}, {a[1]})",
    Op.ADDMM: _gemm,
    Op.BADDBMM: _gemm,
}

# Views NumPy makes without copying: free inside a fused kernel, like elementwise ops.
VIEWS = frozenset({Op.RESHAPE, Op.PERMUTE, Op.BROADCAST, Op.EXPAND, Op.SLICE, Op.SQUEEZE})
VIEWS |= {Op.UNSQUEEZE, Op.FLIP}


def fusible(node: Node) -> bool:
    """Whether ``node`` joins a fused elementwise kernel (an elementwise op or a free view)."""
    return Tag.ELEMENTWISE in op_def(node.op).tags or node.op in VIEWS


def literal(value: Any) -> str:
    """A Python scalar as source: NumPy computes in the array's dtype with it (NEP 50)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    return repr(value)


def spell(node: Node, args: list[str]) -> str:
    """The NumPy expression computing ``node`` from its operands' expressions."""
    if node.op in UFUNCS:
        return f"np.{UFUNCS[node.op]}({', '.join(args)})"
    return EXPRESSIONS[node.op](node.attrs, args, node)


def refuse(node: Node) -> str:
    """Cases of supported ops NumPy does not compute as PyTorch does."""
    if node.op is Op.PAD and any(w < 0 for w in (*node.attrs.low, *node.attrs.high)):
        return "negative padding (a crop) not supported"
    if node.op is Op.PAD and not node.attrs.low:
        return "padding a 0-d tensor not supported"
    if node.op is Op.PAD and any(node.attrs.interior):
        return "interior padding not supported"
    if node.op in (Op.ARGMAX, Op.ARGMIN) and node.inputs[0].type.rank == 0:  # type: ignore[union-attr]
        return "arg-reduction of a 0-d tensor not supported"
    return ""


CAPABILITIES = Capabilities(
    ops=frozenset(UFUNCS) | frozenset(EXPRESSIONS), dtypes=frozenset(DTYPES), refuse=refuse
)
