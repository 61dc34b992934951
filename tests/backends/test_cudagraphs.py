"""``mode="reduce-overhead"``: recording, replay, static inputs, the shared pool and output
liveness (``kiln/runtime/cudagraphs.py``).

On the CPU (CI) through an emulated recorder, which keeps what matters to the runner: a
recording returns static output tensors, and a replay rewrites those same tensors from the
static inputs' current contents, so a result handed out and then overwritten by a later
replay shows up as a wrong value. With ``KILN_TEST_DEVICE=cuda`` the same tests record real
CUDA graphs (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import gc
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.passes import matmul_padding
from kiln.recording import listen, unlisten
from kiln.runtime import cudagraph_copies, cudagraphs
from kiln.runtime.cudagraphs import CudaGraphStatus

DEVICE = torch.device(os.environ.get("KILN_TEST_DEVICE", "cpu"))


class EmulatedRecorder:
    """Records by running once; replays by running again into the recorded outputs. A CUDA
    recording runs nothing: tensors in ``protect`` (a model's buffers that the graph updates
    in place) are put back as they were after the emulated recording's run.

    A replay also poisons (NaN) the outputs of the recordings made after it in its pool: on
    the GPU their memory may lie in its temporaries, so a runner that replays while someone
    holds such an output gives a wrong value here, as it may there."""

    def __init__(self) -> None:
        self.protect: list[torch.Tensor] = []

    def supports(self, tensor: torch.Tensor) -> str | None:
        return None

    def new_pool(self) -> Any:
        return []  # (the outputs of its recordings, in order)

    def capture(
        self, run: Callable[[], list[torch.Tensor]], pool: Any
    ) -> tuple[Callable[[], None], list[torch.Tensor]]:
        before = [t.clone() for t in self.protect]
        outputs = run()
        for tensor, value in zip(self.protect, before, strict=True):
            tensor.data.copy_(value)
        index = len(pool)
        pool.append([t for t in outputs if t.untyped_storage().data_ptr() not in _read(run)])

        def replay() -> None:
            for static, new in zip(outputs, run(), strict=True):
                if static.data_ptr() != new.data_ptr():
                    static.data.copy_(new)  # (a replay bumps no version counter)
            mine = {t.untyped_storage().data_ptr() for t in outputs}
            for later in pool[index + 1 :]:
                for tensor in later:
                    if (
                        tensor.is_floating_point()
                        and tensor.untyped_storage().data_ptr() not in mine
                    ):
                        tensor.data.fill_(float("nan"))

        return replay, outputs


def _read(run: Callable[[], Any]) -> set[int]:
    """The storages of the static inputs a recorded run reads (the runner's closure holds
    them as a list): outputs there are inputs' memory (a parameter's), not the pool's."""
    cells = [cell.cell_contents for cell in run.__closure__ or ()]
    tensors = [t for value in cells if isinstance(value, list) for t in value]
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


