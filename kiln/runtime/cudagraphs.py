"""CUDA graphs (``mode="reduce-overhead"``): record a compiled graph once, replay it after.

A model's call launches every kernel of its program, and at small batches the host time of
those launches is the step's time. A CUDA graph records the launches of one call and replays
them with one host call. :class:`CudaGraphRunner` wraps one compiled graph (an inference
graph, or a training graph's forward or backward):

1. **Warm-up.** The first calls run the compiled graph as usual (it compiles and loads the
   kernels, cuBLAS sets up its workspaces), until one compiles nothing (a program rebuilt
   after its first call compiles on its second): recording must compile nothing.
2. **Record.** The next call records one run of the graph on static inputs into a CUDA graph
   whose memory comes from the family's pool, then replays it on this call's inputs.
3. **Replay.** Later calls copy the inputs into the static buffers and replay.

Inputs, by how they reach the recorded graph:

- parameters, buffers, constants, ``nn.Parameter`` arguments and views of them a forward
  saved for its backward are **static**: the graph reads them where they are; a changed
  address records again (at most ``RERECORD_LIMIT`` times, then the graph runs without CUDA
  graphs);
- other tensors are **copied** into a static buffer, unless they already are that buffer.
  Outside a training forward (whose backward may borrow it) the buffer is **donated**: made
  in the recording, from the pool, and held by the program alone, which drops it after its
  last read, so the recording's later steps take its memory (a batch of images); the runner
  keeps a tensor on that memory that does not own it;
- an output of a graph of the same family (a forward's saved activation given to its
  backward, the result of the graph before a graph break), or a forward's static copy of an
  input its backward reads (a ResNet's images: the Function saves that copy, not the
  caller's tensor), is **borrowed**: read in place; a call that passes other memory there
  runs the graph without its CUDA graph;
- the random seed is copied into a static device tensor that the kernels read.

**Memory and outputs.** Graphs compiled with one set of options form a :class:`Family` and
share one memory pool, so a training step's forward and backward (and the graphs around a
graph break) reuse each other's temporaries. A replay rewrites its own outputs, and may
overwrite those of graphs recorded after it (their memory may lie in its temporaries). So:

- every output the user gets is a **copy** out of the pool at first: holding one across calls
  is always safe;
- a graph's results (an inference graph's outputs, a forward's, a backward's gradients) are
  copies until the runner saw ``LEND_AFTER`` times its copies dead when a replay that could
  overwrite them began (the loop drops its outputs, ``.grad`` and the loss before the next
  step); then they are **lent**, handed out in the pool uncopied (a copy a step saved, in time
  and memory: GPT-2's 785 MiB of logits at 8x1024), and checked like saved values below: a
  lent result still held (kept, accumulated) makes the runner take another instance for that
  replay and copy again, until ``LEND_AFTER`` replays in a row found the copies dead (one
  result kept for good pins its instance, and the next one lends); results found held
  ``KEPT_LIMIT`` times (a loop that keeps them all) are copied for good;
- values a forward saves for its backward stay in the pool (the backward borrows them).
  Before each replay the runner checks, by the storages' use counts, whether autograd still
  holds saved values the replay could overwrite (two forwards before one backward): then
  the graph records another instance whose memory cannot overlap them (at most
  ``INSTANCE_LIMIT``; past that, the call runs without its CUDA graph, in fresh memory), and
  the backward gets one recording per forward instance whose values it borrows.

``kiln.mark_step_begin()`` declares the values saved before it dead (a step whose backward
will never run, a loss kept in a list): replays may then overwrite them, and a backward that
reads overwritten values (the family counts replays: one of the owner, or of a graph
recorded before it, since the values were handed out) raises an error instead of computing
wrong gradients.

**Fallback.** A graph that reads CPU tensors, whose recording fails (an op that synchronizes
or cannot be captured), whose parameters keep moving, or that is one size too many
(``SIZE_LIMIT`` per captured graph with dynamic shapes) runs without CUDA graphs; the reason
is logged (``KILN_LOG=cudagraphs``) and shown by ``kiln.explain``.

CPU tests drive all of this through a :class:`Recorder` that emulates recording and replay
(``tests/backends/test_cudagraphs.py``); :class:`CudaRecorder` (``cudagraph_recorder.py``) is
the real one.
"""

from __future__ import annotations

