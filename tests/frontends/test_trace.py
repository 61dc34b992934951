"""kiln.trace: inputs, constants, outputs, mutation, views, errors with the user's line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import OpError, TraceError
from kiln.ir import InputKind, Op


def test_data_dependent_branch_names_the_user_line() -> None:
    def branchy(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # the line the error must name
            return x
        return -x

    with pytest.raises(TraceError) as info:
        kiln.trace(branchy, torch.randn(3))
    assert info.value.location is not None
    assert info.value.location.file == __file__
    assert "if x.sum() > 0" in info.value.location.text


def test_item_is_data_dependent() -> None:
    with pytest.raises(TraceError, match="item"):
        kiln.trace(lambda x: x * x.max().item(), torch.randn(3))


def test_shape_mismatch_raises_runtime_error_with_line() -> None:
    def bad(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    with pytest.raises(RuntimeError) as info:
        kiln.trace(bad, torch.randn(2, 3), torch.randn(4, 3))
    assert isinstance(info.value, OpError)
    assert info.value.location is not None and info.value.location.line > 0


def test_closed_over_tensor_becomes_constant_input() -> None:
    scale = torch.randn(3)
    graph = kiln.trace(lambda x: x * scale, torch.randn(2, 3))
    kinds = [value.kind for value in graph.inputs]
    assert kinds.count(InputKind.CONSTANT) == 1
    x = torch.randn(2, 3)
    torch.testing.assert_close(kiln.run_traced(graph, lambda x: x * scale, x), x * scale)


def test_output_structure_is_rebuilt() -> None:
    def structured(x: torch.Tensor) -> dict[str, object]:
        return {"double": x * 2, "pair": (x + 1, "label"), "n": x.shape[0]}

    x = torch.randn(4)
    graph = kiln.trace(structured, x)
    result = kiln.run_traced(graph, structured, x)
    assert result["pair"][1] == "label" and result["n"] == 4
    torch.testing.assert_close(result["double"], x * 2)
    torch.testing.assert_close(result["pair"][0], x + 1)


def test_shared_parameters_are_one_input() -> None:
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.ReLU(), layer)
    graph = kiln.trace(model, torch.randn(2, 3))
    params = [value.source for value in graph.inputs if value.kind is InputKind.PARAMETER]
    assert sorted(params) == ["0.bias", "0.weight"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(kiln.run_traced(graph, model, x), model(x))


def test_inplace_on_input_is_written_back() -> None:
    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    x = torch.randn(3)
    expected_x = x + 1
    graph = kiln.trace(bump, x.clone())
    assert len(graph.mutations) == 1
    out = kiln.run_traced(graph, bump, x)
    torch.testing.assert_close(x, expected_x)
    torch.testing.assert_close(out, expected_x * 2)


def test_inplace_through_a_view_updates_the_base_and_other_views() -> None:
    def through_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 1
        row = y[1]
        col = y[:, 2]
        row.mul_(10)
        return y, col

    x = torch.randn(3, 4)
    expected = through_view(x.clone())
    graph = kiln.trace(through_view, x.clone())
    actual = kiln.run_traced(graph, through_view, x)
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])


def test_random_ops_use_a_fresh_seed_each_call() -> None:
    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape)

    x = torch.zeros(1000)
    graph = kiln.trace(noisy, x)
    assert any(value.kind is InputKind.RNG_SEED for value in graph.inputs)
    first = kiln.run_traced(graph, noisy, x)
    second = kiln.run_traced(graph, noisy, x)
    assert not torch.equal(first, second)
    assert 0.4 < first.mean().item() < 0.6 and first.min() >= 0 and first.max() < 1


def test_unknown_torch_function_becomes_extern() -> None:
    def special(x: torch.Tensor) -> torch.Tensor:
        return torch.special.bessel_j0(x) + 1

    x = torch.randn(5)
    graph = kiln.trace(special, x)
    assert any(node.op is Op.EXTERN for node in graph.nodes)
    torch.testing.assert_close(kiln.run_traced(graph, special, x), special(x))


def test_is_compiling_during_trace() -> None:
    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x + 1

    kiln.trace(probe, torch.randn(2))
    assert seen == [True] and not torch.compiler.is_compiling()


def test_isinstance_tensor_holds_for_proxies() -> None:
    def check(x: torch.Tensor) -> torch.Tensor:
        assert isinstance(x, torch.Tensor)
        return x.float() if x.dtype == torch.float16 else x

    graph = kiln.trace(check, torch.randn(2).half())
    assert graph.outputs[0].type.dtype == torch.float32


def test_autocast_inside_the_traced_function() -> None:
    def mixed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.linear(x, w).relu()

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    graph = kiln.trace(mixed, x, w)
    out = kiln.run_traced(graph, mixed, x, w)
    expected = mixed(x, w)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


BAD_INPUTS = {
    "float_bitwise_and": lambda x: x & x,
    "float_shift": lambda x: x << 2,
    "broadcast_mismatch": lambda x: x + x[:2],
    "dim_out_of_range": lambda x: x.sum(dim=5),
    "bad_view": lambda x: x.view(7),
    "cat_rank_mismatch": lambda x: torch.cat([x, x.view(1, -1)]),
    "string_operand": lambda x: x + "a",
    "matmul_shapes": lambda x: x.view(3, 1) @ x.view(3, 1),
    "softmax_dim": lambda x: torch.softmax(x, 3),
    "gather_float_index": lambda x: torch.gather(x, 0, torch.tensor([0.5])),
    "embedding_float_ids": lambda x: nn.functional.embedding(x, torch.randn(4, 2)),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_raises_eagers_exception_type(name: str) -> None:
    program = BAD_INPUTS[name]
    x = torch.randn(3)
    with pytest.raises(Exception) as eager:
        program(x.clone())
    with pytest.raises(Exception) as traced:
        kiln.trace(program, x.clone())
    assert isinstance(traced.value, type(eager.value)), (traced.value, eager.value)
