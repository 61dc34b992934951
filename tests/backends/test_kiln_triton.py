"""The op table through the ``kiln`` backend's Triton code generator (on CPU tensors:
Triton's interpreter), against every row's reference implementation."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import Op
from tests.backends.op_table import ROW_IDS, ROWS, check_row

pytest.importorskip("triton")


@pytest.mark.parametrize(("op", "dtype"), ROWS, ids=ROW_IDS)
def test_row(op: Op, dtype: torch.dtype) -> None:
    check_row(op, dtype, "triton")