class CountingRecorder:
    """The device's recorder (emulated on the CPU, CUDA graphs on a GPU), counted; it can
    refuse every tensor or fail every recording."""

    def __init__(self, refuse: str | None = None, fail: bool = False) -> None:
        cuda = cudagraphs.CudaRecorder()
        self.base: Any = EmulatedRecorder() if DEVICE.type == "cpu" else cuda
        self.refuse = refuse
        self.fail = fail
        self.captures = 0
        self.replays = 0
        self.pools = 0
        # copied inputs' buffers made in the recording and freed there (cudagraph_copies):
        # on the GPU always; emulated when a test asks (donate())
        self.donates = getattr(self.base, "donates", False)
        self.watched = False  # (donate() ran)
        self.made: list[weakref.ref[torch.Tensor]] = []  # those buffers, once donate() ran
        self.blocks: list[torch.UntypedStorage] = []

    def donate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Donated buffers, watched (``made``). The runner keeps a tensor that does not own
        the memory: the storage is kept here, as the pool keeps the block on the GPU."""
        self.donates = True
        if self.watched:
            return
        self.watched = True
        make = cudagraph_copies.new_buffer

        def kept(*layout: Any) -> torch.Tensor:
            buffer = make(*layout)
            self.made.append(weakref.ref(buffer))
            self.blocks.append(buffer.untyped_storage())
            return buffer

        monkeypatch.setattr(cudagraph_copies, "new_buffer", kept)

    def supports(self, tensor: torch.Tensor) -> str | None:
        return self.refuse or self.base.supports(tensor)

    def new_pool(self) -> Any:
        self.pools += 1
        return self.base.new_pool()

    def capture(
        self, run: Callable[[], list[torch.Tensor]], pool: Any
    ) -> tuple[Callable[[], None], list[torch.Tensor]]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        replay, outputs = self.base.capture(run, pool)

        def counted() -> None:
            self.replays += 1
            replay()

        return counted, outputs


def _fresh(recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch) -> CountingRecorder:
    monkeypatch.setattr(cudagraphs, "RECORDER", recorder)
    kiln.reset()
    gc.collect()  # (runners of earlier tests)
    _EARLIER.clear()
    _EARLIER.update(id(s) for s in cudagraphs.statuses())
    return recorder


@pytest.fixture(params=["copied", "donated"] if DEVICE.type == "cpu" else ["cuda"])
def recorder(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[CountingRecorder]:
    """The device's recorder; on the CPU, each test twice: with static input buffers made
    before recording, and made in the recording and donated to it, as on the GPU."""
    counting = CountingRecorder()
    if request.param == "donated":
        counting.donate(monkeypatch)
    yield _fresh(counting, monkeypatch)
    if DEVICE.type == "cuda":  # PyTorch's own generator still works after the test
        kiln.reset()
        gc.collect()
        torch.randn(1, device=DEVICE)


def randn(*shape: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, requires_grad=requires_grad)


_EARLIER: set[int] = set()  # statuses alive before the test (a failed test's traceback)


def _statuses(name_part: str = "") -> list[CudaGraphStatus]:
    return [s for s in cudagraphs.statuses() if name_part in s.graph and id(s) not in _EARLIER]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(DEVICE)


def test_inference_replays_and_a_held_result_never_changes(recorder: CountingRecorder) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    kept = []
    with torch.no_grad():
        for _ in range(6):
            x = randn(3, 8)
            out = compiled(x)
            torch.testing.assert_close(out, model(x))
            kept.append((out, model(x)))
    for out, expected in kept:  # every result still holds its own call's values
        torch.testing.assert_close(out, expected)
    (status,) = _statuses()
    # calls 1 and 2 warm up (the second compiles nothing), call 3 records and replays, the
    # others replay (results are copies: holding them is safe)
    assert status.state == "recorded" and status.records == 1
    assert status.replays == 4 and status.uncaptured_runs == 0
    assert recorder.captures == 1 and recorder.replays == 4
    assert kiln.counters.captures == 1


def test_inference_results_are_lent_once_dropped_and_kept_ones_stay_right(
    recorder: CountingRecorder,
) -> None:
    """An inference loop that drops its results before the next call gets them uncopied
    (lent: one pool address every call) after ``LEND_AFTER`` checked replays. When the loop
    starts keeping them, no replay overwrites a kept one (the emulated recorder poisons what a
    replay may overwrite): that replay takes a second instance and the runner copies again."""
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    addresses = []
    with torch.no_grad():
        for _ in range(7):
            x = randn(3, 8)
            out = compiled(x)
            torch.testing.assert_close(out, model(x))
            addresses.append(out.data_ptr())
            del out
        (status,) = _statuses()
        assert status.lent and "results lent" in status.line()
        assert addresses[-1] == addresses[-2] and status.records == 1
        kept = []
        for _ in range(4):
            x = randn(3, 8)
            kept.append((compiled(x), model(x)))
    for out, expected in kept:
        torch.testing.assert_close(out, expected)
    assert not status.lent and status.records == 2 and status.uncaptured_runs == 0


def test_a_result_kept_for_good_pins_one_instance_and_the_next_lends(
    recorder: CountingRecorder,
) -> None:
    """A loop that keeps one lent result for good (``first = compiled(x)``, then a loop that
    drops its results) gets a second instance for the replay that found it held, copies until
    ``LEND_AFTER`` replays found the copies dead, then lends that instance's results; the kept
    one is never overwritten, and no third recording is made."""
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(7):
            x = randn(3, 8)
            torch.testing.assert_close(compiled(x), model(x))
        (status,) = _statuses()
        assert status.lent and status.records == 1
        x = randn(3, 8)
        first, expected = compiled(x), model(x)
        addresses = []
        for _ in range(8):
            x = randn(3, 8)
            out = compiled(x)
            torch.testing.assert_close(out, model(x))
            addresses.append(out.data_ptr())
            del out
        torch.testing.assert_close(first, expected)
    assert status.lent and status.records == 2 and status.uncaptured_runs == 0
    assert addresses[-1] == addresses[-2] != first.data_ptr()
    assert first.data_ptr() not in addresses[:2]  # (copies at first, on the new instance)


def test_a_recording_takes_the_memory_of_the_inputs_it_copies(
    recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied input's buffer is made in the recording, held by the host program alone and
    dropped after the step that reads it last: the recording's later steps may take its
    memory (ResNet-50's batch of images), and the runner copies each call's input into it
    through a tensor that does not own it. Every call matches eager; a buffer a program's
    output views stays held (the caller gets that view of its own tensor)."""
    recorder.donate(monkeypatch)
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(6):
            x = randn(3, 8)
            torch.testing.assert_close(compiled(x), model(x))
    made = list(recorder.made)
    assert made and all(buffer() is None for buffer in made)

    def head_and_sum(inputs: Any) -> list[torch.Tensor]:  # (a graph's program: it keeps x)
        (x,) = inputs
        return [x[:, :4], (x * 2).sum(1)]

    graph = kiln.trace(lambda x: (x[:, :4], (x * 2).sum(1)), randn(3, 8))
    family = cudagraphs.Family(recorder)
    runner = cudagraphs.CudaGraphRunner(graph, head_and_sum, family, sizes=None, output_count=2)
    for _ in range(6):
        x = randn(3, 8)
        view, total = runner([x])
        torch.testing.assert_close(total, (x * 2).sum(1))
        assert view.data_ptr() == x.data_ptr() and torch.equal(view, x[:, :4])
    viewed = recorder.made[len(made) :]
    assert len(viewed) == 1 and viewed[0]() is not None
    assert runner.status.records == 1 and runner.status.uncaptured_runs == 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA caching allocator's pool")
