"""Table-driven test of every translation x every key x every dtype it declares, on CPU.

Each sample call is traced, the graph verified and interpreted, and the result compared with
the eager call on the same fresh random inputs; in-place keys compare the mutated argument too.
A translation may not fall back to an extern node on its own samples.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import kiln.ops  # noqa: F401  (registers translations)
from kiln.frontends import run_traced, trace
from kiln.ir import Op
from kiln.ops.translations import Call, Translation, api_name, entries

CASES = [
    (entry, key, dtype)
    for entry in entries()
    for key in entry.keys
    for dtype in sorted(entry.dtypes, key=str)
]


def _id(case: tuple[Translation, Any, torch.dtype]) -> str:
    _, key, dtype = case
    return f"{api_name(key)}-{str(dtype).removeprefix('torch.')}"


TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _close(actual: Any, expected: Any, dtype: torch.dtype, entry: Translation) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        rtol, atol = entry.tolerance or TOLERANCE.get(dtype, (1.3e-6, 1e-5))
        if entry.random:
            return
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _close(a, e, dtype, entry)
    else:
        assert actual == expected


def _split(call: Call) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)], (leaves, spec)


def _rebuild(
    tensors: tuple[torch.Tensor, ...], layout: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    leaves, spec = layout
    supply = iter(tensors)
    filled = [next(supply) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    args, kwargs = pytree.tree_unflatten(filled, spec)
    return args, kwargs


@pytest.mark.parametrize(("entry", "key", "dtype"), CASES, ids=[_id(c) for c in CASES])
def test_translation(entry: Translation, key: Any, dtype: torch.dtype) -> None:
    assert entry.samples is not None, f"{entry.name} has no samples"
    calls = entry.samples(dtype, torch.device("cpu"))
    assert calls, f"{entry.name} has no samples for {dtype}"
    for call in calls:
        tensors, layout = _split(call)

        def program(*inputs: torch.Tensor, layout: Any = layout) -> Any:
            args, kwargs = _rebuild(inputs, layout)
            return key(*args, **kwargs)

        eager_inputs = [t.clone() for t in tensors]
        expected = program(*eager_inputs)
        graph = trace(program, *[t.clone() for t in tensors])
        externs = [n for n in graph.nodes if n.op is Op.EXTERN]
        assert not externs, f"{entry.name} fell back to extern: {externs[0].attrs.fn}"
        kiln_inputs = [t.clone() for t in tensors]
        actual = run_traced(graph, program, *kiln_inputs)
        note = f"{entry.name} {call.note}"
        if entry.inplace:
            expected, actual = eager_inputs[0], kiln_inputs[0]
        try:
            _close(actual, copy.copy(expected), dtype, entry)
            for got, want in zip(kiln_inputs, eager_inputs, strict=True):
                _close(got, want, dtype, entry)
        except AssertionError as error:
            raise AssertionError(f"{note}: {error}\n{graph}") from error
