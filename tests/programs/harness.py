"""The real-programs harness: a training or inference program, run eagerly and compiled on
several *different* inputs, must give eager's outputs, gradients and side effects, with the
compile counts its table row states.

Why a second harness: ``tests/capture/harness.py`` calls a program twice with the same inputs,
so a compiled frame that kept returning its first call's result passed it. Here every call
makes new inputs: by default new random values at the first shapes twice, then other shapes
(``Program.variants``).

A :class:`Program` row names:

- ``build``: a zero-argument factory of the program: an ``nn.Module`` (built once; the compiled
  side gets a ``copy.deepcopy``), a function or a bound method (built twice with the global
  RNG restored in between, so closures hold identical weights but separate state).
- ``inputs(variant)``: the arguments of one call, a tuple or a :class:`Call` (keywords, and
  targets only the loss reads), made anew for every call and deep-copied for each side.
- ``train``: after each call, a backward from ``loss(out, *targets)`` (by default the dot
  product of every differentiable output with a fixed random cotangent, never a plain sum,
  which a wrong gradient can survive); the loss, every parameter's ``.grad`` (None against a
  tensor is a failure) and the gradients of leaf inputs must match; ``optimizer`` then steps
  both sides every ``accumulate`` calls and every parameter and buffer must match.

After each call: the outputs (``assert_same`` of the capture harness, NaN equal to NaN,
aliasing of inputs), then what it printed, warned and logged, the inputs (written in place),
the program's state (module parameters, buffers and attributes; closure containers and
generators) and the global RNG's state; then the backward. After the run, the counters:

- ``graphs``: graphs the first call compiles; each later call with an unseen variant compiles
  ``later_graphs`` (default ``graphs``: every graph is specialised on shapes), a repeated
  variant none; a tuple gives each call's count.
- ``breaks``: the first call's graph-break reasons, as a multiset; a later call may repeat a
  part of them (a caller that does not read the new shapes keeps its entry).
- ``captures``: at most this many frames captured by the first call (default one, plus two
  per break: a resume function and a caller's); at most as many by any later call.
- no recompile for a call whose signature (tensor metadata, non-tensor argument values,
  modules' training flags and Parameter objects) was seen before, unless ``dynamic``: a shape
  produced from data (``x[x > 0]``) may recompile what follows, Kiln has no dynamic shapes.
- ``skips``: the frames the whole run ran uncompiled, as a multiset; by default none, so a
  fallback where a graph break would do is a failure.

Each kind of failure is its own exception class, raised in the order above (a wrong value is
worse than a wrong count), so a row's ``xfail(raises=...)`` holds only while the program fails
the way its reason says.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from torch import nn

import kiln

from .comparison import (
    guarded_state,
    parameters,
    same,
    same_aliasing,
    signature,
    state_of,
    tensors,
)

# ---------------------------------------------------------------------------------------------
# Failures


class ProgramFailure(AssertionError):
    """The compiled program differs from eager."""


class WrongOutput(ProgramFailure):
    """Outputs differ (values, dtypes, shapes, ``requires_grad``, containers, aliasing)."""


class WrongSideEffect(ProgramFailure):
    """Printed text, warnings, log records, inputs written in place, module or closure state,
    or the global RNG's state differ."""


class WrongGrad(ProgramFailure):
    """The loss, a parameter's or input's ``.grad`` (None against a tensor included), or the
    parameters after an optimizer step differ."""


class CompiledRaised(ProgramFailure):
    """The compiled call or its backward raised where eager did not."""


class UnexpectedFallback(ProgramFailure):
    """Frames ran uncompiled other than those the row expects."""


class WrongCounters(ProgramFailure):
    """Graph, break, capture or recompile counts differ from the row's."""


# ---------------------------------------------------------------------------------------------
# Table rows