def test_on_the_gpu_a_recording_reuses_the_memory_of_the_inputs_it_copies(
    recorder: CountingRecorder,
) -> None:
    """A 64 MiB input read by the first kernel alone: the product after it takes its memory
    in the recording's pool, where without donating it the input's static copy is 64 MiB
    more. Measured as the memory reserved by warm-up, recording and replays."""
    w = torch.randn(2048, 2048, device=DEVICE) / 45

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.sin(), w).relu().sum(0)

    grown = {}
    for donates in (False, True):
        recorder.donates = donates
        kiln.reset()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        compiled = kiln.compile(f, mode="reduce-overhead")
        for _ in range(5):
            x = randn(8192, 2048)
            torch.testing.assert_close(compiled(x), f(x), rtol=1e-3, atol=1e-2)
        del x
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        grown[donates] = (torch.cuda.memory_reserved() - before) / 2**20
        (status,) = _statuses()
        assert status.records == 1 and status.uncaptured_runs == 0
        del compiled, status
    assert grown[False] - grown[True] >= 48, grown


def test_a_lent_result_fed_back_as_the_next_input_stays_right(recorder: CountingRecorder) -> None:
    """Once results are lent, a recurrent loop (``h = model(h)``) passes the pool's own memory
    back in, still held: that replay takes a second instance and the runner copies from then
    on; every step matches eager."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(DEVICE)
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(8):
            x = randn(3, 8)
            torch.testing.assert_close(compiled(x), model(x))
        (status,) = _statuses()
        assert status.lent
        h = randn(3, 8)
        expected = h.clone()
        for _ in range(10):
            h, expected = compiled(h), model(expected)
            torch.testing.assert_close(h, expected)
    assert not status.lent and status.records == 2 and status.uncaptured_runs == 0


def test_a_padded_products_gapped_result_is_lent_too(
    recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16-bit linear whose size is padded for cuBLAS returns a view with the padded row
    stride (GPT-2's logits), as the default mode returns it: copied out of the pool or lent,
    the result has those strides at every call; kept ones stay right."""
    monkeypatch.setattr(matmul_padding, "DEVICE_TYPES", ("cuda", "cpu"))
    torch.manual_seed(0)
    head = nn.Linear(64, 300).to(DEVICE, torch.bfloat16)
    compiled = kiln.compile(head, mode="reduce-overhead")
    strides = []
    with torch.no_grad():
        for _ in range(7):
            x = randn(4, 64).bfloat16()
            out = compiled(x)
            torch.testing.assert_close(out, head(x), rtol=2e-2, atol=2e-2)
            strides.append(out.stride())
            del out
        (status,) = _statuses()
        assert status.lent and set(strides) == {(304, 1)}  # (warm-up, copies, lent)
        kept = [(compiled(x), head(x)) for x in (randn(4, 64).bfloat16() for _ in range(3))]
    for out, expected in kept:
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert not status.lent and status.records == 2


