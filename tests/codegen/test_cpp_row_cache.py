"""The C++ generator keeps a row-shaped transcendental two loops need (softmax's exp) in a
per-row array, so it runs once per element, with unchanged results."""

from __future__ import annotations

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.codegen.cpp import generate_cpp
from kiln.recording import listen, unlisten


def test_softmax_computes_each_exp_once() -> None:
    records: list = []
    listen(records, CompiledProgramRecord)
    try:
        x = torch.randn(6, 300)
        result = kiln.compile(lambda x: torch.softmax(x * 3, -1), options={"codegen": "cpp"})(x)
    finally:
        unlisten(records)
    torch.testing.assert_close(result, torch.softmax(x * 3, -1))
    (kernel,) = records[-1].program.kernels()
    source = generate_cpp([kernel])
    body = source.split('extern "C"')[-1]
    assert body.count("expf(") == 1  # the sum's loop computes it, the store's loop reads it
    assert "row0[r] = " in body and "= row0[r];" in body
