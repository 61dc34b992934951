"""fuse_attention: hand-written attention becomes one sdpa node computing the same outputs, and
anything that is not exactly attention (or whose values something else reads) is left alone."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir import Graph, InputKind, Op, interpret, verify
from kiln.ops.attention import (
    sdpa_cpu_backward,
    sdpa_cpu_forward,
    sdpa_cuda_backward,
    sdpa_cuda_forward,
)
from kiln.passes import fuse_attention, optimize

B, H, L, S, D = 2, 3, 4, 5, 8


def _qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(B, H, n, D, dtype=dtype) for n in (L, S, S))


def _fresh_inputs(graph: Graph) -> list[torch.Tensor]:
    """New random tensors for every input (constants keep their value)."""
    inputs = []
    for value in graph.inputs:
        shape, dtype = value.type.shape, value.type.dtype
        if value.kind is InputKind.CONSTANT:
            inputs.append(graph.constants[value.name])
        elif dtype == torch.bool:
            mask = torch.rand(shape) > 0.3
            mask[..., 0] = True  # no row hidden entirely
            inputs.append(mask)
        elif dtype.is_floating_point:
            inputs.append(torch.randn(shape, dtype=dtype))
        else:  # the RNG seed
            inputs.append(torch.randint(0, 2**31, shape, dtype=dtype))
    return inputs


def _fused(fn: Callable[..., Any], *args: Any) -> tuple[Graph, list[torch.Tensor], list[Any]]:
    """(graph after the pass, outputs before, outputs after) on fresh inputs."""
    graph = kiln.trace(fn, *args)
    inputs = _fresh_inputs(graph)
    expected = interpret(graph, inputs)
    fused = verify(fuse_attention(graph))
    return fused, expected, interpret(fused, inputs)


def _ops(graph: Graph) -> list[Op]:
    return [node.op for node in graph.nodes]


def _by_div(q: Any, k: Any, v: Any, mask: Any) -> Any:
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + mask, dim=-1) @ v


def _by_mul(q: Any, k: Any, v: Any) -> Any:
    return torch.softmax(q @ k.transpose(-2, -1) * D**-0.5, dim=-1) @ v


def _query_scaled(q: Any, k: Any, v: Any) -> Any:
    return torch.softmax((q * D**-0.5) @ k.transpose(-2, -1), dim=-1) @ v


def _unscaled(q: Any, k: Any, v: Any) -> Any:
    return F.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1) @ v


def _mask_first(q: Any, k: Any, v: Any, mask: Any) -> Any:
    return torch.softmax(mask + (q @ k.transpose(-2, -1)) * 0.5, dim=-1) @ v


def _three_d(q: Any, k: Any, v: Any) -> Any:
    return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.25, dim=-1) @ v


FUSED = [
    ("div, float mask", _by_div, (*_qkv(), torch.randn(L, S)), 1 / math.sqrt(D)),
    ("mul", _by_mul, _qkv(), D**-0.5),
    ("q scaled first", _query_scaled, _qkv(), D**-0.5),
    ("no scale", _unscaled, _qkv(), 1.0),
    ("mask first", _mask_first, (*_qkv(), torch.randn(B, 1, L, S)), 0.5),
    ("3-d", _three_d, tuple(torch.randn(6, n, D) for n in (L, S, S)), 0.25),
    ("float64", _by_mul, _qkv(torch.float64), D**-0.5),
]


@pytest.mark.parametrize(("fn", "args", "scale"), [c[1:] for c in FUSED], ids=[c[0] for c in FUSED])
def test_attention_becomes_one_sdpa(fn: Any, args: Any, scale: float) -> None:
    fused, expected, actual = _fused(fn, *args)
    ops = _ops(fused)
    assert ops.count(Op.SDPA) == 1 and Op.BMM not in ops and Op.EXP not in ops, ops
    (sdpa,) = [node for node in fused.nodes if node.op is Op.SDPA]
    assert sdpa.attrs.scale == pytest.approx(scale)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_rows_the_mask_hides_entirely_stay_nan() -> None:
    """Eager's softmax of a row of -inf is NaN; sdpa alone would give 0."""
    fused, _, _ = _fused(_by_div, *_qkv(), torch.randn(L, S))
    mask = torch.zeros(L, S)
    mask[1] = -math.inf
    mask[2, :3] = -math.inf
    inputs = [*_qkv(), mask]
    expected = _by_div(*inputs)
    (actual,) = interpret(fused, inputs)
    assert expected[:, :, 1].isnan().all() and not expected[:, :, 2].isnan().any()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_finite_mask_needs_no_nan_rows() -> None:
    """A mask made of finite values whatever the inputs (transformers' form) adds no guard."""

    def fn(q: Any, k: Any, v: Any, keep: Any) -> Any:
        bias = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        return _by_div(q, k, v, bias)

    fused, expected, actual = _fused(fn, *_qkv(), torch.rand(L, S) > 0.5)
    ops = _ops(fused)
    assert ops.count(Op.SDPA) == 1 and Op.NE not in ops and Op.AMAX not in ops, ops
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_pipeline_fuses_and_keeps_gradients() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    graph = verify(optimize(kiln.trace(_by_mul, q, k, v)))
    # Fused into SDPA, which the CPU's differentiated graphs run as the flash kernel keeping
    # its log-sum-exp (passes.attention_statistics).
    assert _ops(graph) == [Op.EXTERN] and graph.nodes[0].attrs.fn is sdpa_cpu_forward
    assert graph.outputs[0].type.requires_grad


