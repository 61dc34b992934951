"""PyTorch's view rule on symbolic sizes (``schedule/views.py:view_rule``): a reshape of a
strided view is a view where PyTorch's would be one, with the strides PyTorch gives, at every
binding of the symbols the decisions it guarded hold for; otherwise None (a copy)."""

from __future__ import annotations

import random

import pytest
import torch

from kiln.ir.symbolic import ShapeEnv, Sym, active_env
from kiln.schedule.views import view_rule


def _at(size: int | Sym, values: dict[str, int]) -> int:
    return size.evaluate(values) if isinstance(size, Sym) else size


def _strides_agree(got: tuple, want: tuple, shape: tuple) -> bool:
    return all(a == b or size == 1 for a, b, size in zip(got, want, shape, strict=True))


def test_matches_pytorch_on_random_strided_views() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4))]
        order = list(range(len(shape)))
        rng.shuffle(order)
        tensor = torch.empty(shape).permute(order)
        if rng.random() < 0.3 and tensor.shape[0] > 1:
            tensor = tensor[::2]
        factors, rest = [], tensor.numel()
        while rest > 1 and len(factors) < 4:
            factor = rng.choice([d for d in range(1, rest + 1) if rest % d == 0])
            factors.append(factor)
            rest //= factor
        factors += [rest] if rest > 1 else []
        if rng.random() < 0.3:
            factors.insert(rng.randint(0, len(factors)), 1)
        new = tuple(factors) or (1,)
        try:
            want = tuple(tensor.view(new).stride())
        except RuntimeError:
            want = None
        got = view_rule(tuple(tensor.shape), tuple(tensor.stride()), new)
        assert (got is None) == (want is None), (tensor.shape, tensor.stride(), new)
        if got is not None:
            assert _strides_agree(got, want, new), (tensor.shape, tensor.stride(), new, got)


@pytest.mark.parametrize("case", ["split_heads", "merge_heads", "strided_rows", "straddles"])
def test_symbolic_views_hold_at_other_sizes(case: str) -> None:
    """A projection's ``[b, t, 3*h*d]`` output sliced into q, viewed as heads and
    transposed (GPT-2's attention), and merged back; each result checked against PyTorch at
    sizes the recorded relations accept."""
    env = ShapeEnv()
    with active_env(env):
        b, t = (env.size(("x", d), d, hint, "test") for d, hint in enumerate((8, 1024)))
        assert isinstance(b, Sym) and isinstance(t, Sym)
        h, d = 12, 64
        if case == "split_heads":  # q = qkv[..., :h*d].view(b, t, h, d)
            shape, strides, new = (b, t, h * d), (t * 3 * h * d, 3 * h * d, 1), (b, t, h, d)
        elif case == "merge_heads":  # [b, h, t, d].transpose(1, 2) -> (b, t, h*d): no view
            shape, strides, new = (b, t, h, d), (h * t * d, d, t * d, 1), (b, t, h * d)
        elif case == "strided_rows":  # every other row of [b*2, t, 64] viewed flat per row
            shape, strides, new = (b, t, 64), (2 * t * 64, 64, 1), (b, t * 64)
        else:  # rows of a transpose do not merge: a copy
            shape, strides, new = (b, t, 64), (64, b * 64, 1), (b * t, 64)
        got = view_rule(shape, strides, new)
    check = [r.holds for r in env.relations]
    for values in ({"s0": 8, "s1": 1024}, {"s0": 3, "s1": 17}, {"s0": 5, "s1": 77}):
        if not all(holds(values) for holds in check):
            continue
        concrete = [tuple(_at(n, values) for n in dims) for dims in (shape, strides, new)]
        tensor = torch.empty_strided(concrete[0], concrete[1], device="meta")
        try:
            want = tuple(tensor.view(concrete[2]).stride())
        except RuntimeError:
            want = None
        if got is None:
            assert want is None, case
        else:
            assert want is not None, case
            strides_then = tuple(_at(n, values) for n in got)
            assert _strides_agree(strides_then, want, concrete[2]), (case, values)
    assert (got is None) == (case in ("merge_heads", "straddles"))  # (PyTorch copies those)
