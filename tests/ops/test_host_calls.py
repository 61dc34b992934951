"""The host program's unchecked extern calls match their registry rows' implementations."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.op import Op, op_def
from kiln.ops.attrs import ConvolutionAttrs, GemmAttrs
from kiln.ops.host_calls import host_call


def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


CASES = [
    (Op.MM, None, lambda: (_random(3, 4), _random(4, 5))),
    (Op.BMM, None, lambda: (_random(2, 3, 4), _random(2, 4, 5))),
    (Op.ADDMM, GemmAttrs(), lambda: (_random(5), _random(3, 4), _random(4, 5))),
    (Op.ADDMM, GemmAttrs(-0.5, 2.0), lambda: (_random(3, 5), _random(3, 4), _random(4, 5))),
    (Op.BADDBMM, GemmAttrs(2, 3), lambda: (_random(3, 5), _random(2, 3, 4), _random(2, 4, 5))),
    (
        Op.CONVOLUTION,
        ConvolutionAttrs(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
        lambda: (_random(2, 4, 7, 9), _random(6, 2, 3, 3), _random(6)),
    ),
    (
        Op.CONVOLUTION,
        ConvolutionAttrs((2,), (1,), (1,), transposed=True, output_padding=(1,)),
        lambda: (_random(2, 3, 5), _random(3, 4, 3), None),
    ),
]


@pytest.mark.parametrize(("op", "attrs", "make"), CASES)
def test_host_call_matches_the_row(op: Op, attrs: object, make: object) -> None:
    operands = make()  # type: ignore[operator]
    call = host_call(op, attrs)
    assert call is not None
    torch.testing.assert_close(call(*operands), op_def(op).impl(attrs, *operands))


def test_other_ops_keep_their_rows() -> None:
    assert host_call(Op.SDPA, None) is None
