"""Symbolic sizes: arithmetic, what is decided for every size, what is guarded, specialization,
and graphs specialized to a binding."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph
from kiln.ir.specialize import specialize
from kiln.ir.symbolic import ShapeEnv, Sym, SymbolicDecisionError, active_env
from kiln.ir.types import TensorType
from kiln.ir.verify import verify
from kiln.ops import prims


def _env() -> tuple[ShapeEnv, Sym, Sym]:
    env = ShapeEnv()
    a = env.size("x", 0, 8, "test")
    b = env.size("x", 1, 12, "test")
    assert isinstance(a, Sym) and isinstance(b, Sym)
    return env, a, b


def test_arithmetic_normalizes_and_keeps_hints() -> None:
    env, a, b = _env()
    with active_env(env):
        assert (a * b).same(b * a) and hash(a * b) == hash(b * a)
        assert (a * b + a - a).same(a * b)
        assert (a * b) // b is not None and ((a * b) // b).same(a)
        assert (a * 12) // 4 == 3 * a
        assert (4 * a + 3) % 4 == 3 and (4 * a) % 4 == 0
        assert (a // 2).hint == 4 and ((a * b + 7) % b).hint == 7
        assert -1 % a == a - 1  # a negative index wrapped
        assert (a - a) == 0 and isinstance(a - a, int)
    assert env.relations == {}  # all of that held for every size


def test_modulo_of_a_possibly_negative_remainder_stays_python_modulo() -> None:
    env, a, _ = _env()
    with active_env(env):
        pad = (2 - a % 2) % 2  # (-(a % 2)) % 2 is not -(a % 2): Python's % is non-negative
        assert isinstance(pad, Sym)
        (symbol,) = a.symbols()
        assert [pad.evaluate({symbol.name: n}) for n in (4, 5, 7)] == [0, 1, 1]


def test_questions_decided_for_every_size_add_no_guard() -> None:
    env, a, b = _env()
    with active_env(env):
        assert a != 1 and a > 1 and a >= 2 and not (a < 0) and a * b > a
        assert a + 1 != a
    assert env.relations == {}


def test_undecided_questions_are_guarded_from_the_hint() -> None:
    env, a, b = _env()
    with active_env(env):
        assert a < b and (a == b) is False and a * 2 > b
    texts = sorted(r.text() for r in env.relations)
    assert texts == ["-2*s0 + s1 < 0", "s0 - s1 != 0", "s0 - s1 < 0"]


def test_int_specializes_and_says_where() -> None:
    env, a, _ = _env()
    with active_env(env):
        assert int(a) == 8 and list(range(a)) == list(range(8))
    assert [r.text() for r in env.relations] == ["s0 == 8"]
    assert env.specializations[0][0] == "s0"


def test_no_environment_no_unguarded_answer() -> None:
    env, a, b = _env()
    with pytest.raises(SymbolicDecisionError):
        bool(a == b)
    with pytest.raises(SymbolicDecisionError):
        int(a)
    assert a != 1  # decided for every size: no guard needed
    assert env.relations == {}


def test_declared_range_decides_comparisons() -> None:
    env = ShapeEnv()
    n = env.size("x", 0, 5, "test", low=2, high=16)
    with active_env(env):
        assert n < 17 and n <= 16
    assert env.relations == {}


def test_duck_sizing_shares_symbols_and_small_sizes_stay_ints() -> None:
    env = ShapeEnv()
    assert env.size("x", 0, 8, "t") is env.size("y", 0, 8, "t")
    assert env.size("x", 1, 1, "t") == 1 and env.size("x", 2, 0, "t") == 0
    assert env.sources["s0"] == [("x", 0), ("y", 0)]


def test_a_graph_specialized_to_a_binding() -> None:
    env, a, b = _env()
    graph = Graph()
    with GraphBuilder(graph), active_env(env):
        x = graph.add_input(TensorType((a, b), torch.float32), name="x")
        y = prims.reshape(x, shape=(a * b,))
        z = prims.mul(y, 2.0)
        graph.outputs = [z]
    concrete = specialize(graph, {"s0": 3, "s1": 5})
    verify(concrete)
    assert concrete.inputs[0].type.shape == (3, 5)
    assert concrete.nodes[0].attrs.shape == (15,)
    assert concrete.outputs[0].type.shape == (15,)
    assert graph.inputs[0].type.shape == (a, b)  # the symbolic graph is unchanged


def test_relations_check_tests_relations_then_checks() -> None:
    """A program's guard: every relation (as compiled Python), then each check, the
    decisions only code can test (PyTorch's attention kernel at the sizes)."""
    from kiln.ir.symbolic import Relation, relations_check

    below = Relation(Sym.symbol("s0", 8) - 1024, "<")  # s0 < 1024
    seen: list[dict[str, int]] = []

    def odd_s1(values: dict[str, int]) -> bool:
        seen.append(dict(values))
        return values["s1"] % 2 == 1

    assert relations_check(())({"s0": 5})
    assert relations_check((below,))({"s0": 1023}) and not relations_check((below,))({"s0": 1024})
    holds = relations_check((below,), [odd_s1])
    assert holds({"s0": 9, "s1": 5}) and not holds({"s0": 9, "s1": 4})
    assert not holds({"s0": 2000, "s1": 5})
    assert len(seen) == 2  # (a failed relation skips the checks)
    assert relations_check((), [odd_s1])({"s0": 2, "s1": 7})
