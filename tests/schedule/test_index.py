"""Index arithmetic: simplification rules are sound (checked by evaluating every position) and
views compose into short expressions."""

from __future__ import annotations

import itertools
import random

import pytest

from kiln.schedule import index as ix
from kiln.schedule.index import FloorDiv, Index, Indirect, Mod, Var


def evaluate(index: Index, values: dict[str, int]) -> int:
    total = index.const
    for atom, coef in index.terms:
        if isinstance(atom, Var):
            term = values[atom.name]
        elif isinstance(atom, FloorDiv):
            term = evaluate(atom.operand, values) // atom.divisor
        elif isinstance(atom, Mod):
            term = evaluate(atom.operand, values) % atom.divisor
        else:
            raise AssertionError(f"unexpected atom {atom}")
        total += coef * term
    return total


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (1, 6, 1), (7,), (4, 1, 3, 2)])
def test_split_then_join_is_the_variable(shape: tuple[int, ...]) -> None:
    numel = 1
    for size in shape:
        numel *= size
    x = ix.var("x", numel)
    assert ix.linear(ix.decompose(x, shape), ix.contiguous_strides(shape)) == x


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (4, 1, 3, 2)])
def test_permuted_positions_match_python(shape: tuple[int, ...]) -> None:
    numel = 1
    for size in shape:
        numel *= size
    x = ix.var("x", numel)
    parts = ix.decompose(x, shape)
    order = list(range(len(shape)))[::-1]
    permuted_shape = [shape[d] for d in order]
    offset = ix.linear([parts[d] for d in order], ix.contiguous_strides(permuted_shape))
    strides = ix.contiguous_strides(shape)
    for position in range(numel):
        digits = [(position // strides[d]) % shape[d] for d in range(len(shape))]
        expected = sum(
            digits[d] * s for d, s in zip(order, ix.contiguous_strides(permuted_shape), strict=True)
        )
        assert evaluate(offset, {"x": position}) == expected


def test_simplifications_are_sound_on_random_expressions() -> None:
    """Build random expressions symbolically and as plain Python side by side; the simplified
    symbolic form must agree with Python's integer arithmetic at every position."""
    rng = random.Random(0)
    x, r = ix.var("x", 24), ix.var("r", 10)
    for _ in range(300):
        a, b, c = rng.randint(0, 5), rng.randint(0, 7), rng.randint(0, 9)
        expr = x * a + r * b + c
        steps: list[tuple[str, int, int, int]] = []
        for _ in range(rng.randint(1, 3)):
            kind = "div" if rng.random() < 0.5 else "mod"
            divisor, scale, more = rng.randint(1, 12), rng.randint(1, 4), rng.randint(0, 3)
            expr = ix.floordiv(expr, divisor) if kind == "div" else ix.mod(expr, divisor)
            expr = expr * scale + r * more
            steps.append((kind, divisor, scale, more))
        for xv, rv in itertools.product(range(24), range(10)):
            value = xv * a + rv * b + c
            for kind, divisor, scale, more in steps:
                value = value // divisor if kind == "div" else value % divisor
                value = value * scale + rv * more
            assert evaluate(expr, {"x": xv, "r": rv}) == value, (expr, xv, rv)


def _largest(index: Index, values: dict[str, int]) -> tuple[int, int]:
    """(the value of ``index``, the largest ``|number|`` met evaluating it term by term:
    partial sums, and the operands of its divisions and modulos)."""
    total, largest = index.const, abs(index.const)
    for atom, coef in index.terms:
        if isinstance(atom, Var):
            term = values[atom.name]
        else:
            operand, inner = _largest(atom.operand, values)
            largest = max(largest, inner, abs(operand))
            term = operand // atom.divisor if isinstance(atom, FloorDiv) else operand % atom.divisor
        total += coef * term
        largest = max(largest, abs(total))
    return total, largest


def test_magnitude_bounds_every_number_index_math_meets() -> None:
    """``magnitude`` bounds the value, each partial sum and each operand of a division or
    modulo, on random nested expressions: int32 index math chosen by it never overflows."""
    rng = random.Random(1)
    x, r = ix.var("x", 40), ix.var("r", 12)
    for _ in range(300):
        expr = x * rng.randint(0, 50) + r * rng.randint(0, 9) + rng.randint(0, 20)
        for _ in range(rng.randint(1, 3)):
            divisor = rng.randint(1, 12)
            expr = ix.floordiv(expr, divisor) if rng.random() < 0.5 else ix.mod(expr, divisor)
            expr = expr * rng.randint(1, 40) + x * rng.randint(0, 3) + rng.randint(0, 9)
        expr = expr - rng.randint(0, 60)  # (operands are never negative; offsets may be)
        positions = itertools.product(range(40), range(12))
        worst = max(_largest(expr, {"x": xv, "r": rv})[1] for xv, rv in positions)
        assert ix.magnitude(expr) >= worst, expr


def test_a_quotient_counts_at_its_operand_value() -> None:
    """A floor-division's quotient is bounded by its operand's value, not by the loop
    variables inside it: a max pool's gradient over 64x64x112x112 positions (3x3 windows,
    stride 2) reads its window's offsets in int32 (counted at x's extent, the index math
    ran in int64, the kernel at 24% of copy speed on an H200)."""
    x = ix.var("x", 64 * 64 * 112 * 112)
    row = ix.floordiv(ix.mod(ix.floordiv(x, 7168), 112) + 1, 2)
    column = ix.floordiv(ix.mod(ix.floordiv(x, 64), 112) + 1, 2)
    offset = row * 3584 + column * 64 + ix.floordiv(x, 802816) * 200704 + ix.mod(x, 64) - 3648
    assert ix.magnitude(offset) == x.terms[0][0].size  # (x itself, inside the divisions)
    assert ix.magnitude(offset) <= ix.INT32_LIMIT


def test_rules() -> None:
    x = ix.var("x", 12)
    assert ix.floordiv(x, 12) == Index()
    assert ix.mod(x, 12) == x
    assert ix.floordiv(ix.floordiv(x, 2), 3) == ix.floordiv(x, 6)
    assert ix.floordiv(x * 4 + 3, 4) == x
    assert ix.mod(x * 4 + 3, 4) == Index((), 3)
    assert ix.bounds(x * 2 + 1) == (1, 23)
    assert ix.var("y", 1) == Index()  # a size-1 loop is the constant 0


def test_negative_operands_are_rejected() -> None:
    x = ix.var("x", 8)
    with pytest.raises(ValueError):
        ix.floordiv(x - 4, 3)
    with pytest.raises(ValueError):
        ix.mod(x - 4, 3)


def test_indirect_atoms_keep_identity_and_bounds() -> None:
    value = object()
    index = ix.indirect(value, 5)
    ((atom, coef),) = index.terms
    assert isinstance(atom, Indirect) and coef == 1
    assert ix.bounds(index * 3) == (0, 12)
    assert ix.mod(index, 5) == index


def test_division_factors_out_a_common_stride() -> None:
    # A channels-last row of 64 read through a [.., 1024] view: (64*r + x) with x < 64.
    r, x = ix.var("r", 2048), ix.var("x", 64)
    flat = r * 64 + x
    assert ix.floordiv(flat, 1024) == ix.floordiv(r, 16)
    assert ix.mod(flat, 1024) == ix.mod(r, 16) * 64 + x
    # ... and the decomposition recombines into the plain offset.
    assert ix.floordiv(flat, 1024) * 1024 + ix.mod(flat, 1024) == flat
    # Not when the low part can reach the factor; every position agrees with integers.
    y = ix.var("y", 65)
    assert ix.floordiv(r * 64 + y, 1024) != ix.floordiv(r, 16)
    for expr in (flat, r * 64 + y, r * 192 + x * 3 + 1):
        names = sorted(expr.variables())
        for values in itertools.product(*(range(0, 2048, 61) for _ in names)):
            env = {
                n: v % (65 if n == "y" else 64 if n == "x" else 2048)
                for n, v in zip(names, values, strict=True)
            }
            value = evaluate(expr, env)
            assert evaluate(ix.floordiv(expr, 1024), env) == value // 1024
            assert evaluate(ix.mod(expr, 1024), env) == value % 1024


def test_kernel_source_is_the_same_on_every_compile() -> None:
    """Indirect terms (two gathered indices in one address) are ordered by creation, not by
    memory address: the same program prints the same kernel source in every compile (and
    process), so the kernel caches keyed by source hit."""
    import torch

    import kiln
    from kiln.backends.kiln import CompiledProgramRecord
    from kiln.codegen.cpp import generate_cpp
    from kiln.recording import listen, unlisten

    def program(t: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return t[i, j] * 2 + t[j, i]

    sources = set()
    for _ in range(6):
        kiln.reset()
        records: list = []
        listen(records, CompiledProgramRecord)
        try:
            t, i, j = torch.randn(7, 7), torch.randint(0, 7, (5,)), torch.randint(0, 7, (5,))
            result = kiln.compile(program, options={"codegen": "cpp"})(t, i, j)
        finally:
            unlisten(records)
        torch.testing.assert_close(result, program(t, i, j))
        sources.add(generate_cpp(records[-1].program.kernels()))
    kiln.reset()
    assert len(sources) == 1


def test_a_memo_scope_reuses_static_results_and_ends_with_the_scope() -> None:
    """Inside :func:`memo_scope` a division asked again (an equal index, built afresh) is
    answered from the memo; outside, or after the scope, it is computed anew. Results are
    the same either way."""
    x = ix.var("x", 4096)

    def quotient() -> Index:
        return ix.floordiv(ix.mod(ix.floordiv(x, 64), 112) + 1, 2)

    assert quotient() is not quotient()  # (no scope: computed each time)
    with ix.memo_scope():
        first = quotient()
        assert quotient() is first
        with ix.memo_scope():  # (an inner scope keeps its own memo)
            inner = quotient()
            assert inner is not first and inner == first
        assert quotient() is first
    after = quotient()
    assert after is not first and after == first
    for position in (0, 63, 64, 4095):
        expected = ((position // 64) % 112 + 1) // 2
        assert evaluate(after, {"x": position}) == expected