def _with_probabilities(q: Any, k: Any, v: Any) -> Any:
    probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    return probs @ v, probs


def _scores_reused(q: Any, k: Any, v: Any) -> Any:
    scores = q @ k.transpose(-2, -1)
    return torch.softmax(scores, dim=-1) @ v + scores.sum()


def _other_dim(q: Any, k: Any, v: Any) -> Any:
    return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


def _dropout(q: Any, k: Any, v: Any) -> Any:
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1), 0.1, training=True) @ v


def _masked_fill(q: Any, k: Any, v: Any, keep: Any) -> Any:
    scores = (q @ k.transpose(-2, -1)).masked_fill(~keep, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def _mask_scaled(q: Any, k: Any, v: Any, mask: Any) -> Any:
    return torch.softmax((q @ k.transpose(-2, -1) + mask) * 0.5, dim=-1) @ v


UNCHANGED = [
    ("probabilities also returned", _with_probabilities, _qkv()),
    ("scores read elsewhere", _scores_reused, _qkv()),
    ("softmax over dim -2", _other_dim, _qkv()),
    ("dropout", _dropout, _qkv()),
    # masked_fill replaces scores: a NaN key at a hidden position must not reach the output
    ("masked_fill", _masked_fill, (*_qkv(), torch.rand(B, 1, L, S) > 0.3)),
    ("mask scaled with the scores", _mask_scaled, (*_qkv(), torch.randn(L, S))),
    ("bfloat16: converts around the softmax", _by_mul, _qkv(torch.bfloat16)),
]


@pytest.mark.parametrize(("fn", "args"), [c[1:] for c in UNCHANGED], ids=[c[0] for c in UNCHANGED])
def test_not_attention_is_left_alone(fn: Any, args: Any) -> None:
    graph = kiln.trace(fn, *args)
    before = _ops(graph)
    inputs = _fresh_inputs(graph)
    expected = interpret(graph, inputs)
    fused = verify(fuse_attention(graph))
    assert _ops(fused) == before and Op.SDPA not in before
    torch.testing.assert_close(interpret(fused, inputs), expected)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_transformers_eager_attention(name: str) -> None:
    from tiny_models import tiny_bert_config, tiny_gpt2_config

    from kiln.frontends.trace import graph_inputs

    if name == "gpt2":
        model = transformers.GPT2Model(tiny_gpt2_config(attn_implementation="eager")).eval()
    else:
        model = transformers.BertModel(tiny_bert_config(attn_implementation="eager")).eval()
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        graph = kiln.trace(model, torch.randint(0, 99, (2, 7)), attention_mask=mask)
        inputs = graph_inputs(graph, model, torch.randint(0, 99, (2, 7)), attention_mask=mask)
        expected = interpret(graph, inputs)
        fused = verify(fuse_attention(graph))
        actual = interpret(fused, inputs)
    ops = _ops(fused)
    assert ops.count(Op.SDPA) == 2 and Op.BMM not in ops and Op.NE not in ops
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_efficient_bias_keeps_values_aligned_and_broadcast() -> None:
    """The memory-efficient CUDA kernel's bias (``ops.attention._efficient_bias``): a boolean
    mask becomes 0/-inf in the query's dtype, a bias whose rows are not 16-element aligned is
    padded (values unchanged), and both broadcast to [B, H, L, S]."""
    from kiln.ops.attention import _efficient_bias

    q, k = torch.randn(B, H, L, D), torch.randn(B, H, 77, D)
    bias = torch.randn(B, 1, 1, 77)  # rows of 77: misaligned
    got = _efficient_bias(bias, q, k)
    assert got.shape == (B, H, L, 77) and got.stride(0) % 16 == 0 and got.stride(-1) == 1
    torch.testing.assert_close(got, bias.expand(B, H, L, 77), rtol=0, atol=0)
    mask = torch.rand(1, 1, L, 77) > 0.5
    got = _efficient_bias(mask, q, k)
    assert got.dtype == q.dtype and got.shape == (B, H, L, 77)
    assert torch.equal(got[1, 2] == 0, mask[0, 0]) and torch.isinf(got[0, 0][~mask[0, 0]]).all()
    assert _efficient_bias(None, q, k) is None


def test_cuda_attention_without_a_device_keeps_the_general_rule() -> None:
    """Which CUDA kernel eager would pick is asked of PyTorch on empty CUDA tensors; where
    that cannot be asked (no CUDA here, or symbolic sizes) the pass leaves the node alone."""
    import kiln.passes.attention_statistics as statistics
    from kiln.ir.types import TensorType

    graph = kiln.trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *_qkv())
    node = next(n for n in graph.nodes if n.op is Op.SDPA)
    for value in node.inputs[:3]:
        assert value is not None
        value.type = TensorType(
            value.type.shape, value.type.dtype, torch.device("cuda"), requires_grad=True
        )
    expected = None if not torch.cuda.is_available() else statistics._kernel(node)
    assert statistics._kernel(node) == expected
    if not torch.cuda.is_available():
        assert not statistics._chosen(node)