@dataclasses.dataclass(frozen=True)
class Call:
    """The arguments of one call, and what only the loss reads (``loss(out, *targets)``: the
    labels of a model that returns logits)."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    targets: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Xfail:
    """A known Kiln bug: the program fails with ``failure`` for ``reason``."""

    failure: type[ProgramFailure]
    reason: str


@dataclasses.dataclass(frozen=True)
class Program:
    """One table row (see the module docstring)."""

    id: str
    build: Callable[[], Any]
    inputs: Callable[[int], Any]
    variants: tuple[int, ...] = (0, 0, 1)
    train: bool = False
    loss: Callable[..., torch.Tensor] | None = None
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
    accumulate: int = 1
    graphs: int | tuple[int, ...] = 1
    later_graphs: int | None = None
    breaks: tuple[kiln.BreakReason, ...] = ()
    captures: int | None = None
    skips: tuple[kiln.SkipReason, ...] = ()
    dynamic: bool = False
    backend: str = "kiln"
    options: Mapping[str, Any] | None = None
    compile: Callable[[Any], Any] | None = None  # instead of kiln.compile(program, ...)
    context: Callable[[], AbstractContextManager[Any]] | None = None  # around each call
    between: Callable[[Any, int], None] | None = None  # before call i > 0, on both sides
    atol: float = 1e-5
    rtol: float = 1e-5
    slow: bool = False
    xfail: Xfail | None = None

    def param(self) -> Any:
        """The row as a ``pytest.param`` carrying its slow and strict-xfail marks."""
        marks: list[Any] = []
        if self.slow:
            marks.append(pytest.mark.slow)
        if self.xfail is not None:
            marks.append(
                pytest.mark.xfail(strict=True, raises=self.xfail.failure, reason=self.xfail.reason)
            )
        return pytest.param(self, id=self.id, marks=marks)


def params(programs: Sequence[Program]) -> list[Any]:
    """``pytest.param``s of a table, refusing duplicate ids (a row would silently vanish)."""
    counts = collections.Counter(p.id for p in programs)
    duplicates = [name for name, n in counts.items() if n > 1]
    assert not duplicates, f"duplicate program ids {duplicates}"
    return [p.param() for p in programs]


# ---------------------------------------------------------------------------------------------
# One call


@dataclasses.dataclass
class Observation:
    """What one call did: its result or exception, and what it printed, warned and logged."""

    result: Any
    error: Exception | None
    stdout: str
    warnings: list[str]
    logs: list[str]
    rng: torch.Tensor


class _Records(logging.Handler):
    """The program's log records (Kiln's own loggers are not the program's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith("kiln"):
            self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _observe(
    fn: Callable[[], Any], context: Callable[[], AbstractContextManager[Any]] | None
) -> Observation:
    buffer = io.StringIO()
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    result: Any = None
    error: Exception | None = None
    try:
        with contextlib.redirect_stdout(buffer), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with context() if context is not None else contextlib.nullcontext():
                try:
                    result = fn()
                except Exception as raised:
                    error = raised
    finally:
        root.removeHandler(records)
    said = [f"{w.category.__name__}: {w.message}" for w in caught]
    return Observation(
        result,
        error,
        buffer.getvalue(),
        [w for w in said if "kiln" not in w],  # Kiln's own warnings are not the program's
        records.messages,
        torch.get_rng_state(),
    )


@contextlib.contextmanager
def _failing_as(kind: type[ProgramFailure], where: str) -> Iterator[None]:
    """Turn the assertions of one check into the failure class it stands for."""
    try:
        yield
    except ProgramFailure:
        raise
    except AssertionError as error:
        raise kind(f"{where}: {error}") from None


@dataclasses.dataclass
class _Side:
    """One side of the comparison: the program, how it is called, its optimizer."""

    target: Any
    call: Callable[..., Any]
    optimizer: torch.optim.Optimizer | None = None


def _arguments(call: Call) -> tuple[Any, ...]:
    return (call.args, dict(call.kwargs))