def test_inference_graphs_around_a_break_lend_and_stay_right(recorder: CountingRecorder) -> None:
    """The graph before a graph break hands its result to the graph after it: once both lend,
    each call still matches eager (the second graph copies its lent input in)."""
    model = _mlp()

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = model(x).relu()
        kiln.graph_break()
        return h * 2 + x[:, :4]

    compiled = kiln.compile(fn, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(8):
            x = randn(3, 8)
            torch.testing.assert_close(compiled(x), fn(x))
    statuses = _statuses()
    assert len(statuses) == 2 and all(s.lent and s.records == 1 for s in statuses)
    assert all(s.uncaptured_runs == 0 for s in statuses)


def test_mark_step_begin_releases_values_saved_for_an_abandoned_backward(
    recorder: CountingRecorder,
) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    losses = []
    for _ in range(5):  # training-mode forwards whose backward never runs, losses kept
        losses.append(compiled(randn(3, 8)).sum())
    (forward,) = _statuses("_forward")
    # call 3 recorded; call 4 found its saved values held and recorded a second graph;
    # call 5 found both held and ran without one (INSTANCE_LIMIT recordings at most)
    assert cudagraphs.INSTANCE_LIMIT == 3
    assert (forward.records, forward.replays, forward.uncaptured_runs) == (3, 3, 0)
    losses.append(compiled(randn(3, 8)).sum())
    assert forward.uncaptured_runs == 1 and "saved for a pending backward" in forward.notes[-1]
    for _ in range(3):
        kiln.mark_step_begin()
        x = randn(3, 8)
        loss = compiled(x).sum()
        torch.testing.assert_close(loss, model(x).sum())
        losses.append(loss)
    assert (forward.records, forward.replays, forward.uncaptured_runs) == (3, 6, 1)
    with pytest.raises(RuntimeError, match="mark_step_begin"):
        losses[-2].backward()  # its saved values were overwritten by the last call
    losses[-1].backward()  # the last step's are intact
    for p in model.parameters():
        assert p.grad is not None


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_training_steps_match_eager(recorder: CountingRecorder) -> None:
    torch.manual_seed(0)
    model = _mlp()
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model, mode="reduce-overhead")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(6):
        x, target = randn(5, 8), randn(5, 4)
        for _net, opt, run in (
            (model, optimizer, compiled),
            (reference, reference_optimizer, reference),
        ):
            opt.zero_grad()
            loss = nn.functional.mse_loss(run(x), target)
            loss.backward()
            opt.step()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got.grad, want.grad)
    forward, backward = _statuses("_forward"), _statuses("_backward")
    assert len(forward) == 1 and len(backward) == 1
    assert forward[0].replays == 4 and backward[0].replays == 4
    assert forward[0].uncaptured_runs == 0 and backward[0].uncaptured_runs == 0


def _pair() -> tuple[nn.Module, nn.Module, Any]:
    """A model, an eager copy of it, and the model compiled with CUDA graphs."""
    torch.manual_seed(0)
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    return model, reference, kiln.compile(model, mode="reduce-overhead")


def _same_grads(model: nn.Module, reference: nn.Module) -> None:
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("zero_grad_first", [True, False])
def test_gradients_are_lent_once_the_loop_releases_them(
    recorder: CountingRecorder, zero_grad_first: bool
) -> None:
    """A loop that drops its gradients before the next forward gets them uncopied (lent)
    after ``LEND_AFTER`` checked steps; one that zeroes them after its forward (they are
    alive while the forward replays) keeps getting copies. Both match eager at every step,
    and neither records more than once."""
    model, reference, compiled = _pair()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for _ in range(8):
        x, target = randn(5, 8), randn(5, 4)
        for run, opt in zip((compiled, reference), optimizers, strict=True):
            if zero_grad_first:
                opt.zero_grad()
            loss = nn.functional.mse_loss(run(x), target)
            if not zero_grad_first:
                opt.zero_grad()
            loss.backward()
            opt.step()
        _same_grads(model, reference)
    (forward,) = _statuses("_forward")
    (backward,) = _statuses("_backward")
    assert backward.lent is zero_grad_first
    assert ("results lent" in backward.line()) is zero_grad_first
    assert (forward.records, backward.records) == (1, 1)
    assert forward.uncaptured_runs == backward.uncaptured_runs == 0
    if zero_grad_first:  # .grad is the backward's pool memory: one address every step
        first = [p.grad.data_ptr() for p in model.parameters()]  # type: ignore[union-attr]
        optimizers[0].zero_grad()
        nn.functional.mse_loss(compiled(randn(5, 8)), randn(5, 4)).backward()
        assert [p.grad.data_ptr() for p in model.parameters()] == first  # type: ignore[union-attr]


def test_lent_gradients_kept_or_accumulated_stay_right(recorder: CountingRecorder) -> None:
    """Once gradients are lent, a loop that accumulates micro-batches into ``.grad`` and
    keeps ``torch.autograd.grad`` results across steps still matches eager: a replay never
    overwrites a lent gradient someone holds (on the GPU the next forward's temporaries may
    lie there; the emulated recorder poisons them): the backward takes another instance."""
    model, reference, compiled = _pair()
    for _ in range(6):  # lending starts (warm-up, recording, checked replays)
        x = randn(5, 8)
        for run, net in ((compiled, model), (reference, reference)):
            net.zero_grad()
            run(x).square().mean().backward()
    (backward,) = _statuses("_backward")
    assert backward.lent
    for _ in range(3):  # micro-batches accumulate into the lent .grad
        x = randn(5, 8)
        for run in (compiled, reference):
            run(x).square().mean().backward()
        _same_grads(model, reference)
    # (the first .grad, lent, pins its instance; a second one's gradients are added to it and
    # dropped, so that one may lend in turn)
    assert backward.records == 2 and backward.uncaptured_runs == 0
    kept: dict[str, list[tuple[torch.Tensor, ...]]] = {"kiln": [], "eager": []}
    for _ in range(3):
        x = randn(5, 8)
        for name, run, net in (("kiln", compiled, model), ("eager", reference, reference)):
            kept[name].append(torch.autograd.grad(run(x).sin().sum(), list(net.parameters())))
    for mine, theirs in zip(kept["kiln"], kept["eager"], strict=True):
        torch.testing.assert_close(mine, theirs)
    _same_grads(model, reference)


