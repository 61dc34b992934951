"""The host program's unchecked extern calls match their registry rows' implementations."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import kiln
from kiln.config import config
from kiln.ir.op import Op, op_def
from kiln.ir.types import TensorType
from kiln.ops import cpu_matmul
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


# ---------------------------------------------------------------------------------------------
# float32 CPU matmuls through oneDNN (kiln/ops/cpu_matmul.py)

needs_onednn = pytest.mark.skipif(
    cpu_matmul.onednn_linear() is None, reason="this PyTorch has no oneDNN linear"
)


def _f32(*shape: int) -> TensorType:
    return TensorType(shape, torch.float32)


@needs_onednn
@pytest.mark.parametrize("transposed", [(False, False), (True, False), (False, True)])
def test_onednn_matmuls_match_the_rows(transposed: tuple[bool, bool]) -> None:
    """Forced to oneDNN, ``mm`` and ``addmm`` with a per-column bias give the rows' results
    (float32 rounding), for contiguous and transposed operands alike."""
    m, k, n = 160, 96, 144
    a = torch.randn(k, m).t() if transposed[0] else torch.randn(m, k)
    b = torch.randn(n, k).t() if transposed[1] else torch.randn(k, n)
    bias = torch.randn(n)
    mm = host_call(Op.MM, None, [_f32(m, k), _f32(k, n)], "onednn")
    addmm = host_call(Op.ADDMM, GemmAttrs(), [_f32(n), _f32(m, k), _f32(k, n)], "onednn")
    assert mm is not None and addmm is not None
    assert mm is not host_call(Op.MM, None)  # not torch.mm
    expected = op_def(Op.MM).impl(None, a, b)
    torch.testing.assert_close(mm(a, b), expected, rtol=1e-4, atol=1e-4)
    with_bias = op_def(Op.ADDMM).impl(GemmAttrs(), bias, a, b)
    torch.testing.assert_close(addmm(bias, a, b), with_bias, rtol=1e-4, atol=1e-4)


def test_onednn_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small products, other dtypes, scaled products and full-matrix biases keep PyTorch's
    call even when oneDNN is forced (a oneDNN call here would raise)."""

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("oneDNN called")

    monkeypatch.setattr(cpu_matmul, "onednn_linear", lambda: refuse)
    f64 = TensorType((256, 256), torch.float64)
    cases = [
        (Op.MM, None, [_f32(8, 8), _f32(8, 8)]),  # too small to pay oneDNN's fixed cost
        (Op.MM, None, [f64, f64]),
        (Op.ADDMM, GemmAttrs(0.5, 1.0), [_f32(256), _f32(256, 256), _f32(256, 256)]),
        (Op.ADDMM, GemmAttrs(), [_f32(256, 256), _f32(256, 256), _f32(256, 256)]),
    ]
    for op, attrs, types in cases:
        call = host_call(op, attrs, types, "onednn")
        assert call is not None
        operands = [torch.randn(t.shape, dtype=t.dtype) for t in types]  # type: ignore[arg-type]
        torch.testing.assert_close(call(*operands), op_def(op).impl(attrs, *operands))


def test_choice_is_measured_once_per_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The measured answer is cached on disk: a later process (here: an emptied memory cache)
    reads it back; a corrupt cache file is measured again."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(cpu_matmul, "_CHOICES", {})
    measured: list[bool] = []

    def measure() -> bool:
        measured.append(True)
        return True

    monkeypatch.setattr(cpu_matmul, "_measure", measure)
    assert cpu_matmul.use_onednn(256, 256, 256) and len(measured) == 1
    cpu_matmul._CHOICES.clear()
    assert cpu_matmul.use_onednn(256, 256, 256) and len(measured) == 1  # read from disk
    (tmp_path / "cpu_matmul.json").write_text("{not json")
    cpu_matmul._CHOICES.clear()
    assert cpu_matmul.use_onednn(256, 256, 256) and len(measured) == 2
    assert not cpu_matmul.use_onednn(256, 256, 256, "blas")


@needs_onednn
def test_linear_training_through_onednn_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-layer MLP trained through Kiln's C++ backend with its matmuls on oneDNN: loss and
    every gradient match eager."""
    linear, calls = cpu_matmul.onednn_linear(), []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args)
        return linear(*args)  # type: ignore[misc]

    monkeypatch.setattr(cpu_matmul, "onednn_linear", lambda: counted)
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Linear(192, 160), torch.nn.GELU(), torch.nn.Linear(160, 144)
    )
    model = copy.deepcopy(eager)
    x = torch.randn(200, 192)
    compiled = kiln.compile(model, options={"cpu_matmul": "onednn"})
    try:
        for run in (eager, compiled):
            run(x).square().mean().backward()
    finally:
        kiln.reset()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert len(calls) == 5  # two forward products, three backward (x's gradient needs none)


@needs_onednn
@pytest.mark.parametrize("choice", ["onednn", "blas"])
def test_explain_names_the_matmul_library(choice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kiln.explain`` lists a linear layer's extern with the library that runs it
    (``KILN_CPU_MATMUL`` sets the default of the ``cpu_matmul`` option)."""
    monkeypatch.setattr(config, "cpu_matmul", choice)
    model = torch.nn.Linear(192, 160)
    try:
        report = str(kiln.explain(model, torch.randn(200, 192)))
    finally:
        kiln.reset()
    assert "extern addmm" in report
    assert ("addmm via oneDNN" in report) == (choice == "onednn")
