"""``mode="max-autotune"``: each Triton kernel's launch shape measured, not guessed.

The backend hands :func:`load_tuned` one :class:`TuningJob` per kernel: its candidate sources
(``kiln/codegen/triton_candidates.py``, the heuristic's first) and what the choice depends on
besides this machine (the kernel's signature, sizes and dtypes). Then:

1. **Cache.** ``<cache_dir>/autotune/<key>.json``, the key hashing that identity, the device's
   name and Triton's version, holds an earlier choice: only that candidate is built, and no
   launch is measured (:class:`TuningRecord` ``cached``).
2. **Build.** Otherwise every candidate of every kernel is built and precompiled at once, in
   the compile pool's workers (``triton_build.precompile``).
3. **Measure.** A :class:`TunedLauncher` times the candidates at the kernel's first launch,
   with its real arguments, the buffers it stores to (the first ``written`` arguments)
   replaced by copies so the repeated runs cannot apply an in-place update twice; then it
   launches the fastest once on the real arguments, and that candidate serves every later
   launch. A candidate that fails to compile or run is skipped, never chosen; the time each
   kernel (and the whole process) spends measuring is bounded by :data:`tuning`.

The timer is injectable (``tuning.timer``): tests drive the search under Triton's interpreter
with a fake one. On a GPU candidates are timed by ``triton.testing.do_bench`` (CUDA events,
L2 flushed between runs).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.codegen.sources import Form, TritonSource
from kiln.config import config, logger
from kiln.recording import record
from kiln.runtime.triton_build import build_triton_kernels

_log = logger("autotune")

KEY_VERSION = 1  # bump when the candidates' meaning or the file's layout changes

Launcher = Callable[..., None]
# (candidate's label, a call that runs it once, the device) -> microseconds a run
Timer = Callable[[str, Callable[[], None], torch.device], float]


@dataclass
class Tuning:
    """How long the search may take; ``timer`` None: :func:`measure`."""

    timer: Timer | None = None
    kernel_budget_s: float = 2.0
    total_budget_s: float = 120.0
    spent_s: float = 0.0  # measuring, this process so far
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


tuning = Tuning()


@dataclass(frozen=True)
class TuningJob:
    """One kernel to tune: its candidates (the heuristic's first) and the first ``written``
    arguments, the buffers it stores to."""

    kernel_name: str
    identity: str  # what the choice depends on besides the machine
    candidates: tuple[TritonSource, ...]
    written: int


@dataclass
class TuningRecord:
    """One kernel's choice and its measured alternatives (label -> microseconds a launch;
    None: failed to compile or run), for ``kiln.explain``. ``chosen`` is empty until the
    first launch has measured."""

    kernel: str
    key: str
    times: dict[str, float | None] = field(default_factory=dict)
    chosen: str = ""
    cached: bool = False
    candidates: int = 0  # how many there were (a spent budget measures fewer)

    def line(self) -> str:
        """``chosen (time), runner-up (time)``, then every other measured alternative
        (``then label time, ...``, fastest first), the count tried and failed, and whether
        the choice came from the cache (which keeps the times it measured)."""
        measured = sorted((t, label) for label, t in self.times.items() if t is not None)
        failed = sum(t is None for t in self.times.values())
        best = self.times.get(self.chosen)
        text = f"autotune {self.kernel}: {self.chosen}" + (f" {best:.1f} us" if best else "")
        others = [(t, label) for t, label in measured if label != self.chosen]
        if others:
            text += f", runner-up {others[0][1]} {others[0][0]:.1f} us"
        if len(others) > 1:
            text += "; then " + ", ".join(f"{label} {t:.1f}" for t, label in others[1:])
        tried = f"{len(self.times)} of {self.candidates}" if self.candidates else len(self.times)
        text += f" ({tried} tried" + (f", {failed} failed" if failed else "") + ")"
        return text + (" [cached]" if self.cached else "")


def label(form: Form, xblock: int, rblock: int, num_warps: int) -> str:
    """A launch shape as explain prints it and the cache stores it: ``persistent x8 r1024 w4``."""
    width = f" r{rblock}" if form is not Form.POINTWISE else ""
    return f"{form.value.split()[0]} x{xblock}{width} w{num_warps}"


def source_label(source: TritonSource) -> str:
    constexprs = source.constexprs
    return label(source.form, constexprs["XBLOCK"], constexprs.get("RBLOCK", 1), source.num_warps)


# ---------------------------------------------------------------------------------------------
# the cache of choices


def cache_key(identity: str, device: torch.device, interpret: bool) -> str:
    import triton

    machine = "interpreter" if interpret else torch.cuda.get_device_name(device)
    text = json.dumps([KEY_VERSION, identity, machine, triton.__version__])
    return hashlib.sha256(text.encode()).hexdigest()


def _choice_path(key: str) -> Path:
    return Path(config.cache_dir) / "autotune" / f"{key}.json"


def read_choice(key: str) -> TuningRecord | None:
    """The choice cached under ``key``; None when there is none or the file is unreadable."""
    try:
        data = json.loads(_choice_path(key).read_text())
        return TuningRecord(data["kernel"], key, dict(data["times"]), data["chosen"], cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_choice(choice: TuningRecord) -> None:
    """Store ``choice`` atomically (a temporary file, then ``os.replace``)."""
    path = _choice_path(choice.key)
    data = {k: v for k, v in asdict(choice).items() if k not in ("key", "cached")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, path)
    except OSError as error:  # a read-only cache costs only the next process's search
        _log.info("cannot write the autotune choice %s: %s", path, error)


# ---------------------------------------------------------------------------------------------
# building and measuring


def load_tuned(
    jobs: Sequence[TuningJob], device: torch.device
) -> tuple[dict[str, Launcher], list[TuningRecord]]:
    """A launcher per job's kernel and its :class:`TuningRecord`: a cached choice built
    alone, else every candidate built (in parallel) behind a :class:`TunedLauncher`."""
    chosen: list[list[TritonSource]] = []
    records = []
    for job in jobs:
        interpret = job.candidates[0].interpret
        key = cache_key(job.identity, device, interpret)
        cached = read_choice(key)
        by_label = {source_label(s): s for s in job.candidates}
        if cached is not None and cached.chosen in by_label:
            cached.kernel, cached.candidates = job.kernel_name, len(job.candidates)
            chosen.append([by_label[cached.chosen]])
            records.append(cached)
        else:
            chosen.append(list(job.candidates))
            records.append(TuningRecord(job.kernel_name, key, candidates=len(job.candidates)))
    built = iter(build_triton_kernels([s for group in chosen for s in group], device))
    launchers: dict[str, Launcher] = {}
    for job, group, choice in zip(jobs, chosen, records, strict=True):
        group_launchers = [(source_label(s), next(built)) for s in group]
        if choice.cached:
            launchers[job.kernel_name] = group_launchers[0][1]
        else:
            launchers[job.kernel_name] = TunedLauncher(group_launchers, job.written, choice)
    return launchers, records


class TunedLauncher:
    """Launches one kernel through the fastest of its candidates, measured at the first
    launch (see the module's docstring). ``fallback``, set by the backend, serves when every
    candidate fails.

    ``written``: the arguments a launch stores to (the first ``written``, or those positions),
    copied for the measurements. ``timed``: what a measurement of a candidate runs, when that
    is not what it serves (a matmul template's library candidate also runs the product there,
    which its extern runs before the kernel once chosen). ``on_choice``: told the chosen label."""

    seed_as_tensor = True  # (Triton launchers, every candidate: kiln/codegen/wrapper.py)

    def __init__(
        self,
        candidates: list[tuple[str, Any]],
        written: int | frozenset[int],
        choice: TuningRecord,
        timed: dict[str, Launcher] | None = None,
        on_choice: Callable[[str], None] | None = None,
    ) -> None:
        self.candidates = candidates
        self.written = frozenset(range(written)) if isinstance(written, int) else written
        self.record = choice
        self.timed = timed or {}
        self.on_choice = on_choice
        self.chosen: Launcher | None = None
        self.fallback: Launcher | None = None
        self.lock = threading.Lock()
        self.__name__ = choice.kernel

    def __call__(self, *arguments: Any, seed: Any = None) -> None:
        chosen = self.chosen
        if chosen is None:
            chosen = self._tune(arguments, seed)
        chosen(*arguments, seed=seed)

    def _tune(self, arguments: tuple[Any, ...], seed: Any) -> Launcher:
        with self.lock:
            if self.chosen is not None:
                return self.chosen
            tensors = [a for a in arguments if isinstance(a, torch.Tensor)]
            device = tensors[0].device if tensors else torch.device("cpu")
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if capturing or tuning.spent_s >= tuning.total_budget_s:
                # (nothing measured inside a CUDA graph's capture; nor cached: a later
                # process may measure)
                self.record.chosen, heuristic = self.candidates[0]
                heuristic.fallback = self.fallback
                return self._choose(heuristic)
            copies = tuple(_copy(a) if i in self.written else a for i, a in enumerate(arguments))
            measured = [(name, self.timed.get(name, run)) for name, run in self.candidates]
            with _on(device):
                times = _measure_all(measured, copies, seed, device)
            self.record.times = times
            finished = [(t, i) for i, t in enumerate(times.values()) if t is not None]
            if finished:
                name, launcher = self.candidates[min(finished)[1]]
                self.record.chosen = name
                write_choice(self.record)
            else:  # every candidate failed: the heuristic's, running as PyTorch ops
                name, launcher = self.candidates[0]
                self.record.chosen = name
                launcher.fallback = self.fallback
                launcher.failed = "every autotune candidate failed"
            record(self.record)
            _log.info("%s", self.record.line())
            return self._choose(launcher)

    def _choose(self, launcher: Launcher) -> Launcher:
        if self.on_choice is not None:
            self.on_choice(self.record.chosen)
        self.chosen = launcher
        return launcher


def _measure_all(
    candidates: list[tuple[str, Any]], arguments: tuple[Any, ...], seed: Any, device: torch.device
) -> dict[str, float | None]:
    """Microseconds a launch of each candidate (None: it failed), until the kernel's or the
    process's budget runs out (the heuristic's, first, is always measured)."""
    timer = tuning.timer or measure
    start = time.perf_counter()
    times: dict[str, float | None] = {}
    for name, launcher in candidates:
        elapsed = time.perf_counter() - start
        if times and (
            elapsed > tuning.kernel_budget_s or tuning.spent_s + elapsed > tuning.total_budget_s
        ):
            _log.info("autotune budget spent: %d of %d candidates", len(times), len(candidates))
            break
        try:
            times[name] = timer(name, _runner(launcher, arguments, seed), device)
            if getattr(launcher, "failed", None):  # ran its PyTorch fallback instead
                raise RuntimeError(launcher.failed)
        except Exception as error:
            _log.info("autotune candidate %s skipped: %s: %s", name, type(error).__name__, error)
            times[name] = None
    with tuning.lock:
        tuning.spent_s += time.perf_counter() - start
    return times


def _on(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _runner(launcher: Any, arguments: tuple[Any, ...], seed: Any) -> Callable[[], None]:
    def run() -> None:
        launcher(*arguments, seed=seed)

    return run


def _copy(value: Any) -> Any:
    """A copy of a tensor's whole storage seen through the same size, strides and offset (the
    kernel may read the buffer it stores to, and index past the view's own elements)."""
    if not isinstance(value, torch.Tensor):
        return value
    count = value.untyped_storage().nbytes() // value.element_size()
    whole = torch.as_strided(value, (count,), (1,), 0)
    return whole.clone().as_strided(value.size(), value.stride(), value.storage_offset())


def measure(name: str, run: Callable[[], None], device: torch.device) -> float:
    """Microseconds a run: ``triton.testing.do_bench`` on a GPU (CUDA events, L2 flushed,
    the median of runs filling about 10 ms), the wall clock of a few runs otherwise."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(run, warmup=2, rep=10, return_mode="median")) * 1000.0
    run()  # the first run compiles or imports
    start = time.perf_counter()
    for _ in range(3):
        run()
    return (time.perf_counter() - start) / 3 * 1e6