import enum
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from kiln.config import logger
from kiln.ir.graph import Graph, InputKind
from kiln.recording import keep_live, live
from kiln.recording import record as record_event
from kiln.recording import recording as listening
from kiln.runtime.cudagraph_copies import (
    buffer_like,
    copy_batches,
    copy_into,
    copy_out,
    expanded,
    plan_batches,
    recorded_run,
    unowned,
    use_count,
    use_counts,
    view_on,
)
from kiln.runtime.cudagraph_recorder import CudaRecorder, Recorder

CompiledGraph = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]

RERECORD_LIMIT = 4  # recordings of one graph (moved parameters) before it gives up
INSTANCE_LIMIT = 3  # recordings of one graph alive at once (saved values still held)
WARM_UP_LIMIT = 4  # uncaptured calls that each compiled something before it gives up
SIZE_LIMIT = 16  # recorded sizes of one captured graph (dynamic shapes)
LEND_AFTER = 2  # replays that found a graph's copies dead before it lends its results
KEPT_LIMIT = 3  # replays that found a graph's results held before it copies them for good

_log = logger("cudagraphs")
_step = itertools.count(2)
_current_step = 1  # kiln.mark_step_begin() increments it


def mark_step_begin() -> None:
    """A new step begins: results of reduce-overhead graphs returned before this call are
    dead, and later replays may overwrite them without checking (clone what you keep).
    Tensors autograd holds for a pending backward stay protected."""
    global _current_step
    _current_step = next(_step)


RECORDER: Recorder = CudaRecorder()  # (tests swap in an emulation)


class Source(enum.Enum):
    """How one input reaches the recorded graph."""

    STATIC = "static"  # read where it is; another address records again
    COPIED = "copied"  # copied into a static buffer
    BORROWED = "borrowed"  # another graph's output, read in place
    SEED = "seed"  # the random seed, copied into a static device tensor


class Lending(enum.Enum):
    """Whether a graph hands out its results in the pool (module docstring)."""

    WATCHING = "watching"  # copies, checked for being dead when a replay could overwrite them
    LENDING = "lending"  # handed out in the pool
    NEVER = "never"  # copies (its results outlived a replay, or no use counts in PyTorch)


class Result(enum.Enum):
    """What one output of the recorded graph is."""

    POOL = "pool"  # new memory in the pool
    INPUT_VIEW = "input view"  # a view of a copied input: rebuilt on the caller's tensor
    ALIAS = "alias"  # memory the graph does not own (a parameter's, a borrowed input's)


@dataclass
class CudaGraphStatus:
    """One graph's CUDA-graph state, as ``kiln.explain`` shows it (also a recorded event)."""

    graph: str
    state: str = "warming up"  # "recorded", "off"
    reason: str = ""  # why it is off
    records: int = 0
    replays: int = 0
    uncaptured_runs: int = 0  # calls after warm-up run without the CUDA graph
    lent: bool = False  # the graph hands out its results uncopied
    notes: list[str] = field(default_factory=list)  # why calls ran without the CUDA graph

    def line(self) -> str:
        if self.state == "off":
            return f"{self.graph}: no CUDA graph ({self.reason})"
        text = f"{self.graph}: CUDA graph {self.state}"
        if self.state == "recorded":
            text += f" ({self.records} recording(s), {self.replays} replay(s)"
            if self.lent:
                text += ", results lent"
            if self.uncaptured_runs:
                text += f", {self.uncaptured_runs} call(s) without it: {self.notes[-1]}"
            text += ")"
        return text

    def cudagraph_lines(self) -> list[str]:
        return [self.line()]


def statuses() -> list[CudaGraphStatus]:
    """The status of every CUDA-graph runner alive in this process."""
    return [report for report in live() if isinstance(report, CudaGraphStatus)]


@dataclass
class SizeBudget:
    """How many sizes of one captured graph have a recording (dynamic shapes), per graph
    compiled from it (an inference graph, or a forward and a backward)."""

    recorded: dict[str, int] = field(default_factory=dict)

    def take(self, graph: str) -> bool:
        """Count one more size of ``graph`` with CUDA graphs; False past ``SIZE_LIMIT``."""
        count = self.recorded.get(graph, 0)
        if count >= SIZE_LIMIT:
            return False
        self.recorded[graph] = count + 1
        return True