def test_forward_outputs_are_lent_and_kept_ones_stay_right(recorder: CountingRecorder) -> None:
    """A training loop that drops its outputs (and loss) before the next step gets the
    forward's outputs uncopied (lent) after ``LEND_AFTER`` checked steps, as the backward's
    gradients. When the loop starts keeping its outputs across steps, no replay overwrites a
    kept one (the emulated recorder poisons what a replay may overwrite) and the forward
    copies again; every output and gradient matches eager's."""
    model, reference, compiled = _pair()
    for _ in range(6):
        x = randn(5, 8)
        for run, net in ((compiled, model), (reference, reference)):
            net.zero_grad()
            run(x).square().mean().backward()
        _same_grads(model, reference)
    (forward,) = _statuses("_forward")
    assert forward.lent and "results lent" in forward.line()
    kept: dict[str, list[torch.Tensor]] = {"kiln": [], "eager": []}
    for _ in range(4):
        x = randn(5, 8)
        for name, run, net in (("kiln", compiled, model), ("eager", reference, reference)):
            net.zero_grad()
            out = run(x)
            out.square().mean().backward()
            kept[name].append(out.detach())
        _same_grads(model, reference)
    for mine, theirs in zip(kept["kiln"], kept["eager"], strict=True):
        torch.testing.assert_close(mine, theirs)
    assert not forward.lent
    assert forward.records == 2  # (the replay that found a kept output took a new instance)
    assert forward.uncaptured_runs == 0


@pytest.mark.parametrize("two_forwards", [False, True])
def test_the_backward_borrows_the_forwards_copy_of_an_input_it_reads(
    recorder: CountingRecorder, caplog: pytest.LogCaptureFixture, two_forwards: bool
) -> None:
    """A weight's gradient reads the layer's input: the backward borrows the static copy the
    forward's replay read (no second copy of a ResNet's images, nor its copying each step).
    A second forward before the first backward must not overwrite that copy (the forward
    takes another instance); every gradient matches eager's at every step."""
    caplog.set_level("INFO", logger="kiln.cudagraphs")
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False).to(DEVICE)  # (its backward reads x and nothing else)
    reference = nn.Linear(8, 4, bias=False).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model, mode="reduce-overhead")
    for _ in range(6):
        xs = [randn(5, 8) for _ in range(2 if two_forwards else 1)]
        for net, run in ((model, compiled), (reference, reference)):
            net.zero_grad()
            losses = [run(x).square().mean() * (k + 1) for k, x in enumerate(xs)]
            for loss in reversed(losses):
                loss.backward()
        torch.testing.assert_close(model.weight.grad, reference.weight.grad)
    (forward,) = _statuses("_forward")
    (backward,) = _statuses("_backward")
    recorded = [r.getMessage() for r in caplog.records if "_backward: recorded" in r.getMessage()]
    assert recorded and all("1 inputs copied, 1 static, 1 borrowed" in m for m in recorded)
    assert forward.records == backward.records == (2 if two_forwards else 1)
    assert forward.uncaptured_runs == backward.uncaptured_runs == 0


@pytest.mark.parametrize("marks", [False, True])
def test_two_forwards_before_one_backward(recorder: CountingRecorder, marks: bool) -> None:
    """The second forward would overwrite what the first saved for its backward: it gets a
    recording of its own (and the backward one per forward recording), and both backwards
    see their own saved values."""
    model = _mlp()
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model, mode="reduce-overhead")
    for _ in range(5):
        x1, x2 = randn(4, 8), randn(4, 8)
        if marks:  # (released values are never the ones a pending backward reads)
            kiln.mark_step_begin()
        for net, run in ((model, compiled), (reference, reference)):
            net.zero_grad()
            loss = run(x1).square().mean() + run(x2).sin().mean()
            loss.backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
    (forward,) = _statuses("_forward")
    (backward,) = _statuses("_backward")
    # steps 2-5 replay two forward recordings and two backward ones, nothing uncaptured
    assert (forward.records, forward.replays, forward.uncaptured_runs) == (2, 8, 0)
    assert (backward.records, backward.uncaptured_runs) == (2, 0)


def test_input_mutation_and_views_of_inputs(recorder: CountingRecorder) -> None:
    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x.mul_(2)
        return x + y, y.view(-1)

    compiled = kiln.compile(step, mode="reduce-overhead")
    for _ in range(5):
        x, y = randn(4, 3), randn(4, 3)
        x_ref = x.clone()
        total, flat = compiled(x, y)
        torch.testing.assert_close(x, x_ref * 2)  # mutated once per call
        torch.testing.assert_close(total, x_ref * 2 + y)
        assert flat.data_ptr() == y.data_ptr()  # a view of the caller's tensor, as eager
        flat[0] = 100.0
        assert y[0, 0].item() == 100.0
    (status,) = _statuses()
    assert status.state == "recorded" and status.replays == 3