def test_a_learned_bias_on_the_cpu_keeps_the_general_rule() -> None:
    """On the CPU, eager runs a mask that requires grad by the math kernel: the pass leaves
    it to the general rule, which returns every gradient, the mask's included."""
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    bias = torch.randn(1, H, L, S, requires_grad=True)
    compiled = kiln.compile(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m))
    for _ in range(2):
        grad = torch.randn(B, H, L, D)
        expected = torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, bias), (q, k, v, bias), grad
        )
        got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias), grad)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [1, 2, 3])
@pytest.mark.parametrize("length,keys,width", [(40, 40, 64), (33, 70, 64), (64, 5, 32)])
def test_cuda_kernel_result_types_follow_pytorch(
    backend: int, length: int, keys: int, width: int
) -> None:
    """The types of the CUDA kernels' output and log-sum-exp by formula, written in symbols
    (the memory-efficient kernel pads its rows to 32, cuDNN adds a unit dim), equal what
    PyTorch's meta functions give at each binding, and the backward's are its operands'."""
    from kiln.ir.symbolic import Sym, substitute
    from kiln.ir.types import TensorType
    from kiln.ops.attention import _sdpa_cuda_backward_types, _sdpa_cuda_forward_types
    from kiln.ops.attrs import ExternAttrs, Slot

    if backend == 1 and width != 64:
        pytest.skip("the flash kernels take one head size")
    cuda = torch.device("cuda")
    b, rows, s = Sym.symbol("s0", 3), Sym.symbol("s1", 50), Sym.symbol("s2", 60)
    types = [TensorType((b, 4, n, 64), torch.bfloat16, cuda) for n in (rows, s)]
    types.append(TensorType((b, 4, s, width), torch.bfloat16, cuda))
    attrs = ExternAttrs(sdpa_cuda_forward, (Slot(0), Slot(1), Slot(2), None), {"backend": backend})
    out, lse = _sdpa_cuda_forward_types(attrs, *types)
    values = {"s0": 2, "s1": length, "s2": keys}
    q, k, v = (
        torch.empty(substitute(t.shape, values), dtype=t.dtype, device="meta") for t in types
    )
    expected = sdpa_cuda_forward(q, k, v, None, backend=backend)
    assert tuple(substitute(out.shape, values)) == tuple(expected[0].shape)
    assert tuple(substitute(lse.shape, values)) == tuple(expected[1].shape)
    assert (out.dtype, lse.dtype) == (expected[0].dtype, expected[1].dtype)
    grads = ExternAttrs(sdpa_cuda_backward, tuple(Slot(i) for i in range(7)), {"backend": backend})
    typed = _sdpa_cuda_backward_types(grads, out, *types, None, out, lse)
    assert [t.shape for t in typed] == [t.shape for t in types]