class Family:
    """The graphs sharing one memory pool, in the order they recorded. Recordings are held
    weakly: their runners own them, and a runner that is gone frees its memory."""

    def __init__(self, recorder: Recorder | None = None) -> None:
        self.recorder = recorder or RECORDER
        self.pool: Any = None
        self.members: list[weakref.ref[Recording]] = []
        # storage address -> the recording whose output lives there
        self.outputs: weakref.WeakValueDictionary[int, Recording] = weakref.WeakValueDictionary()
        self.lock = threading.RLock()
        self.replays = 0  # replays of the family's graphs so far (tags saved values)

    def later_than(self, recording: Recording) -> list[Recording]:
        """``recording`` and the recordings made after it (a replay may overwrite their
        outputs)."""
        alive = [r for r in (ref() for ref in self.members) if r is not None]
        self.members = [weakref.ref(r) for r in alive]
        return alive[alive.index(recording) :] if recording in alive else [recording]

    def replayed_since(self, owner: Recording, serial: int) -> str | None:
        """The graph whose replay after ``serial`` may have overwritten ``owner``'s outputs
        (``owner`` itself, or a recording made before it, whose temporaries its outputs may
        reuse); None when none did."""
        for ref in self.members:
            recording = ref()
            if recording is not None and recording.last_replay > serial:
                runner = recording.owner()
                return runner.status.graph if runner is not None else "another graph"
            if recording is owner:
                break
        return None

    def alive(self) -> bool:
        """Whether a recording of this family still exists (its pool is in use)."""
        return any(ref() is not None for ref in self.members)

    def add(self, recording: Recording) -> None:
        self.members.append(weakref.ref(recording))
        for storage in recording.storages:
            self.outputs[storage.data_ptr()] = recording

    def drop(self, recording: Recording) -> None:
        self.members = [ref for ref in self.members if ref() not in (None, recording)]
        for storage in recording.storages:
            if self.outputs.get(storage.data_ptr()) is recording:
                del self.outputs[storage.data_ptr()]


@dataclass
class Recording:
    """One recorded CUDA graph and what it reads and returns."""

    replay: Callable[[], None]
    sources: list[Source]
    static: list[torch.Tensor | None]  # per input: its static tensor (None: none needed)
    # (position, data pointer) of the static inputs, and of the borrowed ones
    statics: list[tuple[int, int]]
    borrows: list[tuple[int, int]]
    outputs: list[torch.Tensor]  # the recorded outputs (pool memory)
    results: list[tuple[Result, int]]  # per output: its kind and its storage / input index
    # the pool storages of the outputs, then (from ``inputs_from``) the copied inputs' static
    # buffers: a forward's may be saved for its backward (static_input), checked like outputs
    storages: list[torch.UntypedStorage]
    inputs_from: int = 0
    baselines: list[int] = field(default_factory=list)  # their use counts when not held
    given: int = 0  # the step its saved values were last given out (0: never)
    owner: Callable[[], CudaGraphRunner | None] = lambda: None
    last_replay: int = 0  # the family's replay count at this recording's last replay
    # results copied out together, per dtype: the numbers of the contiguous user-visible
    # outputs alone in their storage (a backward's gradients)
    batches: list[list[int]] = field(default_factory=list)
    shared: frozenset[int] = frozenset()  # storages holding several user-visible outputs
    lendable: frozenset[int] = frozenset()  # the user-visible outputs alone in their storage
    # the replay's plan, made once: input positions by source, and the outputs in groups (the
    # saved values' numbers, the lendable results' numbers, the rest when lending and when
    # not, as (number, what to hand out: one of the _VIEW.. codes below, its storage or input
    # index)), and the input positions outputs are views of
    copied: list[int] = field(default_factory=list)
    zeroed: set[int] = field(default_factory=set)  # copied inputs whose buffers hold zeros
    donated: frozenset[int] = frozenset()  # copied inputs whose memory the recording reuses
    seeds: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    lendable_numbers: list[int] = field(default_factory=list)
    unlent: list[tuple[int, int, int]] = field(default_factory=list)
    unsaved: list[tuple[int, int, int]] = field(default_factory=list)
    views: list[int] = field(default_factory=list)
    # what held() checks, by whether the last replay lent (``lent``): the storages (C++
    # addresses) and use counts of the lent results, then of the saved values, less lent ones
    checks: dict[bool, tuple[list[int], ...]] = field(default_factory=dict)
    lent: bool = False
    handed: list[torch.UntypedStorage] = field(default_factory=list)  # its copies, watched
    judged: bool = False  # whether a replay since its last one judged what it handed out
    addresses: list[int] = field(default_factory=list)  # the static inputs' data pointers
    borrowed: list[int] = field(default_factory=list)  # and the borrowed ones'

    def __post_init__(self) -> None:
        self.addresses = [address for _, address in self.statics]
        self.borrowed = [address for _, address in self.borrows]

    def held(self) -> str:
        """What of this recording's is still held ("": nothing): a result its last replay lent,
        or values autograd holds that it saved for a backward in the current step."""
        lent_from, lent_counts, saved_from, saved_counts = self.checks[self.lent]
        if lent_from and use_counts(lent_from) != lent_counts:
            return _LENT_HELD  # (a step mark releases no result)
        if self.given < _current_step or not saved_from:
            return ""  # never given out, or before the current step began: released
        if use_counts(saved_from) != saved_counts or min(saved_counts) < 0:
            return "values it saved for a pending backward"
        return ""


