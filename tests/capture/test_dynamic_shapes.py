"""Dynamic shapes in capture: the automatic policy, explicit marks, size guards, sizes read and
returned by Python code, and that no size change ever gives a stale result."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.recording import listen, unlisten

SIZES = (3, 7, 13, 5, 28, 2, 9)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    kiln.reset()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4))


def _symbols() -> list[str]:
    return kiln.explain().sizes


def test_a_size_change_makes_that_dim_symbolic() -> None:
    model = _mlp()
    compiled = kiln.compile(model)
    with torch.no_grad():
        for batch in SIZES:
            x = torch.randn(batch, 6)
            torch.testing.assert_close(compiled(x), model(x))
    assert kiln.counters.captures == 2  # static first, then symbolic batch
    assert kiln.counters.recompiles == [("__call__", "L['args'][0].size(0) is 7, expected 3")]
    assert kiln.counters.fallbacks == []
    sizes = _symbols()
    assert sizes == ["[__call__] s0 = L['args'][0].size(0): size changed from 3 to 7 (a recompile)"]


def test_dynamic_true_is_symbolic_from_the_first_call() -> None:
    model = _mlp()
    compiled = kiln.compile(model, dynamic=True)
    with torch.no_grad():
        for batch in SIZES:
            x = torch.randn(batch, 6)
            torch.testing.assert_close(compiled(x), model(x))
    assert kiln.counters.captures == 1
    assert "dynamic=True" in _symbols()[0]


def test_dynamic_false_recompiles_per_size_and_warns_at_the_limit() -> None:
    model = _mlp()
    compiled = kiln.compile(model, dynamic=False, options={"recompile_limit": 3})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for batch in SIZES:
            x = torch.randn(batch, 6)
            torch.testing.assert_close(compiled(x), model(x))
    assert kiln.counters.captures >= 3
    assert [r.reason.name for r in kiln.counters.fallbacks][:1] == ["RECOMPILE_LIMIT"]
    assert any("hit the recompile limit" in str(w.message) for w in caught)


def test_mark_dynamic_and_its_range() -> None:
    def f(x):
        return torch.relu(x) * 2

    compiled = kiln.compile(f)
    for batch in (4, 9, 30):
        x = torch.randn(batch, 3)
        kiln.mark_dynamic(x, 0, min=2, max=16)
        torch.testing.assert_close(compiled(x), f(x))
    # 4 and 9 share one symbolic entry; 30 is above the declared maximum: a static entry
    assert kiln.counters.captures == 2
    assert "2 <= s0 <= 16" in " ".join(kiln.explain().guards)


def test_mark_static_keeps_a_dim_static_under_dynamic_true() -> None:
    def f(x):
        return x.sum(1)

    compiled = kiln.compile(f, dynamic=True)
    for cols in (3, 5):
        x = torch.randn(4, cols)
        kiln.mark_static(x, 1)
        torch.testing.assert_close(compiled(x), f(x))
    assert kiln.counters.captures == 2  # the column count is static: 5 recompiles


def test_sizes_zero_and_one_are_specialized() -> None:
    compiled = kiln.compile(lambda x: x.softmax(-1), dynamic=True)
    for batch in (4, 1, 6, 1):
        x = torch.randn(batch, 5)
        torch.testing.assert_close(compiled(x), x.softmax(-1))
    assert kiln.counters.captures == 2  # batch 1 is its own (static) entry


def test_view_with_sizes_read_in_python() -> None:
    def f(x):
        b, t, c = x.shape
        heads = 2
        q = x.view(b, t, heads, c // heads).transpose(1, 2)
        return q.reshape(b * heads, t, -1).sum(-1) + x.size(1)

    compiled = kiln.compile(f, dynamic=True)
    for t in (3, 7, 11):
        x = torch.randn(2, t, 8)
        torch.testing.assert_close(compiled(x), f(x))
    assert kiln.counters.captures == 1
    assert kiln.counters.graph_breaks == []


def test_a_branch_on_a_size_is_a_guarded_relation() -> None:
    def f(x):
        if x.shape[0] > 8:
            return x * 2
        return x - 1

    compiled = kiln.compile(f, dynamic=True)
    for batch in (3, 5, 12, 20, 4):
        x = torch.randn(batch, 2)
        torch.testing.assert_close(compiled(x), f(x))
    assert kiln.counters.captures == 2  # one entry per side of the branch
    guards = " ".join(kiln.explain().guards)
    assert "s0 > 8" in guards and "s0 <= 8" in guards


def test_range_over_a_size_specializes_it() -> None:
    def f(x):
        total = x[0]
        for i in range(1, x.size(0)):
            total = total + x[i]
        return total

    compiled = kiln.compile(f, dynamic=True)
    for batch in (3, 4, 3):
        x = torch.randn(batch, 5)
        torch.testing.assert_close(compiled(x), f(x))
    assert kiln.counters.captures == 2  # range() needs the number: one entry per size
    assert any("specialized s0" in line for line in kiln.explain().sizes)


def test_len_of_a_tensor_keeps_its_first_dim_symbolic() -> None:
    def f(x):
        return torch.arange(len(x)) * len(x) + x.sum(1)

    compiled = kiln.compile(f, dynamic=True)
    for batch in (3, 4, 6):
        x = torch.randn(batch, 5)
        torch.testing.assert_close(compiled(x), f(x))
    assert kiln.counters.captures == 1
    assert not any("specialized" in line for line in kiln.explain().sizes)


def test_an_in_place_write_through_a_view_keeps_sizes_symbolic() -> None:
    def f(x):
        grid = (x[:, None] - x[None, :]).unsqueeze(-1).repeat(1, 1, 2).contiguous()
        grid[:, :, 0] += x.size(0) - 1
        return grid

    compiled = kiln.compile(f, dynamic=True)
    for batch in (3, 4, 6):
        x = torch.randn(batch)
        torch.testing.assert_close(compiled(x), f(x))
    assert kiln.counters.captures == 1
    assert not any("specialized" in line for line in kiln.explain().sizes)


def test_sizes_returned_and_stored_are_recomputed_per_call() -> None:
    log: list[int] = []

    def f(x):
        n = x.shape[0] * 2 + 1
        log.append(x.size(1))
        return x.sum(0), n, x.shape

    compiled = kiln.compile(f, dynamic=True)
    for batch, cols in ((3, 4), (6, 5), (9, 7)):
        x = torch.randn(batch, cols)
        total, n, shape = compiled(x)
        torch.testing.assert_close(total, x.sum(0))
        assert (n, shape, log[-1]) == (batch * 2 + 1, torch.Size([batch, cols]), cols)
        assert isinstance(n, int) and isinstance(shape, torch.Size)
    assert kiln.counters.captures == 1


def test_scalars_from_sizes_in_tensor_arithmetic() -> None:
    def f(x, y):
        n = x.shape[0]
        y = y + n
        return x * n + (x.shape[1] > x), y / n, torch.arange(n) * 2

    compiled = kiln.compile(f, dynamic=True)
    for batch in (3, 5, 8):
        x, y = torch.randn(batch, 4), torch.randn(batch, 4)
        for got, want in zip(compiled(x, y), f(x, y), strict=True):
            torch.testing.assert_close(got, want)
    assert kiln.counters.captures == 1


def test_equal_sizes_share_a_symbol_and_a_mismatch_is_eager_error() -> None:
    def f(x, y):
        return x + y

    compiled = kiln.compile(f, dynamic=True)
    for batch in (3, 6):
        x, y = torch.randn(batch, 4), torch.randn(batch, 4)
        torch.testing.assert_close(compiled(x, y), f(x, y))
    assert kiln.counters.captures == 1
    with pytest.raises(RuntimeError):
        compiled(torch.randn(3, 4), torch.randn(5, 4))


def test_training_with_a_dynamic_batch_gives_every_gradient() -> None:
    eager = _mlp()
    mine = _mlp()
    compiled = kiln.compile(mine)
    for batch in SIZES:
        x = torch.randn(batch, 6)
        target = torch.randn(batch, 4)
        F.mse_loss(eager(x), target).backward()
        loss = F.mse_loss(compiled(x), target)
        loss.backward()
        for (name, p), q in zip(eager.named_parameters(), mine.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
            p.grad = q.grad = None
    assert kiln.counters.captures == 2
    assert kiln.counters.fallbacks == [] and kiln.counters.graph_breaks == []


def test_a_module_with_a_graph_break_and_changing_sizes() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 3)

        def forward(self, x):
            h = self.a(x).relu()
            kiln.graph_break()
            return self.b(h) * h.shape[0]

    torch.manual_seed(0)
    model = Model()
    compiled = kiln.compile(model)
    captured = []
    with torch.no_grad():
        for batch in SIZES:
            x = torch.randn(batch, 4)
            torch.testing.assert_close(compiled(x), model(x))
            captured.append(kiln.counters.captures)
    assert kiln.counters.fallbacks == []
    # every piece (the frame up to the break, the resume functions) is static on the first
    # call and symbolic from the second: nothing compiles after that
    assert captured[1:] == [captured[1]] * (len(SIZES) - 1)
    assert all("size(0) is 7, expected 3" in reason for _, reason in kiln.counters.recompiles)


def _kernel_kinds(x, w, index):
    """Elementwise chains, reductions along and across the symbolic dim, a softmax over it,
    a matmul, a cat, a gather and a slice: one of each kind of kernel and extern."""
    y = torch.tanh(x) * 2 + x.sigmoid()
    rows = y.sum(1)
    columns = y.mean(0)
    weights = torch.softmax(x[:, 0], dim=0)
    product = y @ w
    joined = torch.cat([x, y], dim=1)
    picked = x.index_select(0, index)
    return rows, columns, weights, product, joined[1:].amax(1), picked


@pytest.mark.parametrize("dynamic", [True, None])
def test_every_kernel_kind_at_odd_sizes(dynamic) -> None:
    compiled = kiln.compile(_kernel_kinds, dynamic=dynamic)
    w = torch.randn(3, 4, dtype=torch.float64)
    for rows in (7, 1, 1000003, 7919 * 3, 2):
        x = torch.randn(rows, 3, dtype=torch.float64)
        index = torch.randint(0, rows, (5,))
        for got, want in zip(compiled(x, w, index), _kernel_kinds(x, w, index), strict=True):
            torch.testing.assert_close(got, want)
    assert kiln.counters.fallbacks == [] and kiln.counters.graph_breaks == []
    # size 1 is specialized (its own entry); one symbolic capture serves every other size
    assert kiln.counters.captures == (2 if dynamic else 3)


def test_a_size_only_python_reads_compiles_the_graph_once() -> None:
    programs: list[object] = []
    listen(programs, CompiledProgramRecord)
    try:

        def f(x, y):
            return y * 2 + 1, x.shape[0] * 3

        compiled = kiln.compile(f, dynamic=True)
        y = torch.randn(4, 5)
        for rows in (3, 6, 9):
            out, n = compiled(torch.randn(rows, 2), y)
            torch.testing.assert_close(out, y * 2 + 1)
            assert n == rows * 3
    finally:
        unlisten(programs)
    assert kiln.counters.captures == 1
    assert len(programs) == 1  # the graph reads no symbolic size: no compile per size


def test_an_input_dense_in_another_dim_order_becomes_symbolic_guarded_by_that_order() -> None:
    # A key-value cache grown by ``cat`` along dim 2 of a [B, H, T, E] tensor laid out
    # [B, T, H, E] (as a compiled program may return it): its length must become symbolic, not
    # recompile for every token; a cache in another layout must not pass the guard.
    def attend(cache: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.cat([cache, new], dim=2)
        return cache, cache.sum(2) * 2

    compiled = kiln.compile(attend)
    for length in (4, 5, 6, 9, 13):
        cache = torch.randn(2, length, 3, 8).transpose(1, 2)  # dense, dim order (0, 2, 1, 3)
        new = torch.randn(2, 3, 1, 8)
        got, want = compiled(cache, new), attend(cache, new)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    assert kiln.counters.captures == 2
    assert [reason for _, reason in kiln.counters.recompiles] == [
        "L['cache'].size(2) is 5, expected 4"
    ]
    guard = kiln.explain().guards
    assert any("dense in dim order (0, 2, 1, 3)" in line for line in guard), guard
    # The same sizes, contiguous: the symbolic entry's dim-order guard fails (a new capture).
    cache, new = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 1, 8)
    for a, b in zip(compiled(cache, new), attend(cache, new), strict=True):
        torch.testing.assert_close(a, b)
    assert "is not dense in dim order (0, 2, 1, 3)" in kiln.counters.recompiles[-1][1]


def test_stride_queries_answer_as_eager_or_break_the_graph() -> None:
    # An input's strides are known (guarded); a computed value's are the program's choice,
    # so a query on it breaks the graph rather than answer what eager would not.
    def branch(x: torch.Tensor) -> torch.Tensor:
        y = x * 2 if x.is_contiguous() else x - 1
        z = y.t()
        return z + 1 if z.is_contiguous() else z * x.stride(0)

    compiled = kiln.compile(branch)
    for x in (torch.randn(4, 6), torch.randn(6, 4).t(), torch.randn(5, 7), torch.randn(9, 5).t()):
        torch.testing.assert_close(compiled(x), branch(x))
    assert kiln.counters.fallbacks == []
    assert any("is_contiguous" in str(b) for b in kiln.explain().breaks), kiln.explain().breaks


def test_symbolic_input_strides_follow_its_dim_order() -> None:
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * x.stride(1) + x.stride()[0]

    compiled = kiln.compile(scaled, dynamic=True)
    for n in (3, 5, 8):
        x = torch.randn(n, 4, 6).permute(0, 2, 1)  # [n, 6, 4], dense in order (0, 2, 1)
        torch.testing.assert_close(compiled(x), scaled(x))
    assert kiln.counters.captures == 1


def test_an_extern_layout_learned_at_one_size_is_right_at_others() -> None:
    # PyTorch's CPU convolution of a one-channel input with strides (L, 1, 1) answers
    # channels-last, where the meta run predicts contiguous. The program learned those
    # strides at length 160 and kept them, batch stride and all, at 240: rows of the result
    # overlapped (wav2vec2's feature encoder, whose x[:, None] Kiln then laid out so, 2.7 off).
    conv = nn.Conv1d(1, 16, 8, 4, bias=False)

    def f(x: torch.Tensor) -> torch.Tensor:
        return conv(x) * 2

    def g(v: torch.Tensor) -> torch.Tensor:
        return conv(v[:, None])  # (eager's strides for the new dim: it steers the layout)

    compiled, unsqueezed = kiln.compile(f, dynamic=True), kiln.compile(g, dynamic=True)
    programs: list[CompiledProgramRecord] = []
    with torch.no_grad():
        for length in (160, 240, 240, 200, 320, 161):
            x = torch.randn(2, length, 1).transpose(1, 2)  # (strides (L, 1, 1))
            torch.testing.assert_close(compiled(x), f(x))
            v = torch.randn(2, length)
            listen(programs, CompiledProgramRecord)
            try:
                torch.testing.assert_close(unsqueezed(v), g(v))
            finally:
                unlisten(programs)
    assert kiln.counters.fallbacks == []
    assert len(programs) == 1  # (the layout eager's strides give: never learned, never rebuilt)
