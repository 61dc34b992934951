"""One measurement: one model, one mode, one compiler, in the process that runs it.

``kiln bench`` starts ``python -m kiln.bench.worker JOB`` once per compiler and row, so the
caches, the compiler's imports and the memory peak of one measurement never leak into
another. The worker talks back on stdout, one line per event::

    kiln-bench-phase compiling + first call
    kiln-bench-result {"compiler": "kiln", "first_call_s": 1.2, ...}

The eager worker runs first and saves its results (outputs per input set, or the loss and
every gradient of one training step) to ``Job.reference``; the compiled workers compare
theirs with it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.backends import roofline
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.compare import (
    TOLERANCES,
    as_close_to_truth,
    relative_errors,
    relative_norm_errors,
)
from kiln.bench.models import MODELS, primary_output, training_loss
from kiln.bench.timing import PeakMemory, median_seconds, timed
from kiln.capture.guards import native_guards
from kiln.recording import recording

PHASE = "kiln-bench-phase "
RESULT = "kiln-bench-result "
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILERS = ("eager", "torch", "kiln", "kiln-dynamic")
STEADY_STEPS = 4  # CUDA: steps run before the memory peak is measured (see _measure)
COMPILER_TITLES = {
    "eager": "eager",
    "torch": "torch.compile",
    "kiln": "kiln.compile",
    "kiln-dynamic": "kiln.compile(dynamic=True)",
}


@dataclass
class Job:
    """What one worker measures. ``warm_start``: only the first call, in a second process that
    finds the disk caches the first one filled. ``repeat``: eager again, compared with the
    first eager run instead of saving (the run-to-run variation compilers are judged by)."""

    model: str
    mode: str
    compiler: str
    device: str
    dtype: str
    batch: int
    reference: str
    compile_mode: str | None = None
    warm_start: bool = False
    input_sets: int = 3
    budget_s: float = 2.0
    threads: int | None = None
    repeat: bool = False
    profile: bool = False


@dataclass
class Measurement:
    """What one worker measured; ``error`` is set when the compiler (or the model) failed."""

    compiler: str
    warm_start: bool = False
    first_call_s: float | None = None
    median_ms: float | None = None
    samples: int = 0
    peak_mib: float | None = None
    reserved_mib: float | None = None  # CUDA: segments reserved, CUDA-graph pools included
    max_rel_error: float | None = None
    ok: bool = True
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        return cls(**data)


Report = Callable[[str], None]


def measure(job: Job, report: Report) -> Measurement:
    """Run ``job``; failures become ``Measurement.error`` (the table shows them)."""
    result = Measurement(job.compiler, job.warm_start)
    try:
        _measure(job, report, result)
    except Exception as error:
        traceback.print_exc()  # the table shows one line; the log keeps the whole story
        result.ok = False
        result.error = _one_line(error)
    return result


def _measure(job: Job, report: Report, result: Measurement) -> None:
    device = torch.device(job.device)
    dtype = DTYPES[job.dtype]
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    memory = PeakMemory(device)
    memory.start()
    report("building model")
    torch.manual_seed(0)
    workload = MODELS[job.model].build(job.batch)
    model = workload.model.to(device).train(job.mode == "train")
    inputs = [_input_set(workload.make_input, index, device) for index in range(job.input_sets)]
    # torch.compile's CUDA graphs overwrite their outputs on the next call (reading an older
    # one raises): mark each step and clone inference outputs, as its docs ask. Kiln's
    # results are copies already.
    marks = job.compiler == "torch" and job.compile_mode in ("reduce-overhead", "max-autotune")
    step = _step(job.mode, device, dtype, list(model.parameters()), marks)
    reference_run = job.compiler == "eager" and not job.repeat
    report("first call" if job.compiler == "eager" else "compiling + first call")
    with _compiler_context(job.compiler), recording(CompiledProgramRecord) as programs:
        (runner, output), result.first_call_s = timed(
            lambda: _first_call(job, model, step, inputs), device
        )
        first = None if job.compiler == "eager" else _snapshot(job, model, output)
        del output  # (a loop drops its results: one held across the steps below is not theirs)
        report("saving reference results" if reference_run else "checking against eager")
        _check(job, model, runner, step, inputs, result, dtype, first)
        if not job.warm_start and not job.repeat:
            if job.compiler == "kiln":
                # On a fresh machine the native guard extension is still being built (15-20 s,
                # once per machine): time what every later call on this machine runs.
                native_guards.wait(timeout=120)
            report("timing")
            if device.type == "cuda":
                # The peak of the timed steps (weights, inputs and everything one step holds):
                # compiling and the check against eager's saved outputs are not the model's,
                # nor what the steps before the steady state cached (CUDA graphs' first steps
                # copy gradients that later steps lend).
                for _ in range(STEADY_STEPS):
                    step(runner, inputs[0])
                memory.start()
            seconds, result.samples = median_seconds(
                lambda x: step(runner, x), inputs, device, budget_s=job.budget_s
            )
            result.median_ms = seconds * 1e3
            if job.profile and device.type == "cuda" and job.compiler.startswith("kiln"):
                compiled = [record.program for record in programs if record.program]
                times = roofline.measure(lambda: step(runner, inputs[0]), compiled)
                result.notes += roofline.report(times, device, top=12)
    result.peak_mib = memory.peak() / 2**20
    reserved = memory.reserved()
    result.reserved_mib = None if reserved is None else reserved / 2**20
    if reference_run:
        report("float64 oracle")
        _save_oracle(job, model, inputs, device, result)
    if job.compiler in ("kiln", "kiln-dynamic"):
        result.notes += _kiln_notes(job.compiler, programs)


def _input_set(
    make: Callable[[torch.Generator], tuple[torch.Tensor, ...]], index: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1000 + index)
    return tuple(tensor.to(device) for tensor in make(generator))


Step = Callable[[Callable[..., Any], tuple[torch.Tensor, ...]], torch.Tensor]


def _step(
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    params: list[nn.Parameter],
    marks: bool = False,
) -> Step:
    """One benchmark step: inference returns the output tensor under ``no_grad``; training
    clears the gradients, runs forward and backward and returns the loss. ``marks``: begin
    each step with ``torch.compiler.cudagraph_mark_step_begin()`` and return a clone of the
    inference output (torch.compile's CUDA graphs)."""

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def infer(runner: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if marks:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), autocast():
            output = primary_output(runner(*inputs))
            return output.clone() if marks else output

    def train(runner: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if marks:
            torch.compiler.cudagraph_mark_step_begin()
        for param in params:
            param.grad = None
        with autocast():
            loss = training_loss(runner(*inputs))
        loss.backward()
        return loss.detach()

    return infer if mode == "infer" else train


def prepare(
    name: str, mode: str, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[nn.Module, tuple[torch.Tensor, ...], Step]:
    """A suite model (seeded, its suite batch) on ``device`` in ``mode``, its first input set
    and its benchmark step: the setup of the scripts in ``benchmarks/``."""
    spec = MODELS[name]
    torch.manual_seed(0)
    workload = spec.build(spec.batch)
    model = workload.model.to(device).train(mode == "train")
    inputs = tuple(t.to(device) for t in workload.make_input(torch.Generator().manual_seed(0)))
    return model, inputs, _step(mode, device, dtype, list(model.parameters()))


def _first_call(
    job: Job, model: nn.Module, step: Step, inputs: list[Any]
) -> tuple[Callable[..., Any], torch.Tensor]:
    """Compile ``model`` and run the first step (what the first-call column times); the
    runner and the step's result."""
    runner: Callable[..., Any] = model
    if job.compiler == "torch":
        runner = torch.compile(model, mode=job.compile_mode)
    elif job.compiler in ("kiln", "kiln-dynamic"):
        import kiln

        dynamic = True if job.compiler == "kiln-dynamic" else None
        runner = kiln.compile(model, mode=job.compile_mode, dynamic=dynamic)
    return runner, step(runner, inputs[0])


def _snapshot(job: Job, model: nn.Module, output: torch.Tensor) -> list[torch.Tensor]:
    """One step's results on the CPU, as the correctness column compares them: the output of
    input set 0 (training: the loss), then in training every parameter's gradient."""
    tensors = [output]
    if job.mode == "train":
        tensors += [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
        ]
    return [tensor.detach().cpu() for tensor in tensors]


def _check(
    job: Job,
    model: nn.Module,
    runner: Callable[..., Any],
    step: Step,
    inputs: list[Any],
    result: Measurement,
    dtype: torch.dtype,
    first: list[torch.Tensor] | None = None,
) -> None:
    """Save (eager) or compare (compilers) the results: training, the loss and every gradient of
    one step on input set 0; inference, the whole output of input set 0 and an evenly spaced
    sample of the others' (GPT-2's logits are 1.6 GB a set: the reference file stays small,
    while a result that wrongly ignores its input still shows). ``first``: the first call's
    results (``_snapshot``), judged too: a fault of the compiling call alone must show."""
    tensors, names = _results(job, model, runner, step, inputs)
    if job.compiler == "eager" and not job.repeat:
        torch.save(tensors, job.reference)
        result.max_rel_error = 0.0
        return
    expected = torch.load(job.reference, weights_only=True)
    measure = relative_norm_errors if job.mode == "train" else relative_errors
    tolerance = TOLERANCES.get(dtype, 1e-3)
    every: list[float] = []
    verdicts: list[bool] = []
    for when, found in (("", tensors), ("first call: ", first or [])):
        errors = measure(found, expected[: len(found)])
        every += errors
        outside = [i for i, error in enumerate(errors) if not error <= tolerance]
        if not outside:
            continue
        if len(errors) > len(names):  # (no names to judge them by)
            verdicts.append(False)
            continue
        worst = max(outside, key=lambda i: errors[i] if errors[i] == errors[i] else float("inf"))
        who = COMPILER_TITLES.get(job.compiler, job.compiler)
        result.notes.append(f"{who}: {when}largest error: {names[worst]} ({errors[worst]:.2g})")
        verdicts.append(_judged_by_oracle(job, found, expected, outside, names, measure, result))
    result.max_rel_error = max(every) if all(e == e for e in every) else float("nan")
    result.ok = all(verdicts)


def _results(
    job: Job, model: nn.Module, runner: Callable[..., Any], step: Step, inputs: list[Any]
) -> tuple[list[torch.Tensor], list[str]]:
    """What the correctness column compares, on the CPU: training, the loss and every gradient
    of one step on input set 0; inference, the whole output of input set 0 and an evenly
    spaced sample of the others' (GPT-2's logits are 1.6 GB a set: the reference file stays
    small, while a result that wrongly ignores its input still shows)."""
    tensors = _snapshot(job, model, step(runner, inputs[0]))
    if job.mode == "train":
        names = ["loss", *(f"grad of {name}" for name, _ in model.named_parameters())]
        return tensors, names
    tensors += [_spaced_sample(step(runner, x)).detach().cpu() for x in inputs[1:]]
    return tensors, ["output", *(f"output of input set {i}" for i in range(1, len(inputs)))]


def _save_oracle(
    job: Job, model: nn.Module, inputs: list[Any], device: torch.device, result: Measurement
) -> None:
    """Eager's results in float64 (no autocast), next to the reference, for judging tensors
    that are rounding noise in eager itself. Run after the timings and the memory peak."""
    try:
        exact = copy.deepcopy(model).double()
        as64 = [tuple(t.double() if t.is_floating_point() else t for t in x) for x in inputs]
        step = _step(job.mode, device, torch.float32, list(exact.parameters()))
        with torch.backends.cudnn.flags(allow_tf32=False), _no_tf32_matmul():
            tensors, _ = _results(job, exact, exact, step, as64)
        torch.save(tensors, job.reference + ".fp64")
    except Exception as error:  # the column then judges against bf16 eager alone
        result.notes.append(f"no float64 oracle: {_one_line(error)[:120]}")


@contextlib.contextmanager
def _no_tf32_matmul() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _judged_by_oracle(
    job: Job,
    tensors: list[torch.Tensor],
    expected: list[torch.Tensor],
    outside: list[int],
    names: list[str],
    measure: Callable[[Any, Any], list[float]],
    result: Measurement,
) -> bool:
    """Whether every tensor outside the tolerance is as close to eager's float64 run as eager
    is (see ``kiln.bench.compare``); says so in the notes either way."""
    path = job.reference + ".fp64"
    if not os.path.exists(path):
        return False
    truth = torch.load(path, weights_only=True)
    mine = measure([tensors[i] for i in outside], [truth[i] for i in outside])
    eagers = measure([expected[i] for i in outside], [truth[i] for i in outside])
    ratios = [m / e if e > 0 else float("inf") for m, e in zip(mine, eagers, strict=True)]
    worst = max(range(len(outside)), key=lambda k: ratios[k] if ratios[k] == ratios[k] else 1e30)
    verdict = as_close_to_truth(mine, eagers)
    how = "as close to a float64 run as eager is" if verdict else "farther from float64 than eager"
    who = COMPILER_TITLES.get(job.compiler, job.compiler)
    result.notes.append(
        f"{who}: {len(outside)} tensor(s) outside the tolerance against eager are {how} (worst: "
        f"{names[outside[worst]]}, {mine[worst]:.2g} against eager's {eagers[worst]:.2g})"
    )
    return verdict


def _spaced_sample(tensor: torch.Tensor, count: int = 2**20) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat[:: max(1, flat.numel() // count)]


@contextlib.contextmanager
def _compiler_context(compiler: str) -> Iterator[None]:
    """Fresh compiler state (for in-process runs); Kiln's fallback warnings are counted in
    ``kiln.counters`` and reported as notes instead of interleaving with the progress line."""
    if compiler in ("kiln", "kiln-dynamic"):
        import kiln

        kiln.reset()
    elif compiler == "torch" and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()  # in-process only: a fresh worker's first call pays the import
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kiln: ")
        yield


def _kiln_notes(name: str, programs: Sequence[CompiledProgramRecord] = ()) -> list[str]:
    """What Kiln made of the model: graphs, breaks, frames it ran uncompiled (and why); of
    ``programs`` (what it compiled), how many products max-autotune ran as templates."""
    import kiln

    counters = kiln.counters
    notes = [
        f"{name}: {counters.graphs} graph(s), {len(counters.graph_breaks)} break(s), "
        f"{len(counters.fallbacks)} frame(s) uncompiled, {len(counters.recompiles)} recompile(s)"
    ]
    reasons = {f"{record.function}: {record.reason.value}" for record in counters.fallbacks}
    notes += [f"uncompiled {reason}" for reason in sorted(reasons)[:3]]
    notes += [f"{name}: {line}" for line in kiln.explain().cudagraphs[:4]]  # (reduce-overhead)
    pairs = [t for record in programs for t in record.tuned if " with " in t.kernel]
    if pairs:
        templates = sum(t.chosen.startswith("template") for t in pairs)
        notes.append(f"{name}: max-autotune: {templates} of {len(pairs)} products as templates")
    return notes


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:300]


def main(argv: list[str]) -> int:
    """``python -m kiln.bench.worker JOB_JSON``: measure, print phases and the result."""

    def report(phase: str) -> None:
        print(PHASE + phase, flush=True)

    job = Job(**json.loads(argv[0]))
    result = measure(job, report)
    print(RESULT + json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
