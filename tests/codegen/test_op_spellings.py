"""Every elementwise registry row has its target code: a row in each code generator's spelling
table (``triton_math.SPELLINGS``, ``cpp_math.SPELLINGS``) that spells it for every dtype the
row takes. A new op added without its target code fails here, naming the op and the table.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kiln.ops  # noqa: F401  (registers rows)
from kiln.codegen import cpp_math
from kiln.codegen import triton_math as tm
from kiln.ir import Op, OpDef, Tag, registered_ops
from kiln.ops.sampling import FLOATS

ELEMENTWISE = [row for row in registered_ops() if Tag.ELEMENTWISE in row.tags]

# Elementwise ops no spelling table holds, each with the reason.
NOT_SPELLED = {
    # convert(x, dtype) is spelled from its source and target dtypes, not from its operands'
    # dtype: each generator lowers it through its own convert() (triton_math.convert,
    # cpp_math.convert).
    Op.CONVERT,
}

TABLES: dict[str, dict[Op, object]] = {
    "triton_math.SPELLINGS": dict(tm.SPELLINGS),
    "cpp_math.SPELLINGS": dict(cpp_math.SPELLINGS),
}
SPELLED = [row for row in ELEMENTWISE if row.op not in NOT_SPELLED]


def _dtypes(row: OpDef) -> list[torch.dtype]:
    """The operand dtypes a row takes: float64 too where it takes floats (its meta allows it)."""
    extra = {torch.float64} if row.dtypes & FLOATS else set()
    return sorted(row.dtypes | extra, key=str)


def _arity(row: OpDef) -> int:
    assert row.samples is not None
    return len(row.samples(torch.float32, torch.device("cpu"))[0].inputs)


@pytest.mark.parametrize("table", TABLES)
def test_every_elementwise_op_has_a_spelling(table: str) -> None:
    missing = [row.op.name for row in SPELLED if row.op not in TABLES[table]]
    assert not missing, f"elementwise ops without a row in {table}: {missing}"


@pytest.mark.parametrize("table", TABLES)
def test_spelling_tables_hold_only_spelled_elementwise_ops(table: str) -> None:
    """No row for an op that is gone or not elementwise, and the exceptions above stay true."""
    spelled = {row.op for row in SPELLED}
    stray = [op.name for op in TABLES[table] if op not in spelled]
    assert not stray, f"{table} has rows for ops that are not spelled elementwise ops: {stray}"
    gone = [op.name for op in NOT_SPELLED - {row.op for row in ELEMENTWISE}]
    assert not gone, f"NOT_SPELLED lists ops that are no elementwise rows: {gone}"


def _cpp(op: Op, args: list[str], dtype: torch.dtype) -> str:
    return cpp_math.spell(op, args, dtype)


def _triton(interpret: bool) -> Callable[[Op, list[str], torch.dtype], str]:
    def spell(op: Op, args: list[str], dtype: torch.dtype) -> str:
        compute = tm.compute_dtype(dtype)
        operands = tm.Operands(args, compute, compute, [None] * len(args), interpret)
        return tm.SPELLINGS[op](operands)

    return spell


SPELLERS = {
    "cpp_math.SPELLINGS": _cpp,
    "triton_math.SPELLINGS (compiled)": _triton(False),
    "triton_math.SPELLINGS (interpreter)": _triton(True),
}


@pytest.mark.parametrize("row", SPELLED, ids=lambda row: row.op.name)
@pytest.mark.parametrize("target", SPELLERS)
def test_spellings_cover_the_rows_dtypes(target: str, row: OpDef) -> None:
    args = [f"t{i}" for i in range(_arity(row))]  # WHERE: dtype is the values', not the mask's
    for dtype in _dtypes(row):
        try:
            text = SPELLERS[target](row.op, args, dtype)
        except Exception as error:  # any failure: report the op, dtype and table
            pytest.fail(f"{target} cannot spell {row.op.name} for {dtype}: {error!r}")
        assert isinstance(text, str) and text, f"{target}: empty {row.op.name} for {dtype}"