def test_an_expanded_input_then_a_dense_one_records_again(recorder: CountingRecorder) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    compiled = kiln.compile(f, mode="reduce-overhead")
    inputs = [randn(4, 1).expand(4, 3) for _ in range(3)] + [randn(4, 3) for _ in range(3)]
    for x in inputs:
        torch.testing.assert_close(compiled(x), x * 2 + 1)
    # (capture guards on strides: each layout is its own graph, its own recording)
    assert [(s.records, s.state) for s in _statuses()] == [(1, "recorded")] * 2


def test_a_cotangent_changing_layout_records_the_backward_again(
    recorder: CountingRecorder,
) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    reference = _mlp()
    reference.load_state_dict(model.state_dict())
    for step in range(6):
        x = randn(3, 8)
        for net, run in ((model, compiled), (reference, reference)):
            net.zero_grad()
            out = run(x)
            # sum() gives an expanded cotangent, a weighted sum a dense one
            (out.sum() if step < 3 else (out * out.detach()).sum()).backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
    (backward,) = _statuses("_backward")
    assert backward.records == 2 and backward.state == "recorded"


def test_outputs_sharing_memory_stay_views_of_one_copy(recorder: CountingRecorder) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y, y[1:]

    compiled = kiln.compile(f, mode="reduce-overhead")
    for _ in range(5):
        x = randn(4, 3)
        whole, tail = compiled(x)
        torch.testing.assert_close(whole, x * 2)
        torch.testing.assert_close(tail, (x * 2)[1:])
        whole[1, 0] = 7.0  # as in eager, the second output is a view of the first
        assert tail[0, 0].item() == 7.0
    assert _statuses()[0].replays == 3


