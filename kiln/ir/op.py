"""The op vocabulary of the IR and the registry of op definitions.

The IR defines *which* primitives exist (:class:`Op`) and *what* a definition of one must give
(:class:`OpDef`); ``kiln/ops`` fills one row per op. A row holds what is true of the op on
every target: meta (output types from input types), the reference implementation (eager torch,
the spec), sample inputs for the table-driven tests, tags (what kind of op it is, whether it
is differentiable, whether it is costly) and ``vjp`` (autodiff's rule, in prims).

What needs a later stage's types lives in that stage, in a table keyed by :class:`Op` (the IR
may not import it): how an op becomes loop-level IR (``RULES`` in ``kiln/schedule/lowering.py``;
elementwise ops share one rule) and each code generator's spelling of an elementwise op
(``SPELLINGS`` in ``kiln/codegen/triton_math.py`` and in ``kiln/codegen/cpp_math.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class Op(enum.Enum):
    """Every primitive; its lowercase name is its printed name and its prims function."""

    # elementwise unary
    NEG = enum.auto()
    ABS = enum.auto()
    EXP = enum.auto()
    EXP2 = enum.auto()
    EXPM1 = enum.auto()
    LOG = enum.auto()
    LOG1P = enum.auto()
    LOG2 = enum.auto()
    SQRT = enum.auto()
    RSQRT = enum.auto()
    RECIPROCAL = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    TAN = enum.auto()
    TANH = enum.auto()
    ASIN = enum.auto()
    ACOS = enum.auto()
    ATAN = enum.auto()
    SINH = enum.auto()
    COSH = enum.auto()
    ERF = enum.auto()
    ERFINV = enum.auto()
    SIGMOID = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    ROUND = enum.auto()
    TRUNC = enum.auto()
    SIGN = enum.auto()
    ISNAN = enum.auto()
    ISINF = enum.auto()
    LOGICAL_NOT = enum.auto()
    BITWISE_NOT = enum.auto()
    # elementwise binary
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()
    FLOOR_DIV = enum.auto()
    REMAINDER = enum.auto()
    FMOD = enum.auto()
    POW = enum.auto()
    MAXIMUM = enum.auto()
    MINIMUM = enum.auto()
    ATAN2 = enum.auto()
    EQ = enum.auto()
    NE = enum.auto()
    LT = enum.auto()
    LE = enum.auto()
    GT = enum.auto()
    GE = enum.auto()
    LOGICAL_AND = enum.auto()
    LOGICAL_OR = enum.auto()
    LOGICAL_XOR = enum.auto()
    BITWISE_AND = enum.auto()
    BITWISE_OR = enum.auto()
    BITWISE_XOR = enum.auto()
    SHIFT_LEFT = enum.auto()
    SHIFT_RIGHT = enum.auto()
    # elementwise ternary and conversion
    WHERE = enum.auto()
    CONVERT = enum.auto()
    # reductions
    SUM = enum.auto()
    PROD = enum.auto()
    AMAX = enum.auto()
    AMIN = enum.auto()
    ARGMAX = enum.auto()
    ARGMIN = enum.auto()
    # movement
    RESHAPE = enum.auto()
    PERMUTE = enum.auto()
    BROADCAST = enum.auto()
    EXPAND = enum.auto()
    SLICE = enum.auto()
    SQUEEZE = enum.auto()
    UNSQUEEZE = enum.auto()
    CAT = enum.auto()
    PAD = enum.auto()
    FLIP = enum.auto()
    GATHER = enum.auto()
    SCATTER = enum.auto()
    SCATTER_ADD = enum.auto()
    INDEX = enum.auto()
    INDEX_PUT = enum.auto()
    # creation
    FULL = enum.auto()
    IOTA = enum.auto()
    RANDOM_UNIFORM = enum.auto()
    RANDOM_NORMAL = enum.auto()
    # externs: run by PyTorch kernels
    MM = enum.auto()
    BMM = enum.auto()
    ADDMM = enum.auto()
    BADDBMM = enum.auto()
    CONVOLUTION = enum.auto()
    SDPA = enum.auto()
    CUMSUM = enum.auto()
    SORT = enum.auto()
    TOPK = enum.auto()
    EXTERN = enum.auto()

    @property
    def printed_name(self) -> str:
        return self.name.lower()


class Tag(enum.Enum):
    ELEMENTWISE = "elementwise"
    UNARY = "unary"
    BINARY = "binary"
    COMPARISON = "comparison"
    REDUCTION = "reduction"
    MOVEMENT = "movement"
    INDEXING = "indexing"
    CREATION = "creation"
    RANDOM = "random"
    EXTERN = "extern"
    NONDIFFERENTIABLE = "nondifferentiable"  # outputs never require grad (bool, int, indices)
    # costly per element (exp, log, ...): the scheduler counts it as several ops when deciding
    # whether recomputing a value in each reader is cheaper than storing it
    TRANSCENDENTAL = "transcendental"


@dataclass
class Sample:
    """One test case of an op: operands (tensors, scalars, None) and attributes."""

    inputs: tuple[Any, ...]
    attrs: Any = None
    note: str = ""


# meta(attrs, *operand_types) -> output types, where an operand type is a TensorType, a Python
# scalar or None. impl(attrs, *operands) -> tensor or tuple of tensors.
MetaFn = Callable[..., Any]
ImplFn = Callable[..., Any]
SampleFn = Callable[[torch.dtype, torch.device], Sequence[Sample]]


@dataclass
class OpDef:
    """One registry row: everything Kiln knows about one primitive."""

    op: Op
    meta: MetaFn
    impl: ImplFn
    attrs: type | None = None
    tags: frozenset[Tag] = frozenset()
    dtypes: frozenset[torch.dtype] = frozenset()  # dtypes the samples cover
    samples: SampleFn | None = None
    vjp: Callable[..., Any] | None = None  # reverse-mode rule in prims (kiln/autodiff applies it)
    doc: str = ""


_REGISTRY: dict[Op, OpDef] = {}


def register(definition: OpDef) -> OpDef:
    if definition.op in _REGISTRY:
        raise ValueError(f"op {definition.op.name} is registered twice")
    _REGISTRY[definition.op] = definition
    return definition


def op_def(op: Op) -> OpDef:
    """The registry row of ``op``. Rows are registered by importing ``kiln.ops``."""
    try:
        return _REGISTRY[op]
    except KeyError:
        raise KeyError(f"op {op.name} has no registry row (is kiln.ops imported?)") from None


def registered_ops() -> list[OpDef]:
    return list(_REGISTRY.values())