def _compare_call(
    program: Program,
    obs: tuple[Observation, Observation],
    ins: tuple[Call, Call],
    sides: tuple[_Side, _Side],
    where: str,
) -> None:
    """Outputs, then side effects, of one call (eager first in each pair)."""
    eager, compiled = obs
    if eager.error is not None:  # a broken table row, not a Kiln bug
        raise AssertionError(f"{program.id}: eager raised") from eager.error
    if compiled.error is not None:
        error = compiled.error
        raise CompiledRaised(f"{where}: {type(error).__name__}: {error}") from error
    assert next(tensors(eager.result), None) is not None, f"{program.id} returns no tensor"
    tolerance = {"atol": program.atol, "rtol": program.rtol}
    with _failing_as(WrongOutput, where):
        same(compiled.result, eager.result, path="out", **tolerance)
        same_aliasing(compiled.result, eager.result, _arguments(ins[1]), _arguments(ins[0]))
    with _failing_as(WrongSideEffect, where):
        assert compiled.stdout == eager.stdout, (
            f"printed {compiled.stdout!r}, eager printed {eager.stdout!r}"
        )
        assert compiled.warnings == eager.warnings, (
            f"warned {compiled.warnings}, eager {eager.warnings}"
        )
        assert compiled.logs == eager.logs, f"logged {compiled.logs}, eager {eager.logs}"
        inputs = (_arguments(ins[1]), _arguments(ins[0]))
        same(*inputs, path="inputs after the call", **tolerance)
        same(state_of(sides[1].target), state_of(sides[0].target), path="state", **tolerance)
        assert torch.equal(compiled.rng, eager.rng), (
            "the global RNG advanced differently from eager"
        )


# ---------------------------------------------------------------------------------------------
# Training


def _default_loss(out: Any, call: int) -> torch.Tensor | None:
    """Each differentiable floating output dotted with a random cotangent fixed by the call."""
    terms = []
    for i, tensor in enumerate(tensors(out)):
        if tensor.requires_grad and tensor.is_floating_point():
            generator = torch.Generator().manual_seed(1000 * call + i)
            cotangent = torch.randn(tensor.shape, generator=generator)
            terms.append((tensor.float() * cotangent).sum())
    return torch.stack(terms).sum() if terms else None


def _loss(program: Program, out: Any, inputs: Call, call: int) -> torch.Tensor | None:
    if program.loss is not None:
        return program.loss(out, *inputs.targets)
    return _default_loss(out, call)


def _grad_leaves(call: Call) -> list[tuple[str, torch.Tensor]]:
    leaves = [t for t in tensors(_arguments(call)) if t.is_leaf and t.requires_grad]
    return [(f"input {i}", t) for i, t in enumerate(leaves)]


def _compare_grads(
    eager: Sequence[tuple[str, torch.Tensor]],
    compiled: Sequence[tuple[str, torch.Tensor]],
    program: Program,
) -> None:
    for (name, e), (_, c) in zip(eager, compiled, strict=True):
        assert (c.grad is None) == (e.grad is None), (
            f"{name}.grad is {'None' if c.grad is None else 'a tensor'} compiled, "
            f"{'None' if e.grad is None else 'a tensor'} in eager"
        )
        if e.grad is not None:
            torch.testing.assert_close(
                c.grad,
                e.grad,
                atol=program.atol,
                rtol=program.rtol,
                equal_nan=True,
                msg=lambda m, n=name: f"{n}.grad: {m}",
            )


def _backward(
    program: Program,
    sides: tuple[_Side, _Side],
    ins: tuple[Call, Call],
    obs: tuple[Observation, Observation],
    call: int,
) -> None:
    """The backward of one call on both sides, every gradient compared, then the optimizer."""
    where = f"call {call + 1} backward"
    eager_loss = _loss(program, obs[0].result, ins[0], call)
    assert eager_loss is not None, f"{program.id}: a training program with no differentiable output"
    eager_loss.backward()
    try:
        compiled_loss = _loss(program, obs[1].result, ins[1], call)
        assert compiled_loss is not None, "the compiled output has nothing differentiable"
        compiled_loss.backward()
    except Exception as error:
        raise CompiledRaised(f"{where}: {type(error).__name__}: {error}") from error
    eager_grads = parameters(sides[0].target) + _grad_leaves(ins[0])
    compiled_grads = parameters(sides[1].target) + _grad_leaves(ins[1])
    assert any(t.grad is not None for _, t in eager_grads), f"{program.id}: no gradient"
    with _failing_as(WrongGrad, where):
        torch.testing.assert_close(
            compiled_loss.detach(),
            eager_loss.detach(),
            atol=program.atol,
            rtol=program.rtol,
            msg=lambda m: f"loss: {m}",
        )
        _compare_grads(eager_grads, compiled_grads, program)
    if program.optimizer is not None and (call + 1) % program.accumulate == 0:
        for side in sides:
            assert side.optimizer is not None
            side.optimizer.step()
        with _failing_as(WrongGrad, f"call {call + 1} after the optimizer step"):
            same(
                state_of(sides[1].target),
                state_of(sides[0].target),
                atol=program.atol,
                rtol=program.rtol,
                path="state",
            )


