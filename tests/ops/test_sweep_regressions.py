"""Differences from eager the full OpInfo sweep found (``tests/opinfo/sweep.py --full``), each
reduced to a user-level program: out-of-range indices, operands handed back by in-place
functional ops, gradients at zero-element and zero-valued inputs, expanded gradients.

Every case compares against eager on fresh random inputs and counts graphs, so a silent
fallback to eager fails too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import IndexOutOfBounds

Program = Callable[..., torch.Tensor]

# Reads through an index tensor: (program, index in range, [(index out of range, the
# offending entry as eager counts it)]). gather, index_select and embedding reject negatives.
GATHERS: dict[str, tuple[Program, list[list[int]], list[tuple[list[list[int]], int]]]] = {
    "gather": (
        lambda x, i: torch.gather(x, 1, i) * 2,
        [[0, 1], [3, 2]],
        [([[0, 4], [1, 2]], 4), ([[0, -1], [1, 2]], -1), ([[0, 1], [100, 2]], 100)],
    ),
    "index": (
        lambda x, i: x[i] * 2,
        [[0, -1], [3, 2]],
        [([[0, 4], [1, 2]], 4), ([[0, -5], [1, 2]], -5), ([[0, 1], [100, 2]], 100)],
    ),
    "index_columns": (
        lambda x, i: x[:, i.flatten()].sin(),
        [[0, -1], [3, 2]],
        [([[0, 4], [1, 2]], 4), ([[-5, 1], [1, 2]], -5)],
    ),
    "index_select": (
        lambda x, i: torch.index_select(x, 0, i.flatten()) + 1,
        [[0, 1], [3, 2]],
        [([[0, 4], [1, 2]], 4), ([[0, -1], [1, 2]], -1)],
    ),
    "embedding": (
        lambda x, i: F.embedding(i, x) + 1,
        [[0, 1], [3, 2]],
        [([[0, 4], [1, 2]], 4), ([[0, -1], [1, 2]], -1)],
    ),
}


@pytest.mark.parametrize("codegen", ["cpp", "evaluate"])
@pytest.mark.parametrize("name", sorted(GATHERS))
def test_out_of_range_index_raises_as_eager(name: str, codegen: str) -> None:
    """An index outside its dimension raises (eager's IndexError or RuntimeError: both catch
    Kiln's), naming the index; it never reads memory outside the tensor."""
    kiln.reset()
    program, good, bad_indices = GATHERS[name]
    compiled = kiln.compile(program, options={"codegen": codegen})
    x = torch.randn(4, 4)
    torch.testing.assert_close(compiled(x, torch.tensor(good)), program(x, torch.tensor(good)))
    for bad, offender in bad_indices:
        index = torch.tensor(bad)
        with pytest.raises((IndexError, RuntimeError)):
            program(x, index)
        with pytest.raises(IndexOutOfBounds) as raised:
            compiled(x, index)
        assert isinstance(raised.value, IndexError) and isinstance(raised.value, RuntimeError)
        assert f"index {offender} is out of bounds" in str(raised.value)
        # (the next call, in range, is unaffected by the recorded error)
        y = torch.randn(4, 4)
        torch.testing.assert_close(compiled(y, torch.tensor(good)), program(y, torch.tensor(good)))
    assert kiln.counters.graphs == 1
    assert not kiln.counters.fallbacks


def test_triton_kernels_clamp_out_of_range_indices() -> None:
    """A GPU kernel cannot raise without a sync (eager's CUDA gather asserts on the device): a
    Triton kernel reads element 0 for an index outside, never memory the tensor does not own
    (here under the interpreter, as in CI)."""
    kiln.reset()
    x = torch.randn(4, 4)
    compiled = kiln.compile(lambda t, i: torch.gather(t, 1, i) * 2, options={"codegen": "triton"})
    index = torch.tensor([[0, 4], [1, 2], [-3, 3], [9, 0]])
    clamped = torch.where((index >= 0) & (index < 4), index, 0)
    torch.testing.assert_close(compiled(x, index), torch.gather(x, 1, clamped) * 2)


def test_out_of_range_error_names_the_source_line() -> None:
    def lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table).sum(1)

    with pytest.raises(IndexError) as raised:
        kiln.compile(lookup)(torch.randn(5, 3), torch.tensor([[1, 7]]))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "test_sweep_regressions.py" in notes and "embedding" in notes


