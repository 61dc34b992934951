"""The scheduler checked apart from any code generator: the op table and fused programs run
through the loop-level IR's PyTorch evaluator must equal the reference interpreter exactly."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import Op, Tag, op_def
from tests.backends.op_table import ROW_IDS, ROWS, check_row


@pytest.mark.parametrize(("op", "dtype"), ROWS, ids=ROW_IDS)
def test_row(op: Op, dtype: torch.dtype) -> None:
    if Tag.RANDOM in op_def(op).tags:
        pytest.skip("the evaluator has no random numbers (the code generators' Philox)")
    # Reductions may reduce in another order than eager: float results agree to rounding. So
    # may convolutions: an NCHW input is copied channels-last for them, and oneDNN accumulates
    # in another order there.
    accumulates = Tag.REDUCTION in op_def(op).tags or op is Op.CONVOLUTION
    check_row(op, dtype, "evaluate", exact=not accumulates)