_LENT_HELD = "a result it lent"  # (what Recording.held() found)

# What a replay hands out for one output (Recording.unsaved, .unlent)
_VIEW, _PARAMETER_VIEW, _ALIAS, _SAVED, _COPY = range(5)


class CudaGraphRunner:
    """A compiled graph run through CUDA graphs; called like the compiled graph."""

    def __init__(
        self,
        graph: Graph,
        compiled: CompiledGraph,
        family: Family,
        *,
        sizes: SizeBudget | None,
        output_count: int,
        internal: Sequence[int] = (),
        forward: bool = False,
        name: str = "",
    ) -> None:
        """``output_count``: the graph's results before the new values of mutated inputs;
        ``internal``: results only Kiln reads (a forward's values saved for the backward),
        returned from the pool, not copied; ``forward``: a training graph's forward (its
        backward may borrow its copied inputs' buffers: never donated); ``sizes``: the
        recordings of the captured graph's sizes (at most ``SIZE_LIMIT``; None:
        :class:`SizedRunners` counted this one); ``name``: its name in ``kiln.explain``."""
        self.budget = graph.name
        self.compiled = compiled
        self.family = family
        self.sizes = sizes
        self.output_count = output_count
        self.internal = frozenset(internal)
        self.forward = forward
        self.kinds = [value.kind for value in graph.inputs]
        # inputs that may be another graph's saved values (a backward's): user inputs that
        # are not parameters' views
        self.users = [i for i, kind in enumerate(self.kinds) if kind is InputKind.USER]
        self.status = CudaGraphStatus(name or graph.name)
        keep_live(self.status)
        record_event(self.status)  # (kiln.explain of one call shows it warming up)
        self.warming = True  # until a call compiles nothing
        self.warm_ups = 0
        # the graph's recordings alive now: a second one is made when every one's saved values
        # are still held (two forwards before one backward), and a backward gets one per
        # forward recording whose values it borrows
        self.recordings: list[Recording] = []
        self.moves = 0  # recordings replaced because static inputs moved
        counted = use_count(torch.empty(0).untyped_storage()) >= 0  # (an older PyTorch: no)
        self.lending = Lending.WATCHING if counted else Lending.NEVER
        self.releases = 0  # replays in a row that found the copies dead (Lending.WATCHING)
        self.kept = 0  # replays that found its results (copies or lent) still held
        self.last: Recording | None = None  # the recording the last call replayed

    # --- calls ---------------------------------------------------------------------------

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.last = None
        if _current_step > 1:  # (values saved before a mark may have been overwritten)
            self._check_saved(inputs)
        if self.status.state == "off":
            return self.compiled(inputs)
        with self.family.lock:
            if self.warming:
                return self._warm_up(inputs)
            fitting = [r for r in self.recordings if not self._moved(r, inputs)]
            if not fitting:  # (the first recording, or its parameters moved)
                return self._record(inputs, replace=True)
            why = "no recording reads these inputs where they are"
            for recording in fitting:
                if self._borrows(recording, inputs):
                    why = self._cannot_replay(recording, inputs)
                    if not why:
                        return self._replay(recording, inputs)
            if len(self.recordings) < INSTANCE_LIMIT:
                return self._record(inputs, replace=False)
            return self._uncaptured(inputs, why)

    def static_input(self, position: int) -> torch.Tensor | None:
        """The static buffer the last call's replay read input ``position`` from, for a
        forward's backward to borrow in place of the caller's tensor (a second copy of a
        ResNet's images, and its copying, saved), checked like its saved values; None when
        that call ran uncaptured or the input was not copied."""
        recording = self.last
        if recording is None or recording.sources[position] is not Source.COPIED:
            return None  # (nor is one donated: a forward donates nothing)
        static = cast(torch.Tensor, recording.static[position])
        # (a tensor of its own on that memory: the next copy into the buffer must not bump the
        # version autograd saved, or a released step's backward fails on it, not on the check)
        buffer = torch.empty(0, dtype=static.dtype, device=static.device).set_(
            static.untyped_storage(), static.storage_offset(), static.size(), static.stride()
        )
        buffer._kiln_replay = recording.last_replay  # type: ignore[attr-defined]
        return buffer

    def _check_saved(self, inputs: Sequence[torch.Tensor]) -> None:
        """Raise when an input is a saved value that a later replay overwrote (it was
        released by ``kiln.mark_step_begin()``)."""
        for position in self.users:
            tensor = inputs[position]
            tag = getattr(tensor, "_kiln_replay", None)
            if tag is None:
                continue
            owner = self.family.outputs.get(tensor.untyped_storage().data_ptr())
            writer = self.family.replayed_since(owner, tag) if owner is not None else None
            if writer is None:
                continue
            source = owner.owner() if owner is not None else None
            name = source.status.graph if source is not None else "another graph"
            raise RuntimeError(
                f"kiln: {self.status.graph} reads values that {name} saved before "
                f"kiln.mark_step_begin(), and a later call of {writer} overwrote them "
                "(mode='reduce-overhead'); run the backward before the next step's forward, "
                "or do not mark the step"
            )

    def _warm_up(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run uncaptured, until a call compiles nothing (a program rebuilt after its first
        call, a kernel tuned at its first launch): nothing may compile while recording."""
        self.warm_ups += 1
        with listening() as events:
            result = self.compiled(inputs)
        if not events:
            self.warming = False
        elif self.warm_ups >= WARM_UP_LIMIT:
            self._turn_off(f"it compiled something on each of its first {WARM_UP_LIMIT} calls")
        return result

    def _uncaptured(self, inputs: Sequence[torch.Tensor], why: str) -> list[torch.Tensor]:
        self.status.uncaptured_runs += 1
        if not self.status.notes or self.status.notes[-1] != why:
            self.status.notes = [*self.status.notes[-3:], why]
            _log.info("%s: this call runs without its CUDA graph: %s", self.status.graph, why)
        return self.compiled(inputs)

    def _off(self, reason: str, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Turn CUDA graphs off for this graph, and run this call without."""
        self._turn_off(reason)
        return self.compiled(inputs)

    def _turn_off(self, reason: str) -> None:
        self.status.state, self.status.reason = "off", reason
        _log.info("%s runs without CUDA graphs: %s", self.status.graph, reason)
        record_event(self.status)
        for recording in self.recordings:
            self.family.drop(recording)
        self.recordings = []

    # --- recording -----------------------------------------------------------------------

    def _record(self, inputs: Sequence[torch.Tensor], *, replace: bool) -> list[torch.Tensor]:
        """Record the graph on ``inputs`` and replay it; ``replace``: the recordings made so
        far no longer fit (moved parameters), else this one is one more."""
        family = self.family
        for position, tensor in enumerate(inputs):
            if not isinstance(tensor, torch.Tensor):
                return self._off(f"input {position} is not a tensor", inputs)
            if self.kinds[position] is not InputKind.RNG_SEED:
                why = family.recorder.supports(tensor)
                if why:
                    return self._off(why, inputs)
        if self.status.records == 0:  # (SizedRunners counted a runner of its own: no sizes)
            if self.sizes is not None and not self.sizes.take(self.budget):
                return self._off(f"{SIZE_LIMIT} sizes of this graph already have one", inputs)
        elif replace:
            self.moves += 1
            if self.moves >= RERECORD_LIMIT:
                why = f"its parameters moved (or inputs changed layout) {RERECORD_LIMIT} times"
                return self._off(why, inputs)
            for old in self.recordings:
                family.drop(old)
            self.recordings = []
        donate = getattr(family.recorder, "donates", False) and not self.forward
        sources, static = self._static_inputs(inputs, donate)
        if family.pool is None or not family.alive():
            # (a pool whose graphs all died was released by PyTorch: never record into it)
            family.pool = family.recorder.new_pool()
        run, made = recorded_run(self.compiled, inputs, static)
        try:  # (the static buffers have the inputs' layouts: nothing compiles in here)
            replay, outputs = family.recorder.capture(run, family.pool)
        except Exception as error:  # (an op that synchronizes, a CPU op, ...)
            text = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            return self._off(f"recording failed: {text}", inputs)
        donated = []  # (freed after its last read, or held to the end: an output views it)
        for position, (made_buffer, layout) in made.items():
            if (buffer := made_buffer()) is None:
                donated.append((position, layout))
            else:
                static[position] = buffer
        results, storages, why = self._classify(outputs, static, sources)
        if why:
            return self._off(why, inputs)

        def pointers(kind: Source) -> list[tuple[int, int]]:
            return [
                (i, t.data_ptr())
                for i, t in enumerate(static)
                if sources[i] is kind and t is not None
            ]

        statics, borrows = pointers(Source.STATIC), pointers(Source.BORROWED)
        for position, _ in borrows:  # (holding it would keep its owner's memory held)
            static[position] = None
        recording = Recording(replay, sources, static, statics, borrows, outputs, results, storages)
        recording.inputs_from = len(storages)
        storages += [
            t.untyped_storage()
            for t, kind in zip(static, sources, strict=True)
            if kind is Source.COPIED and t is not None
        ]
        recording.baselines = [use_count(s) for s in storages]
        for position, layout in donated:
            static[position] = unowned(layout)
        recording.donated = frozenset(position for position, _ in donated)
        recording.owner = weakref.ref(self)
        self._plan_copies(recording)
        self._plan_replay(recording)
        copied = recording.copied
        zeroed = {i for i in copied if getattr(inputs[i], "_kiln_zero", False)}
        recording.zeroed = zeroed - recording.donated
        family.add(recording)
        self.recordings.append(recording)
        self.status.state = "recorded"
        self.status.records += 1
        record_event(self.status)
        _log.info(
            "%s: recorded (%d inputs copied, %d static, %d borrowed)",
            self.status.graph,
            sources.count(Source.COPIED),
            sources.count(Source.STATIC),
            sources.count(Source.BORROWED),
        )
        return self._replay(recording, inputs)  # (recording ran nothing: this call's run)

    def _plan_replay(self, recording: Recording) -> None:
        sources = recording.sources
        recording.copied = [i for i, source in enumerate(sources) if source is Source.COPIED]
        recording.seeds = [i for i, source in enumerate(sources) if source is Source.SEED]
        plan: list[tuple[int, int, int]] = []
        for number, (kind, at) in enumerate(recording.results):
            if kind is Result.INPUT_VIEW:
                code = _VIEW
            elif kind is Result.ALIAS:
                code = _PARAMETER_VIEW if sources[at] is Source.STATIC else _ALIAS
            else:
                code = _SAVED if number in self.internal else _COPY
            plan.append((number, code, at))
        lendable = recording.lendable
        recording.saved = [number for number, code, _ in plan if code == _SAVED]
        recording.lendable_numbers = [n for n, code, _ in plan if code == _COPY and n in lendable]
        recording.unsaved = [entry for entry in plan if entry[1] != _SAVED]
        recording.unlent = [entry for entry in recording.unsaved if entry[0] not in lendable]
        recording.views = [at for number, code, at in plan if code == _VIEW]
        storages, baselines = recording.storages, recording.baselines

        def check(positions: set[int]) -> tuple[list[int], list[int]]:
            ats = sorted(positions)
            return [storages[at]._cdata for at in ats], [baselines[at] for at in ats]

        lent = {recording.results[number][1] for number in recording.lendable_numbers}
        saved = {recording.results[number][1] for number in recording.saved}
        saved |= set(range(recording.inputs_from, len(storages)))
        recording.checks = {
            False: (*check(set()), *check(saved)),
            True: (*check(lent), *check(saved - lent)),
        }

    def _plan_copies(self, recording: Recording) -> None:
        visible = [
            (number, at)
            for number, (kind, at) in enumerate(recording.results)
            if kind is Result.POOL and number not in self.internal
        ]
        recording.shared, recording.batches = plan_batches(recording.outputs, visible)
        recording.lendable = frozenset(n for n, at in visible if at not in recording.shared)

    def _static_inputs(
        self, inputs: Sequence[torch.Tensor], donate: bool
    ) -> tuple[list[Source], list[torch.Tensor | None]]:
        """Each input's source and static tensor (None: a donated one, see :func:`recorded_run`)."""
        sources: list[Source] = []
        static: list[torch.Tensor | None] = []
        for position, tensor in enumerate(inputs):
            kind = self.kinds[position]
            if kind is InputKind.RNG_SEED:
                sources.append(Source.SEED)
                seed = torch.empty((), dtype=torch.int64, device=self._device(inputs))
                static.append(seed.fill_(int(tensor)))
            elif (
                kind is not InputKind.USER
                or isinstance(tensor, torch.nn.Parameter)
                or getattr(tensor, "_kiln_static", False)
            ):
                sources.append(Source.STATIC)
                static.append(tensor)
            elif tensor.untyped_storage().data_ptr() in self.family.outputs:
                sources.append(Source.BORROWED)
                static.append(tensor)
            else:
                sources.append(Source.COPIED)
                if donate and not getattr(tensor, "_kiln_zero", False):  # (zeros: kept once)
                    static.append(None)
                else:
                    static.append(copy_into(buffer_like(tensor), tensor))
        return sources, static

    def _device(self, inputs: Sequence[torch.Tensor]) -> torch.device:
        for position, tensor in enumerate(inputs):
            if self.kinds[position] is not InputKind.RNG_SEED:
                return tensor.device
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def _classify(
        self,
        outputs: list[torch.Tensor],
        static: list[torch.Tensor | None],
        sources: list[Source],
    ) -> tuple[list[tuple[Result, int]], list[torch.UntypedStorage], str]:
        """Each output's kind; the pool storages; why the graph cannot be replayed ("")."""
        input_storage: dict[int, int] = {}
        for at, tensor in enumerate(static):
            if tensor is not None:
                input_storage.setdefault(tensor.untyped_storage().data_ptr(), at)
        storages: list[torch.UntypedStorage] = []
        index: dict[int, int] = {}
        results: list[tuple[Result, int]] = []
        for number, output in enumerate(outputs):
            if not isinstance(output, torch.Tensor):
                return [], [], f"result {number} is not a tensor"
            address = output.untyped_storage().data_ptr()
            position = input_storage.get(address)
            if position is None:
                if address not in index:
                    index[address] = len(storages)
                    storages.append(output.untyped_storage())
                results.append((Result.POOL, index[address]))
            elif sources[position] is Source.COPIED and number < self.output_count:
                results.append((Result.INPUT_VIEW, position))
            else:  # a mutated input's new value (the caller copies it back), a parameter view
                results.append((Result.ALIAS, position))
        return results, storages, ""

    def _moved(self, recording: Recording, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether ``recording`` no longer fits ``inputs``: a static input is somewhere else
        now, or a copied input comes in a layout its static buffer cannot take (an expanded
        one, the recording's was dense, or the other way round)."""
        if [inputs[i].data_ptr() for i, _ in recording.statics] != recording.addresses:
            return True
        for position in recording.copied:
            static, tensor = recording.static[position], inputs[position]
            assert static is not None
            if tensor.stride() != static.stride() and (expanded(static) or expanded(tensor)):
                return True
        return False

    def _borrows(self, recording: Recording, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether the borrowed inputs are the outputs ``recording`` was recorded with (a
        backward has one recording per forward recording whose saved values it reads)."""
        return [inputs[i].data_ptr() for i, _ in recording.borrows] == recording.borrowed

    # --- replay --------------------------------------------------------------------------

    def _cannot_replay(self, recording: Recording, inputs: Sequence[torch.Tensor]) -> str:
        """Why replaying ``recording`` now could change a tensor someone holds ("": it
        cannot)."""
        for position in recording.views:
            static = recording.static[position]
            if static is not None and inputs[position].stride() != static.stride():
                return f"an output is a view of input {position}, now laid out otherwise"
        for other in self.family.later_than(recording):
            held, owner = other.held(), other.owner()
            if owner is not None and owner.lending is not Lending.NEVER:
                owner._watch(other, held == _LENT_HELD)
            if held:
                name = owner.status.graph if owner is not None else "another graph"
                return f"{held} ({name}) is still held"
        return ""

    def _watch(self, recording: Recording, lent_held: bool) -> None:
        """A replay that could overwrite ``recording``'s results begins: what it handed out must
        be dead for its results to be lent. Judged once per replay of ``recording`` (a result
        kept for good pins that instance; the others may lend again)."""
        if recording.judged:
            return
        recording.judged = True
        handed, recording.handed = recording.handed, []
        if lent_held or any(use_count(s) > 1 for s in handed):  # (the list held one)
            self.kept += 1
            self.releases = 0
            self.status.lent = False
            if self.kept >= KEPT_LIMIT:
                self.lending = Lending.NEVER
                _log.info("%s: results outlive a replay: copied from now on", self.status.graph)
            else:
                self.lending = Lending.WATCHING
                _log.info("%s: results outlive a replay: copied for now", self.status.graph)
        elif handed and self.lending is Lending.WATCHING:
            self.releases += 1
            if self.releases >= LEND_AFTER:
                self.lending, self.status.lent = Lending.LENDING, True
                _log.info("%s: results lent from now on", self.status.graph)

    def _replay(self, recording: Recording, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        static = recording.static
        for position in recording.copied:
            target, passed = static[position], inputs[position]
            assert target is not None
            if passed.data_ptr() != target.data_ptr() or passed.stride() != target.stride():
                if getattr(passed, "_kiln_zero", False):  # (an unused output's cotangent)
                    if position in recording.zeroed:
                        continue
                    if position not in recording.donated:  # (the recording overwrites those)
                        recording.zeroed.add(position)
                else:
                    recording.zeroed.discard(position)
                copy_into(target, passed)
        for position in recording.seeds:
            seed = static[position]
            assert seed is not None
            seed.fill_(int(inputs[position]))
        for position, _ in recording.borrows:  # (an emulated replay reads it; CUDA's not)
            static[position] = inputs[position]
        try:
            recording.replay()
        finally:
            for position, _ in recording.borrows:
                static[position] = None
        self.last = recording
        self.status.replays += 1
        self.family.replays += 1
        recording.last_replay = tag = self.family.replays
        outputs = recording.outputs
        results: list[Any] = [None] * len(outputs)
        for number in recording.saved:
            saved = outputs[number].detach()
            saved._kiln_replay = tag  # type: ignore[attr-defined]
            results[number] = saved
        recording.given = _current_step
        recording.judged = False
        recording.lent = lend = self.lending is Lending.LENDING
        if lend:
            for number in recording.lendable_numbers:  # (autograd's .grad takes it as it is)
                results[number] = outputs[number].detach()
            self._hand_out(recording, inputs, results, {}, recording.unlent)
        else:
            copies = copy_batches(outputs, recording.batches)
            if self.lending is Lending.WATCHING:
                recording.handed = [
                    copies[numbers[0]].untyped_storage() for numbers in recording.batches
                ]
            self._hand_out(recording, inputs, results, copies, recording.unsaved)
        return results

    def _hand_out(
        self,
        recording: Recording,
        inputs: Sequence[torch.Tensor],
        results: list[Any],
        copies: dict[int, torch.Tensor],
        plan: list[tuple[int, int, int]],
    ) -> None:
        """Fill in ``results`` for the outputs of ``plan``: copies, views, aliases."""
        outputs, static = recording.outputs, recording.static
        copied: dict[int, torch.Tensor] = {}
        watching = self.lending is Lending.WATCHING
        for number, code, at in plan:
            if code == _COPY:
                copy = copies.get(number)
                if copy is None:
                    shared, storages = recording.shared, recording.storages
                    copy = copy_out(outputs[number], at, copied, shared, storages)
                    if watching and number in recording.lendable:
                        recording.handed.append(copy.untyped_storage())  # (a gapped view)
                results[number] = copy
            elif code == _VIEW:
                results[number] = view_on(outputs[number], static[at], inputs[at])
            else:
                alias = outputs[number].detach()
                if code == _PARAMETER_VIEW:  # (static in a backward too)
                    alias._kiln_static = True  # type: ignore[attr-defined]
                results[number] = alias