def test_transposed_outputs_are_copied_together_in_their_own_layout(
    recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder's attention keys and values come out transposed (dense, not contiguous):
    they are copied out of the pool in one batch with the contiguous result, each in eager's
    strides, and a later replay changes none of them."""
    weight = randn(8, 32)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = (x @ weight).view(2, 5, 4, 8).transpose(1, 2)
        return heads * 2, heads + 1, x.sum(0)

    singles: list[torch.Tensor] = []
    copy_out = cudagraphs.copy_out
    monkeypatch.setattr(
        cudagraphs,
        "copy_out",
        lambda output, *rest: singles.append(output) or copy_out(output, *rest),
    )
    compiled = kiln.compile(f, mode="reduce-overhead")
    held = []
    for _ in range(5):
        x = randn(2, 5, 8)
        got, want = compiled(x), f(x)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
            assert a.stride() == b.stride()
        held.append((got, want))
    for got, want in held:  # (a later replay rewrote the pool, not these)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
    assert singles == [] and _statuses()[0].replays == 3


def test_an_unused_outputs_zero_cotangent_is_not_copied_again(
    recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training graph's output the loss does not use gets a zero cotangent (autograd's
    materialized zeros, made and kept by the graph): once its static buffer holds zeros, a
    replay copies nothing for it. Used in one step, it is copied; unused again, zeroed again."""
    torch.manual_seed(0)
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())

    class TwoOutputs(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.net(x)
            return hidden.sin(), hidden * 3

    zeros: list[torch.Tensor] = []
    copy_into = cudagraphs.copy_into

    def counted(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        if getattr(source, "_kiln_zero", False):
            zeros.append(source)
        return copy_into(target, source)

    monkeypatch.setattr(cudagraphs, "copy_into", counted)
    compiled = kiln.compile(TwoOutputs(model), mode="reduce-overhead")
    eager = TwoOutputs(reference)
    for step in range(8):
        x = randn(5, 8)
        for net, run in ((model, compiled), (reference, eager)):
            net.zero_grad()
            first, second = run(x)
            (first.sum() + (second * second).sum() if step == 5 else first.sum()).backward()
        _same_grads(model, reference)
    (backward,) = _statuses("_backward")
    assert backward.records == 1 and backward.uncaptured_runs == 0
    assert len(zeros) == 2  # the first replay's, and the one after the step that used it


def test_batch_norm_training_updates_running_statistics_once_a_call(
    recorder: CountingRecorder,
) -> None:
    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    model, reference = net().to(DEVICE), net().to(DEVICE)
    reference.load_state_dict(model.state_dict())
    if isinstance(recorder.base, EmulatedRecorder):
        recorder.base.protect = list(model.buffers())
    compiled = kiln.compile(model, mode="reduce-overhead")
    for _ in range(6):
        x = randn(5, 8)
        for net_, run in ((model, compiled), (reference, reference)):
            net_.zero_grad()
            run(x).square().mean().backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
        for got, want in zip(model.buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(got, want)  # running mean, variance, batch count
    (forward,) = _statuses("_forward")
    assert forward.state == "recorded" and forward.replays == 4


def test_moved_parameters_record_again(recorder: CountingRecorder) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        x = randn(2, 8)
        for _ in range(3):
            compiled(x)
        for p in model.parameters():
            p.data = p.data * 1.5  # new memory
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    (status,) = _statuses()
    assert status.records == 2 and status.state == "recorded"


def test_moving_parameters_every_call_turns_graphs_off(recorder: CountingRecorder) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(cudagraphs.RERECORD_LIMIT + 3):
            for p in model.parameters():
                p.data = p.data.clone()
            x = randn(2, 8)
            torch.testing.assert_close(compiled(x), model(x))
    (status,) = _statuses()
    assert status.state == "off" and "moved" in status.reason


@pytest.mark.parametrize(
    ("refuse", "fail", "reason"),
    [("it reads a cpu tensor", False, "cpu tensor"), (None, True, "recording failed")],
)
def test_graphs_that_cannot_be_recorded_run_without(
    monkeypatch: pytest.MonkeyPatch, refuse: str | None, fail: bool, reason: str
) -> None:
    _fresh(CountingRecorder(refuse, fail), monkeypatch)
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            x = randn(2, 8)
            torch.testing.assert_close(compiled(x), model(x))
    (status,) = _statuses()
    assert status.state == "off" and reason in status.reason
    report = str(kiln.explain())
    assert "CUDA graphs:" in report and reason in report


def _programs() -> list[Any]:
    programs: list[Any] = []
    listen(programs, CompiledProgramRecord)
    return programs


def _assert_symbolic(programs: list[Any], count: int, sizes: int) -> None:
    """``count`` programs, each for a range of sizes (on CUDA, one per Triton block bucket
    the ``sizes`` fall in: fewer than one per size)."""
    assert all(p.sizes.startswith("any sizes where") for p in programs), programs
    if DEVICE.type == "cpu":
        assert len(programs) == count
    else:
        assert count <= len(programs) < count * sizes


def test_one_program_and_one_recording_per_size_up_to_the_limit(
    recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudagraphs, "SIZE_LIMIT", 2)
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead", dynamic=True)
    programs = _programs()
    try:
        with torch.no_grad():
            for batch in (2, 3, 5, 7, 2, 5):
                for _ in range(3):
                    x = randn(batch, 8)
                    torch.testing.assert_close(compiled(x), model(x))
    finally:
        unlisten(programs)
    assert kiln.counters.captures == 1
    _assert_symbolic(programs, 1, 4)  # one program for every size, recorded per size
    # (replays: 4 and 2 on the CPU; on CUDA a new size's first call also builds a kernel,
    # so its warm-up takes one call more, and whether results are lent varies with that)
    lines = [
        re.sub(r"\d+ replay\(s\)(, results lent)?", "N replay(s)", s.line()) for s in _statuses()
    ]
    lines.sort()
    assert lines == [
        "call at other sizes: no CUDA graph (2 sizes of this graph already have one)",
        "call at s0=2, s1=8: CUDA graph recorded (1 recording(s), N replay(s))",
        "call at s0=3, s1=8: CUDA graph recorded (1 recording(s), N replay(s))",
    ]
    assert all(s.replays >= 1 for s in _statuses() if s.state == "recorded")


def test_training_over_sizes_compiles_once_and_records_per_size(
    recorder: CountingRecorder,
) -> None:
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    compiled = kiln.compile(model, mode="reduce-overhead", dynamic=True)
    programs = _programs()
    try:
        for batch in (3, 5, 3, 6, 5, 3):
            for _ in range(2):
                x = randn(batch, 8)
                compiled(x).square().sum().backward()
                reference(x).square().sum().backward()
                for got, want in zip(_grads(model), _grads(reference), strict=True):
                    torch.testing.assert_close(got, want)
                model.zero_grad(set_to_none=True)
                reference.zero_grad(set_to_none=True)
    finally:
        unlisten(programs)
    assert kiln.counters.captures == 1
    _assert_symbolic(programs, 2, 3)  # a forward and a backward, for every size
    recorded = sorted(s.graph for s in _statuses() if s.state == "recorded")
    assert recorded == [
        f"call_{part} at s0={batch}, s1=8"
        for part in ("backward", "forward")
        for batch in (3, 5, 6)
    ]
    assert all(s.replays >= 1 for s in _statuses())


def test_dropout_masks_change_between_replays(recorder: CountingRecorder) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5, training=True).sum()

    compiled = kiln.compile(f, mode="reduce-overhead")
    grads = []
    for _ in range(5):
        x = randn(64, requires_grad=True)
        out = compiled(x)
        out.backward()
        assert x.grad is not None
        # forward and backward used the same mask: out == sum(x * grad)
        torch.testing.assert_close(out, (x.detach() * x.grad).sum())
        grads.append(x.grad)
    masks = {tuple((g != 0).tolist()) for g in grads}
    assert len(masks) == 5  # a fresh mask every call, replays included
    (forward,) = _statuses("_forward")
    (backward,) = _statuses("_backward")
    assert (forward.line(), backward.line()) == (
        "f_forward: CUDA graph recorded (1 recording(s), 3 replay(s))",
        "f_backward: CUDA graph recorded (1 recording(s), 3 replay(s))",
    )


def test_graphs_around_a_break_each_replay(recorder: CountingRecorder) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) * 2
        kiln.graph_break()
        return y.sin() + 1

    compiled = kiln.compile(f, mode="reduce-overhead")
    for _ in range(5):
        x = randn(6)
        torch.testing.assert_close(compiled(x), f(x))
    statuses = _statuses()
    assert len(statuses) == 2
    assert all(s.state == "recorded" and s.replays == 3 for s in statuses)


def test_explain_shows_the_cuda_graphs(recorder: CountingRecorder) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            compiled(randn(2, 8))
    report = kiln.explain()
    (status,) = _statuses()
    line = f"{status.graph}: CUDA graph recorded (1 recording(s), 1 replay(s))"
    assert line in report.cudagraphs and f"CUDA graphs:\n  {line}" in str(report)


def test_explain_of_a_compiled_function_uses_its_mode(recorder: CountingRecorder) -> None:
    compiled = kiln.compile(_mlp(), mode="reduce-overhead")
    report = kiln.explain(compiled, randn(2, 8))  # (a training call: forward and backward)
    lines = ["call_forward: CUDA graph warming up", "call_backward: CUDA graph warming up"]
    assert report.cudagraphs == lines
    assert "CUDA graphs:\n  " + "\n  ".join(lines) in str(report)
    assert kiln.explain(kiln.compile(_mlp()), randn(2, 8)).cudagraphs == []


def test_max_autotune_tunes_in_the_warm_up_then_records(
    recorder: CountingRecorder, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    pytest.importorskip("triton")
    from kiln.config import config
    from kiln.runtime import autotune

    measured: list[str] = []

    def timer(name: str, run: Callable[[], None], device: torch.device) -> float:
        measured.append(name)
        run()
        return float(len(measured))  # the heuristic (measured first) wins

    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(autotune, "tuning", autotune.Tuning(timer=timer))

    def softmax(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 2, dim=-1)

    options = {"codegen": "triton"} if DEVICE.type == "cpu" else {}
    compiled = kiln.compile(softmax, mode="max-autotune", options=options)
    for call in range(5):
        x = randn(8, 100)
        torch.testing.assert_close(compiled(x), softmax(x))
        if call == 0:
            tuned = len(measured)
    assert tuned > 1 and len(measured) == tuned  # tuned at the first launch, once
    (status,) = _statuses()
    assert status.state == "recorded" and status.replays == 3


def test_a_graph_that_compiles_on_every_call_is_never_recorded(
    recorder: CountingRecorder,
) -> None:
    model = _mlp()
    compiled = kiln.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        compiled(randn(2, 8))  # capture, and the first warm-up call
        with warnings.catch_warnings():  # (isinstance on every object: deprecated modules)
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            (runner,) = [o for o in objects if isinstance(o, cudagraphs.CudaGraphRunner)]
        inner = runner.compiled

        def compiles_each_call(inputs: Any) -> list[torch.Tensor]:
            cudagraphs.record_event(object())  # (what compiling something records)
            return inner(inputs)

        runner.compiled = compiles_each_call
        for _ in range(5):
            x = randn(2, 8)
            torch.testing.assert_close(compiled(x), model(x))
    (status,) = _statuses()
    assert status.state == "off" and "compiled something on each" in status.reason
    assert recorder.captures == 0


def test_a_pool_whose_graphs_all_died_is_never_recorded_into(recorder: CountingRecorder) -> None:
    """Capture's caches share a pipeline (and its pool) among compiles with equal options:
    resume functions are compiled through the first such pipeline. PyTorch refuses a
    recording into a pool whose graphs were all destroyed (an internal assert in its caching
    allocator, seen on the GPU), so such a family starts a new pool."""

    def run_three_calls() -> None:
        def f(x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x) * 2
            kiln.graph_break()
            return y.sin() + 1

        # (options no other test uses, nor this one's other recorder: the first pipeline of
        # them is this test's)
        limit = 6 if recorder.donates else 7
        compiled = kiln.compile(f, mode="reduce-overhead", options={"recompile_limit": limit})
        for _ in range(3):
            x = randn(6)
            torch.testing.assert_close(compiled(x), f(x))

    run_three_calls()
    first = recorder.pools
    kiln.reset()
    gc.collect()  # (the first function's graphs are destroyed)
    run_three_calls()
    # the second function's own pipeline starts a pool; so does the first pipeline's family,
    # which compiles the second function's resume graph and whose graphs all died
    assert recorder.pools == first + 2 and recorder.captures == 4


def test_default_mode_has_no_cuda_graphs(recorder: CountingRecorder) -> None:
    compiled = kiln.compile(_mlp())
    with torch.no_grad():
        for _ in range(3):
            compiled(randn(2, 8))
    assert recorder.captures == 0 and not _statuses()