def test_cuda_attention_kernel_is_checked_per_size() -> None:
    """On CUDA a training graph's attention kernel is asked at the hints and kept as a check
    on the sizes (not pinned to them): the rewritten graph stays symbolic, and the check fails
    where PyTorch would pick another kernel (here, faked: flash up to 64 keys)."""
    import kiln.passes.attention_statistics as statistics
    from kiln.ir.symbolic import ShapeEnv, Sym, active_env
    from kiln.ir.types import TensorType
    from kiln.ops.attention import CUDA_EFFICIENT, CUDA_FLASH

    def fake_kernel(self: Any, values: Any) -> int:
        keys = values.get("s1", 48)
        return CUDA_FLASH if keys <= 64 else CUDA_EFFICIENT

    graph = kiln.trace(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *_qkv()
    )
    batch, length = Sym.symbol("s0", 2), Sym.symbol("s1", 48)
    for value in graph.inputs:
        value.type = TensorType(
            (batch, H, length, D), torch.float16, torch.device("cuda"), requires_grad=True
        )
    env = ShapeEnv()
    original = statistics._Call.kernel
    statistics._Call.kernel = fake_kernel  # type: ignore[method-assign]
    try:
        with active_env(env):
            rewritten = statistics.keep_attention_statistics(graph)
    finally:
        statistics._Call.kernel = original  # type: ignore[method-assign]
    extern = next(n for n in rewritten.nodes if n.op is Op.EXTERN)
    assert extern.attrs.kwargs["backend"] == CUDA_FLASH
    assert [repr(t) for t in extern.outputs[1].type.shape] == ["s0", repr(H), "s1"]
    assert not env.relations, env.relations  # nothing pinned
    (text, check) = next(iter(env.checks.items()))
    assert "flash" in text and "s1" in text
    statistics._Call.kernel = fake_kernel  # type: ignore[method-assign]
    try:
        assert check({"s0": 5, "s1": 64}) and not check({"s0": 2, "s1": 65})
    finally:
        statistics._Call.kernel = original  # type: ignore[method-assign]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_trains_over_symbolic_lengths(device: str) -> None:
    """A causal attention trained at four (batch, length) pairs compiles its passes and
    autodiff once, through the kernel's own forward and backward, every gradient matching
    eager's (pinned, each pair compiled again). The kernel choice is probed at the hints: on
    the CPU unguarded (its flash kernel takes every size), on CUDA checked per size."""
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.recording import recording

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = device == "cuda"
    dtype, width = (torch.bfloat16, 64) if cuda else (torch.float32, D)
    rtol, atol = (2e-2, 2e-2) if cuda else (1e-4, 1e-5)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sin()

    kiln.reset()
    compiled = kiln.compile(attend, dynamic=True)
    with recording(CompiledProgramRecord) as records:
        for batch, length in ((2, 48), (3, 40), (2, 100), (4, 33)):
            shape = (batch, H, length, width)
            q, k, v = (
                torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            grad = torch.randn(shape, device=device, dtype=dtype)
            expected = torch.autograd.grad(attend(q, k, v), (q, k, v), grad)
            got = torch.autograd.grad(compiled(q, k, v), (q, k, v), grad)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    assert kiln.counters.captures == 1
    assert len(records) == 2, [r.sizes for r in records]  # one forward, one backward
    kernels = (
        (sdpa_cuda_forward, sdpa_cuda_backward) if cuda else (sdpa_cpu_forward, sdpa_cpu_backward)
    )
    assert set(kernels) <= _extern_functions(records)


def _extern_functions(records: Any) -> set[Any]:
    """The functions the generic externs of compiled programs call."""
    steps = [step for r in records if r.program is not None for step in r.program.steps]
    return {getattr(s.node.attrs, "fn", None) for s in steps if hasattr(s, "node")}
