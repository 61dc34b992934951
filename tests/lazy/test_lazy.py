"""``kiln.lazy``: training and inference on lazy tensors against eager, with the compile and
cache-hit counts that show each step is one graph compiled once per structure."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import lazy
from kiln.backends.kiln import CompiledProgramRecord
from kiln.errors import KilnError
from kiln.recording import recording


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    lazy.reset()
    yield
    lazy.reset()


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _batches(count: int, rows: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, 8), torch.randn(rows, 2)) for _ in range(count)]


Update = Callable[[torch.nn.Module, torch.optim.Optimizer | None], None]


def _train(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    update: Update,
    *,
    lazy_mode: bool,
    optimizer: bool,
    read_first: bool = False,
) -> list[float]:
    """The same ordinary PyTorch loop, eager or on lazy tensors (plus mark_step); the loss is
    read after the step, or (``read_first``) before its backward."""
    move = lazy.to_lazy if lazy_mode else (lambda t: t)
    model = move(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False) if optimizer else None
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(move(x)), move(y))
        if read_first:
            losses.append(loss.item())
        loss.backward()
        update(model, sgd)
        if lazy_mode:
            lazy.mark_step()
        if not read_first:
            losses.append(loss.item())
    return losses


def _optimizer_step(model: torch.nn.Module, sgd: torch.optim.Optimizer | None) -> None:
    assert sgd is not None
    sgd.step()
    sgd.zero_grad()


def _manual_step(model: torch.nn.Module, sgd: torch.optim.Optimizer | None) -> None:
    # (gradients never zeroed: they accumulate, so step 2 differs from step 1, then repeats)
    for p in model.parameters():
        p.data -= 0.05 * p.grad


@pytest.mark.parametrize(
    "update, optimizer, read_first, compiles",
    [
        (_optimizer_step, True, False, 1),
        (_manual_step, False, False, 2),
        (_optimizer_step, True, True, 2),  # (the loss's own graph, and the step's)
    ],
    ids=["torch.optim.SGD", "p.data -= lr * p.grad", "loss.item() before backward"],
)
def test_a_training_loop_on_lazy_tensors_matches_eager(
    update: Update, optimizer: bool, read_first: bool, compiles: int
) -> None:
    batches = _batches(10)
    eager_model, lazy_model = _mlp(), _mlp()
    options = {"optimizer": optimizer, "read_first": read_first}
    expected = _train(eager_model, batches, update, lazy_mode=False, **options)
    with recording(CompiledProgramRecord) as programs:
        got = _train(lazy_model, batches, update, lazy_mode=True, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for (name, p_eager), p_lazy in zip(
        eager_model.named_parameters(), lazy_model.parameters(), strict=True
    ):
        torch.testing.assert_close(lazy.to_eager(p_lazy), p_eager.detach(), msg=name)
    counters = lazy.counters
    syncs = 10 if read_first else 0  # (after the step, .item() reads a materialized loss)
    assert (counters.steps, counters.syncs) == (10 + syncs, syncs)
    assert (counters.compiles, counters.cache_hits) == (compiles, 10 + syncs - compiles)
    # the backend built one program per compile (no layout recompiles), none on the interpreter
    assert len(programs) == compiles and not any(record.fallback for record in programs)
    report = lazy.explain()
    assert report is not None and report.cache_hit and "mm(" in str(report)
    assert report.reason == "mark_step"


def test_batchnorm_statistics_and_momentum_buffers_are_updated_lazily() -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(4)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 2),
        )

    eager_model, lazy_model = model(), lazy.to_lazy(model())
    batches = _batches(4)
    for net, move in ((eager_model, lambda t: t), (lazy_model, lazy.to_lazy)):
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            F.mse_loss(net(move(x)), move(y)).backward()
            sgd.step()
            sgd.zero_grad()
            lazy.mark_step()
    assert lazy.counters.compiles == 2  # (the first step makes the momentum buffers)
    for (name, eager), state in zip(
        eager_model.state_dict().items(), lazy_model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(lazy.to_eager(state), eager, msg=name)


def test_adam_matches_eager_but_its_changing_numbers_compile_every_step() -> None:
    batches = _batches(3)
    losses = {}
    for lazy_mode in (False, True):
        move = lazy.to_lazy if lazy_mode else (lambda t: t)
        model = move(_mlp(3))
        adam = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
        losses[lazy_mode] = []
        for x, y in batches:
            loss = F.mse_loss(model(move(x)), move(y))
            loss.backward()
            adam.step()
            adam.zero_grad()
            if lazy_mode:
                lazy.mark_step()
            losses[lazy_mode].append(loss.item())
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
    # (the bias corrections are Python numbers, constants of each step's graph: a known limit)
    assert lazy.counters.compiles == 3


def test_inference_with_item_in_the_middle() -> None:
    model = _mlp(1)

    def program(x: torch.Tensor) -> tuple[torch.Tensor, float]:
        hidden = model[1](model[0](x))
        scale = hidden.abs().mean().item()  # runs the work it depends on
        out = model[2](hidden * scale)
        if out.sum() > 0:  # Python control flow on a value (bool of a lazy tensor)
            out = out * 2.0
        out = out - 1.0
        print(out)  # printing reads the value
        return out, scale

    x = torch.randn(4, 8)
    expected, expected_scale = program(x)
    lazy.to_lazy(model)
    with torch.no_grad():
        out, scale = program(lazy.to_lazy(x))
    assert isinstance(out, lazy.LazyTensor)
    assert scale == pytest.approx(expected_scale, rel=1e-5)
    torch.testing.assert_close(lazy.to_eager(out), expected.detach())
    assert lazy.counters.syncs == 3 and lazy.counters.compiles == 3  # three different graphs


def test_identical_steps_hit_the_cache_and_a_new_shape_recompiles() -> None:
    model = lazy.to_lazy(_mlp(2))
    eager_model = _mlp(2)
    for rows in (8, 8, 8, 4, 4):
        x = torch.randn(rows, 8)
        with torch.no_grad():
            out = model(lazy.to_lazy(x)).relu()
        lazy.mark_step()
        torch.testing.assert_close(lazy.to_eager(out), eager_model(x).relu().detach())
    assert (lazy.counters.compiles, lazy.counters.cache_hits) == (2, 3)


def test_a_step_reads_fresh_data_and_writes_in_place_updates() -> None:
    state = lazy.to_lazy(torch.randn(6))
    expected = lazy.to_eager(state).clone()
    for _ in range(3):
        noise = torch.randn(6)
        state.mul_(0.5).add_(lazy.to_lazy(noise))
        expected = expected * 0.5 + noise
        lazy.mark_step()
        torch.testing.assert_close(lazy.to_eager(state), expected)
    assert (lazy.counters.compiles, lazy.counters.cache_hits) == (1, 2)
    assert lazy.to_eager(state).requires_grad is False


def test_a_result_shaped_by_data_runs_eagerly_between_steps() -> None:
    x = torch.randn(64)
    lazy_x = lazy.to_lazy(x)
    picked = (lazy_x * 3.0)[lazy_x > 0]  # (boolean indexing: its size depends on the data)
    out = picked.exp().sum()
    torch.testing.assert_close(lazy.to_eager(out), (x * 3.0)[x > 0].exp().sum())
    assert lazy.counters.eager_calls == 1 and lazy.counters.steps == 2
    w = lazy.to_lazy(torch.randn(8, requires_grad=True))
    with pytest.raises(KilnError, match="data"):  # (PyTorch would cut the gradient's path)
        w[w > 0].sum()


def test_a_value_read_runs_only_its_work_and_the_step_goes_on() -> None:
    w = lazy.to_lazy(torch.randn(3, requires_grad=True))
    other = lazy.to_lazy(torch.randn(3)).exp()  # (not needed by the read: left pending)
    loss = (w * w).sum()
    assert loss.item() == pytest.approx(float((lazy.to_eager(w) ** 2).sum()), rel=1e-5)
    report = lazy.explain()
    assert report is not None and report.reason == "item" and "exp" not in str(report)
    loss.backward()  # (the loss's step is still pending: its graph is there to differentiate)
    lazy.mark_step()
    assert w.grad is not None
    torch.testing.assert_close(lazy.to_eager(w.grad), 2 * lazy.to_eager(w))
    assert lazy.to_eager(other).shape == (3,)
    assert (lazy.counters.steps, lazy.counters.syncs) == (2, 1)


def test_a_value_read_sees_the_random_numbers_of_its_step() -> None:
    x = lazy.to_lazy(torch.rand(4096) + 0.5)
    dropped = F.dropout(x, 0.5)
    total = dropped.sum().item()  # (its own graph, run with the step's seed)
    lazy.mark_step()
    data = lazy.to_eager(dropped)
    kept = data != 0
    assert 0.4 < kept.float().mean().item() < 0.6  # (dropout ran: about half the elements)
    torch.testing.assert_close(data[kept], 2 * lazy.to_eager(x)[kept])
    assert total == pytest.approx(data.sum().item(), rel=1e-5)


def test_backward_after_the_step_of_its_loss_is_an_error() -> None:
    w = lazy.to_lazy(torch.randn(3, requires_grad=True))
    loss = (w * w).sum()
    lazy.mark_step()
    with pytest.raises(KilnError, match="whose step already ran"):
        loss.backward()


def test_lazy_is_part_of_the_public_api() -> None:
    assert kiln.lazy is lazy
    assert {"to_lazy", "to_eager", "mark_step", "counters", "explain"} <= set(lazy.__all__)


@torch.library.custom_op("kiln_test::lazy_softsign", mutates_args=())
def softsign(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs())


@softsign.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_lowered_custom_op_trains_inside_a_lazy_step() -> None:
    kiln.register_lowering(softsign, lambda x: x / (1 + x.abs()))
    try:
        w = torch.randn(8, 4, requires_grad=True)
        w_lazy = lazy.to_lazy(w)
        x = torch.randn(16, 8)
        loss = softsign(lazy.to_lazy(x) @ w_lazy).square().mean()
        loss.backward()
        lazy.mark_step()
        eager_loss = softsign(x @ w).square().mean()
        # (the op registers no autograd formula: eager's gradient comes from its formula)
        grad = torch.autograd.grad((x @ w / (1 + (x @ w).abs())).square().mean(), w)[0]
        torch.testing.assert_close(lazy.to_eager(loss), eager_loss.detach())
        assert w_lazy.grad is not None
        torch.testing.assert_close(lazy.to_eager(w_lazy.grad), grad)
        report = lazy.explain()
        assert report is not None and "extern" not in str(report)
    finally:
        kiln.register_lowering(softsign, None)


def test_strides_are_the_datas_as_eager_would_give_them() -> None:
    # The wrapper's own strides are contiguous; a stride query reads the data (a transposed
    # input, and results a step laid out as eager does), before and after the step.
    x = torch.randn(4, 6).t()
    lx = lazy.to_lazy(x)
    assert (lx.stride(), lx.is_contiguous()) == (x.stride(), False)
    y, z = lx * 2, torch.cat([lx, lx.exp()], 1)
    assert (y.stride(), z.stride()) == ((x * 2).stride(), torch.cat([x, x.exp()], 1).stride())
    lazy.mark_step()
    assert y.stride() == (x * 2).stride() and not y.is_contiguous()
    torch.testing.assert_close(lazy.to_eager(y), x * 2)