def test_take_along_dim_reads_indices_modulo_the_size() -> None:
    """Eager's take_along_dim along a dim reads ``i % size`` (-1 is the last; it checks no
    bounds), forward and backward."""
    x = torch.randn(3, 4, requires_grad=True)
    index = torch.tensor([[0, 4, -1, -6, 9]]).repeat(3, 1)

    def program(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.take_along_dim(t, i, 1)

    result, expected = kiln.compile(program)(x, index), program(x, index)
    torch.testing.assert_close(result, expected)
    (grad,) = torch.autograd.grad((result * result).sum(), x)
    (eager_grad,) = torch.autograd.grad((expected * expected).sum(), x)
    torch.testing.assert_close(grad, eager_grad)


@pytest.mark.parametrize(
    "activation",
    [
        lambda t: F.elu(t, inplace=True),
        lambda t: F.celu(t, inplace=True),
        lambda t: F.selu(t, inplace=True),
        lambda t: F.silu(t, inplace=True),
        lambda t: F.mish(t, inplace=True),
        lambda t: F.hardsigmoid(t, inplace=True),
        lambda t: F.leaky_relu(t, 0.2, inplace=True),
    ],
)
def test_inplace_functional_returns_its_operand(activation: Program) -> None:
    """``F.elu(x, inplace=True)`` returns ``x`` itself (eager), with x's new values."""
    compiled = kiln.compile(activation)
    for shape in [(6,), (6,), (2, 5)]:
        x = torch.randn(shape)
        expected = activation(x.clone())
        result = compiled(x)
        assert result is x
        torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("ord", [0, 0.5, -1.5, 1, 3])
def test_vector_norm_gradient_at_zeros(ord: float) -> None:
    """Eager's norm backward passes 0 at zero elements for ord < 1 (the power's derivative
    is infinite there), and an ord-0 norm is differentiable with a zero gradient."""
    x = torch.randn(4, 5)
    x[0, 1] = x[2, 3] = x[3] = 0.0
    x.requires_grad_()

    def program(t: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(t, ord, dim=1)

    result, expected = kiln.compile(program)(x), program(x)
    assert result.requires_grad == expected.requires_grad
    torch.testing.assert_close(result, expected)
    cotangent = torch.randn(4)
    (grad,) = torch.autograd.grad(result, x, cotangent)
    # (eager's ord-0 backward is undefined, a None: zeros here)
    (eager_grad,) = torch.autograd.grad(expected, x, cotangent, allow_unused=True)
    if eager_grad is None:
        eager_grad = torch.zeros_like(x)
    torch.testing.assert_close(grad, eager_grad, equal_nan=True)


def test_cat_gives_skipped_legacy_empty_tensors_a_gradient() -> None:
    """``torch.cat`` skips 1-d empty tensors next to others of any rank; eager still gives
    each one that requires grad a (empty) gradient."""
    a, empty = torch.randn(2, 3, requires_grad=True), torch.randn(0, requires_grad=True)
    result = kiln.compile(lambda p, q: torch.cat([p, q], 0))(a, empty)
    grads = torch.autograd.grad(result.sum(), [a, empty])
    assert grads[1].shape == (0,)
    torch.testing.assert_close(grads[0], torch.ones(2, 3))
    both = kiln.compile(lambda p, q: torch.cat([p, q]))(empty, torch.randn(0, requires_grad=True))
    assert both.shape == (0,) and both.requires_grad


@pytest.mark.parametrize("shape, dim", [((0,), None), ((3, 0), 1), ((0,), 0), ((0, 3), 0)])
def test_prod_of_nothing_backward(shape: tuple[int, ...], dim: int | None) -> None:
    """A product over no elements is 1, and its gradient an empty tensor (the backward's
    kernel once stored one element into a zero-element buffer)."""
    x = torch.randn(shape, requires_grad=True)

    def program(t: torch.Tensor) -> torch.Tensor:
        return t.prod() if dim is None else t.prod(dim)

    result = kiln.compile(program)(x)
    torch.testing.assert_close(result, program(x))
    (grad,) = torch.autograd.grad(result.sum(), x)
    assert grad.shape == x.shape


@pytest.mark.parametrize("shape, size", [((5,), (1,)), ((5, 3), (1, 3)), ((4, 1, 3), (1, 3))])
def test_sum_to_size_backward(shape: tuple[int, ...], size: tuple[int, ...]) -> None:
    """The gradient of sum_to_size is an expanded tensor in eager; compiled, the extern's
    predicted layout is dense (broadcast memory cannot be written)."""
    compiled = kiln.compile(lambda t: t.sum_to_size(*size) * 3)
    for _ in range(2):
        x = torch.randn(shape, requires_grad=True)
        result = compiled(x)
        torch.testing.assert_close(result, x.sum_to_size(*size) * 3)
        (grad,) = torch.autograd.grad(result.sum(), x)
        torch.testing.assert_close(grad, torch.full(shape, 3.0))


def test_histogramdd_returns_the_bin_tensors_themselves() -> None:
    """With tensor bins, eager's ``bin_edges`` are the bin tensors passed in."""

    def program(x: torch.Tensor, bins: list[torch.Tensor]) -> Any:
        return torch.histogramdd(x, bins)

    x = torch.randn(20, 2)
    bins = [torch.tensor([-1.0, 0.0, 1.0]), torch.tensor([-2.0, 0.5, 2.0])]
    result, expected = kiln.compile(program)(x, bins), program(x, bins)
    torch.testing.assert_close(result.hist, expected.hist)
    assert all(got is given for got, given in zip(result.bin_edges, bins, strict=True))


def _compiled_matches(program: Program, *inputs: torch.Tensor) -> None:
    """Compiled ``program`` equals eager's, forward and (for float inputs) backward, with
    one graph, no fallback and no graph left to the reference interpreter (its warning is an
    error here, the backward's too)."""
    import warnings

    kiln.reset()
    expected = program(*inputs)
    leaves = [t for t in inputs if t.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = kiln.compile(program)(*inputs)
        torch.testing.assert_close(result, expected)
        assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks
        if leaves:
            cotangent = torch.randn_like(expected)
            torch.testing.assert_close(
                torch.autograd.grad(result, leaves, cotangent),
                torch.autograd.grad(expected, leaves, cotangent),
            )


def test_column_reduction_with_a_constant_operand() -> None:
    """A reduction over the leading dim whose operand multiplies by a constant (the backward
    of ``div(a, b, rounding_mode="trunc")`` in ``b``), or an elementwise kernel split into
    blocks of lanes with a scalar operand (cross-entropy's gradient in soft targets): the C++
    kernel kept the scalar in a per-lane array and read it outside the lane loop."""
    a = torch.randn(5, 10, 5, requires_grad=True)
    b = torch.randn(10, 5, requires_grad=True)
    _compiled_matches(lambda p, q: torch.div(p, q, rounding_mode="trunc") + p * q, a, b)
    logits = torch.randn(2, 3, 1, 2, 3, requires_grad=True)
    target = torch.randn(2, 3, 1, 2, 3).softmax(1).requires_grad_()
    _compiled_matches(lambda p, q: F.cross_entropy(p, q), logits, target)


@pytest.mark.parametrize(
    "name",
    [
        "baddbmm_int",
        "tensordot_broadcast",
        "avg_pool_empty_stride",
        "gather_empty_uint8",
        "gather_scalar",
        "prod_bool",
        "batch_norm_empty",
    ],
)
def test_arguments_eager_accepts(name: str) -> None:
    """Arguments eager accepts that the translations rejected (the whole frame then ran
    uncompiled)."""
    if name == "baddbmm_int":  # integer kernels truncate float alpha and beta
        a, b, c = (torch.randint(-5, 5, s) for s in [(2, 2, 3), (2, 2, 2), (2, 2, 3)])
        _compiled_matches(lambda p, q, r: torch.baddbmm(p, q, r, beta=1.7, alpha=2.6), a, b, c)
    elif name == "tensordot_broadcast":  # a contracted dim of size 1 broadcasts
        x, y = torch.randn(3, 1, 4, requires_grad=True), torch.randn(2, 5, 3, requires_grad=True)
        _compiled_matches(lambda p, q: torch.tensordot(p, q, dims=([0, 1], [2, 0])), x, y)
    elif name == "avg_pool_empty_stride":  # stride=() is the kernel size
        x = torch.randn(1, 2, 4, 4, requires_grad=True)
        _compiled_matches(lambda p: F.avg_pool2d(p, (2, 2), (), 0), x)
    elif name == "gather_empty_uint8":  # an empty index of any int type and rank
        for index in (torch.zeros(0, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8)):
            x = torch.randn(5, requires_grad=True)
            _compiled_matches(lambda p, i: torch.gather(p, 0, i).exp(), x, index)
    elif name == "gather_scalar":  # a 0-d input reads as one element
        x = torch.tensor(3.0, requires_grad=True)
        _compiled_matches(
            lambda p, i: torch.gather(p, 0, i) * 2, x, torch.zeros(2, dtype=torch.long)
        )
    elif name == "prod_bool":
        _compiled_matches(lambda p: torch.prod(p, 1, dtype=torch.bool), torch.randn(3, 4, 5) > -1)
    else:
        empty = torch.randn(0)
        _compiled_matches(
            lambda p: F.batch_norm(p, torch.randn(0), torch.randn(0), training=True), empty
        )


def test_a_cpu_scalar_tensor_joins_tensors_on_another_device() -> None:
    """Eager reads a 0-d CPU tensor as a scalar next to tensors on another device (DeBERTa
    divides CUDA scores by ``torch.sqrt(torch.tensor(d) * s)``); it was an internal error and
    the whole frame ran uncompiled. Meta tensors stand in for CUDA ones here."""

    def program(x: torch.Tensor) -> torch.Tensor:
        scale = torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * 2)
        return torch.where(x > 0, x / scale.to(dtype=x.dtype), torch.tensor(1.0))

    kiln.reset()
    x = torch.randn(2, 3, device="meta")
    result, expected = kiln.compile(program)(x), program(x)
    assert (result.shape, result.dtype, result.device) == (
        expected.shape,
        expected.dtype,
        expected.device,
    )
    assert kiln.counters.graphs == 1 and not kiln.counters.fallbacks


def test_in_place_methods_without_translations_compile_through_their_twins() -> None:
    """``x.foo_(...)`` with no translation of its own takes ``foo``'s result (it broke the
    graph: scatter_reduce_ in graph networks, xlogy_, copysign_, index_reduce_); into a tensor
    made in the program too; gradients through it as eager's."""

    def program(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        pooled = torch.zeros(3).scatter_reduce_(0, index, y, reduce="amax", include_self=False)
        w, v = x.clone(), x.clone()
        w.copysign_(y)
        v.xlogy_(y.abs() + 1)
        means = torch.ones(3, 2).index_reduce_(0, index, y[:, None].expand(6, 2), "mean")
        return w.sin() + v + pooled.sum() + means.sum()

    kiln.reset()
    compiled = kiln.compile(program)
    index = torch.tensor([0, 1, 2, 0, 1, 2])
    for _ in range(3):
        x = (torch.rand(6) + 0.5).requires_grad_()
        y = torch.randn(6, requires_grad=True)
        result, expected = compiled(x, y, index), program(x, y, index)
        torch.testing.assert_close(result, expected)
        got = torch.autograd.grad(result.sum(), [x, y])
        torch.testing.assert_close(got, torch.autograd.grad(expected.sum(), [x, y]))
    assert kiln.counters.graphs == 1
    assert not kiln.counters.graph_breaks and not kiln.counters.fallbacks


def test_in_place_twin_that_resizes_or_refuses_runs_natively() -> None:
    """Eager's addbmm_ resizes a [1] operand to the result's shape, and float_power_ refuses
    a float32 operand: such calls break the graph and PyTorch decides, as in eager."""

    def resized(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x.clone().addbmm_(a, b) * 2

    kiln.reset()
    x, a, b = torch.randn(1), torch.randn(3, 5, 4), torch.randn(3, 4, 10)
    torch.testing.assert_close(kiln.compile(resized)(x, a, b), resized(x, a, b))
    assert [r.reason.name for r in kiln.counters.graph_breaks] == ["UNSUPPORTED_CALL"]
    with pytest.raises(RuntimeError, match="float_power_"):
        kiln.compile(lambda t: t.clone().float_power_(2) + 1)(torch.randn(4))


def test_is_signed_is_answered_from_the_dtype() -> None:
    """``torch.is_signed(x)`` reads the dtype (guarded), as ``x.is_signed()`` did: no break."""

    def program(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if torch.is_signed(x) else x + 1

    kiln.reset()
    compiled = kiln.compile(program)
    for x in (torch.randn(3), torch.tensor([1, 2], dtype=torch.uint8), torch.randn(3)):
        torch.testing.assert_close(compiled(x), program(x))
    assert kiln.counters.graphs == 2 and not kiln.counters.graph_breaks