# ---------------------------------------------------------------------------------------------
# Counters


@dataclasses.dataclass(frozen=True)
class _Counts:
    captures: int
    graphs: int
    breaks: int
    recompiles: int

    @staticmethod
    def now() -> _Counts:
        c = kiln.counters
        return _Counts(c.captures, c.graphs, len(c.graph_breaks), len(c.recompiles))


@dataclasses.dataclass(frozen=True)
class _Delta:
    """What one call added to the counters, and what guards may have seen of it."""

    variant: int
    signature: Any
    captures: int
    graphs: int
    breaks: tuple[kiln.BreakReason, ...]
    recompiles: int

    @staticmethod
    def between(variant: int, signature: Any, before: _Counts, after: _Counts) -> _Delta:
        records = kiln.counters.graph_breaks[before.breaks : after.breaks]
        return _Delta(
            variant,
            signature,
            after.captures - before.captures,
            after.graphs - before.graphs,
            tuple(r.reason for r in records),
            after.recompiles - before.recompiles,
        )


def _summary(deltas: Sequence[_Delta]) -> str:
    calls = "\n".join(
        f"  call {i} (variant {d.variant}): captures {d.captures}, graphs {d.graphs}, "
        f"recompiles {d.recompiles}, breaks {[r.name for r in d.breaks]}"
        for i, d in enumerate(deltas, start=1)
    )
    records = "\n".join(f"  {r}" for r in kiln.counters.graph_breaks)
    recompiles = "\n".join(f"  {name}: {why}" for name, why in kiln.counters.recompiles)
    return f"\n{calls}\nbreaks:\n{records}\nrecompiles:\n{recompiles}"


def _check_fallbacks(program: Program) -> None:
    got = collections.Counter(r.reason for r in kiln.counters.fallbacks)
    if got != collections.Counter(program.skips):
        records = "\n".join(f"  {r}" for r in kiln.counters.fallbacks)
        raise UnexpectedFallback(
            f"frames ran uncompiled: {[r.name for r in got.elements()]}, expected "
            f"{[r.name for r in program.skips]}\n{records}"
        )


def _expected_graphs(program: Program, deltas: Sequence[_Delta]) -> list[int]:
    if isinstance(program.graphs, tuple):
        assert len(program.graphs) == len(deltas), f"{program.id}: one graph count per call"
        return list(program.graphs)
    later = program.graphs if program.later_graphs is None else program.later_graphs
    seen: set[int] = set()
    expected = []
    for delta in deltas:
        if not seen:
            expected.append(program.graphs)
        else:
            expected.append(0 if delta.variant in seen else later)
        seen.add(delta.variant)
    return expected


