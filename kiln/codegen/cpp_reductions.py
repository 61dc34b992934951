"""The C++ state of a reduction in a generated kernel: its accumulator variables, the OpenMP
``reduction`` clauses, the update inside an ``r`` loop and the row's value after it
(:mod:`kiln.codegen.cpp` prints the loops around them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.cpp_math import compute_type
from kiln.schedule.loops import Reduce, ReduceKind


@dataclass(eq=False)
class Accumulator:
    """The C++ state of one Reduce: variables before its loop, the update inside, the per-row
    value after it. ``at`` indexes the variables when they are arrays (one slot per row of a
    block, in column reductions)."""

    reduce: Reduce
    name: str
    value_type: str  # the compute type of the reduced values
    acc_type: str

    @property
    def kind(self) -> ReduceKind:
        return self.reduce.kind

    @property
    def is_arg(self) -> bool:
        return self.kind in {ReduceKind.ARGMAX, ReduceKind.ARGMIN}

    @property
    def nan_flag(self) -> bool:
        """Float MAX/MIN keep NaN out of the accumulator and in a flag (simd-reducible)."""
        return self.kind in {ReduceKind.MAX, ReduceKind.MIN} and self.reduce.value.dtype in FLOATS

    def variables(self) -> list[tuple[str, str, str]]:
        """``(type, name, initial value)`` of each variable."""
        acc, kind = self.name, self.kind
        is_float = self.reduce.value.dtype in FLOATS
        if self.is_arg:
            best = extreme(self.value_type, is_float, low=kind is ReduceKind.ARGMAX)
            return [(self.value_type, f"best_{acc}", best), ("int64_t", acc, "0")]
        if kind in {ReduceKind.SUM, ReduceKind.PROD}:
            initial = "0" if kind is ReduceKind.SUM else "1"
        else:
            initial = extreme(self.acc_type, is_float, low=kind is ReduceKind.MAX)
        flag = [("int", f"nan_{acc}", "0")] if self.nan_flag else []
        return [(self.acc_type, acc, initial), *flag]

    def clauses(self) -> list[str]:
        """OpenMP reduction clauses (none for ARGMAX/ARGMIN, which forbid ``omp simd``)."""
        operator = {
            ReduceKind.SUM: "+",
            ReduceKind.PROD: "*",
            ReduceKind.MAX: "max",
            ReduceKind.MIN: "min",
        }.get(self.kind)
        if operator is None:
            return []
        flag = [f"reduction(|:nan_{self.name})"] if self.nan_flag else []
        return [f"reduction({operator}:{self.name})", *flag]

    @property
    def cascades(self) -> bool:
        """Whether a long loop sums into per-chunk partials (:data:`SUM_CHUNK`)."""
        return self.kind is ReduceKind.SUM and self.reduce.dtype.is_floating_point

    def update(self, value: str, at: str = "", into: str = "") -> list[str]:
        """The update of the accumulator (or of ``into``, a chunk's partial) by ``value``."""
        acc, kind = f"{into or self.name}{at}", self.kind
        v = value if self.acc_type == self.value_type else f"({self.acc_type})({value})"
        if kind is ReduceKind.SUM:
            return [f"{acc} += {v};"]
        if kind is ReduceKind.PROD:
            return [f"{acc} *= {v};"]
        if kind in {ReduceKind.MAX, ReduceKind.MIN}:
            compare = ">" if kind is ReduceKind.MAX else "<"
            lines = [f"{acc} = {v} {compare} {acc} ? {v} : {acc};"]
            if self.nan_flag:
                lines.append(f"nan_{acc} |= {value} != {value};")
            return lines
        best = f"best_{acc}"
        wins = f"{value} {'>' if kind is ReduceKind.ARGMAX else '<'} {best}"
        if self.reduce.value.dtype in FLOATS:  # the first NaN is the extreme (torch.argmax)
            wins = f"{wins} || ({value} != {value} && {best} == {best})"
        return [f"if ({wins}) {{ {best} = {value}; {acc} = r; }}"]

    def result(self, at: str = "") -> str:
        acc = f"{self.name}{at}"
        if self.is_arg:
            return acc
        if self.nan_flag:
            return f"nan_{acc} ? NAN : {acc}"
        dtype = self.reduce.dtype
        if dtype == torch.bool:
            return f"{acc} != 0"
        if self.acc_type != compute_type(dtype):
            return f"({compute_type(dtype)})({acc})"
        return acc


# Float sums over long rows add each chunk of SUM_CHUNK elements into a partial, then the
# partials: the rounding error grows with the chunk and the number of chunks, not with the
# row. One running sum over a BatchNorm's 8192 elements per channel (the rows of a symbolic
# size, which reduction_split leaves whole) was ten times less accurate than eager's.
SUM_CHUNK = 256

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def extreme(ctype: str, is_float: bool, low: bool) -> str:
    if is_float:
        return "-INFINITY" if low else "INFINITY"
    if ctype in {"bool", "int"}:  # bool values (accumulated in an int for MAX/MIN)
        return "0" if low else "1"
    limits = {
        "int8_t": ("INT8_MIN", "INT8_MAX"),
        "uint8_t": ("0", "UINT8_MAX"),
        "int16_t": ("INT16_MIN", "INT16_MAX"),
        "int32_t": ("INT32_MIN", "INT32_MAX"),
        "int64_t": ("INT64_MIN", "INT64_MAX"),
    }
    return limits[ctype][0 if low else 1]


def accumulator_type(reduce: Reduce) -> str:
    """Floats accumulate in their compute type (fp32 for 16-bit floats); integer and bool
    sums and products in uint64 (two's-complement wrap, converted at the end)."""
    value_type = compute_type(reduce.value.dtype)
    if reduce.kind in {ReduceKind.SUM, ReduceKind.PROD}:
        if not reduce.dtype.is_floating_point:
            return "uint64_t"
        return compute_type(reduce.dtype)
    if reduce.value.dtype == torch.bool:
        return "int"
    return value_type