def _check_counters(program: Program, deltas: Sequence[_Delta]) -> None:
    """The row's counts (module docstring); every problem is listed, with the whole run."""
    first = deltas[0]
    breaks = collections.Counter(program.breaks)
    problems = []
    if collections.Counter(first.breaks) != breaks:
        problems.append(
            f"call 1 broke for {[r.name for r in first.breaks]}, "
            f"expected {[r.name for r in program.breaks]}"
        )
    bound = program.captures if program.captures is not None else 1 + 2 * len(program.breaks)
    if first.captures > bound:
        problems.append(f"call 1 captured {first.captures} frames, at most {bound} expected")
    variants: set[int] = set()
    signatures: list[Any] = []
    expected_graphs = _expected_graphs(program, deltas)
    for i, (delta, graphs) in enumerate(zip(deltas, expected_graphs, strict=True), start=1):
        if program.dynamic and i > 1:
            if delta.graphs > first.graphs:
                problems.append(f"call {i} compiled {delta.graphs} graphs, more than call 1")
        elif delta.graphs != graphs:
            problems.append(f"call {i} compiled {delta.graphs} graphs, expected {graphs}")
        if delta.signature in signatures and delta.recompiles and not program.dynamic:
            problems.append(
                f"call {i} has the shapes and Python values of an earlier call (new tensor "
                f"values only) but recompiled {delta.recompiles} times"
            )
        repeated = delta.variant in variants and not graphs and not program.dynamic
        if repeated and delta.captures:
            problems.append(f"call {i} repeats variant {delta.variant} but captured")
        if i > 1 and collections.Counter(delta.breaks) - breaks:
            problems.append(f"call {i} broke for {[r.name for r in delta.breaks]}")
        if i > 1 and delta.captures > max(first.captures, bound):
            problems.append(f"call {i} captured {delta.captures} frames, more than call 1")
        variants.add(delta.variant)
        signatures.append(delta.signature)
    if problems:
        raise WrongCounters("; ".join(problems) + _summary(deltas))


# ---------------------------------------------------------------------------------------------
# The check


def _build(program: Program) -> tuple[_Side, _Side]:
    state = torch.get_rng_state()
    eager_target = program.build()
    if isinstance(eager_target, nn.Module):
        compiled_target = copy.deepcopy(eager_target)
    else:
        torch.set_rng_state(state)
        compiled_target = program.build()
    if program.compile is not None:
        compiled_call = program.compile(compiled_target)
    else:
        options = dict(program.options or {})
        compiled_call = kiln.compile(compiled_target, backend=program.backend, options=options)
    assert compiled_call is not eager_target, "the compiled program must not be the eager one"
    sides = (_Side(eager_target, eager_target), _Side(compiled_target, compiled_call))
    if program.optimizer is not None:
        for side in sides:
            side.optimizer = program.optimizer([p for _, p in parameters(side.target)])
    return sides


def _both(sides: tuple[_Side, _Side], change: Callable[[Any], None]) -> None:
    """Apply one change to both programs, drawing the same random numbers for each."""
    state = torch.get_rng_state()
    change(sides[0].target)
    torch.set_rng_state(state)
    change(sides[1].target)


def _clear_grads(sides: tuple[_Side, _Side]) -> None:
    for side in sides:
        for _, parameter in parameters(side.target):
            parameter.grad = None


def check_program(program: Program) -> None:
    """Run ``program`` eagerly and compiled on each of its variants (module docstring)."""
    kiln.reset()
    sides = _build(program)
    deltas: list[_Delta] = []
    for call, variant in enumerate(program.variants):
        if call and program.between is not None:
            _both(sides, lambda target, call=call: program.between(target, call))
        if program.train and call % program.accumulate == 0:
            _clear_grads(sides)
        made = program.inputs(variant)
        inputs = made if isinstance(made, Call) else Call(tuple(made))
        ins = (copy.deepcopy(inputs), copy.deepcopy(inputs))
        guarded = signature((_arguments(inputs), guarded_state(sides[1].target)))
        before = _Counts.now()
        rng = torch.get_rng_state()
        observations = []
        for side, args in zip(sides, ins, strict=True):
            torch.set_rng_state(rng)
            run = lambda side=side, args=args: side.call(*args.args, **args.kwargs)
            observations.append(_observe(run, program.context))
        obs = (observations[0], observations[1])
        _compare_call(program, obs, ins, sides, f"call {call + 1}")
        if program.train:
            _backward(program, sides, ins, obs, call)
        deltas.append(_Delta.between(variant, guarded, before, _Counts.now()))
    _check_fallbacks(program)
    _check_counters(program, deltas)
