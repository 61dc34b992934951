"""``kiln.explain``: what capture made of one call, as data and as a readable summary."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kiln.capture.core.breaks import BreakRecord
from kiln.capture.driver import cache
from kiln.capture.driver.cache import Captured
from kiln.capture.driver.convert import Capture
from kiln.capture.guards.sizes import places_text
from kiln.ir.graph import Graph
from kiln.ir.op import Op
from kiln.ir.symbolic import ShapeEnv
from kiln.ops.autograd_function import function_outputs
from kiln.ops.untracked import untracked_write
from kiln.recording import live
from kiln.recording import recording as record_events

# Externs autodiff uses to pass values through: not opaque calls of the user's program.
_MARKERS = (function_outputs, untracked_write)


@dataclass
class ExplainReport:
    """Graphs, graph breaks, frames run uncompiled, externs and guards of one call."""

    graphs: list[Graph] = field(default_factory=list)
    breaks: list[BreakRecord] = field(default_factory=list)
    skips: list[BreakRecord] = field(default_factory=list)
    externs: list[str] = field(default_factory=list)
    guards: list[str] = field(default_factory=list)
    captures: list[tuple[str, Capture]] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)  # values graphs keep for their backward
    kernels: list[str] = field(
        default_factory=list
    )  # kernels and extern calls, with what they fuse
    # Symbolic sizes: each symbol, where it is read and why it is symbolic; each place capture
    # had to specialize one (``int(n)``); the guards on sizes are among ``guards``.
    sizes: list[str] = field(default_factory=list)
    # reduce-overhead: each graph's CUDA graph (recorded, replays, why off or not replayed)
    cudagraphs: list[str] = field(default_factory=list)
    # profile=True: each GPU kernel's time and roofline share (kiln/backends/roofline.py)
    profile: list[str] = field(default_factory=list)
    # Graphs split between a backend and the default one (why each op was left out), and
    # backends that failed to compile a graph (``kiln/backends/split.py``, ``registry.py``)
    backends: list[str] = field(default_factory=list)

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def break_reasons(self) -> list[Any]:
        return [record.reason for record in self.breaks]

    def __str__(self) -> str:
        lines = [
            f"{self.graph_count} graph(s), {len(self.breaks)} graph break(s), "
            f"{len(self.skips)} frame(s) run uncompiled"
        ]
        for index, graph in enumerate(self.graphs):
            lines.append(f"  graph {index}: {graph.name}, {len(graph.nodes)} nodes")
        sections: tuple[tuple[str, Sequence[Any]], ...] = (
            ("graph breaks:", self.breaks),
            ("run uncompiled:", self.skips),
            ("saved for the backward:", self.saved),
            ("backends:", self.backends),
            ("kernels:", self.kernels),
            ("CUDA graphs:", self.cudagraphs),
            ("profile:", self.profile),
            ("symbolic sizes:", self.sizes),
            ("externs (torch functions run as opaque calls):", self.externs),
        )
        for title, entries in sections:
            if entries:
                lines.append(title)
                lines += [f"  {entry}" for entry in entries]
        lines.append(f"guards ({len(self.guards)}):")
        lines += [f"  {guard}" for guard in self.guards]
        return "\n".join(lines)


@contextmanager
def recording(fresh: bool = True) -> Iterator[list[Any]]:
    """Every event recorded inside the block (``kiln.recording``: captures, frames run
    uncompiled, compiled programs), from fresh caches unless ``fresh`` is False: then only
    what actually compiles inside the block is seen."""
    saved_caches = dict(cache._CACHES)
    saved_wrappers = dict(cache._WRAPPERS)
    saved_counters = copy.deepcopy(vars(cache.counters))
    if fresh:
        cache._CACHES.clear()
        cache._WRAPPERS.clear()
    try:
        with record_events() as events:
            yield events
    finally:
        if fresh:  # explain() leaves no trace: caches and counters as before
            vars(cache.counters).update(saved_counters)
            cache._CACHES.clear()
            cache._CACHES.update(saved_caches)
            cache._WRAPPERS.clear()
            cache._WRAPPERS.update(saved_wrappers)


Profiler = Callable[[Callable[[], Any], list[Any]], list[str]]


def explain(
    make: Callable[[], Any], *args: Any, profiler: Profiler | None = None, **kwargs: Any
) -> ExplainReport:
    """Compile (``make()``) and call once, from fresh caches; report what was captured and
    the kernels each graph compiled to (the forward's; a backward compiles when it first
    runs). ``profiler(call, events)`` gives the report's profile lines: it may call the
    compiled function again."""
    with recording() as events:
        compiled = make()
        compiled(*args, **kwargs)
        lines = profiler(lambda: compiled(*args, **kwargs), events) if profiler else []
    report = report_of(events)
    report.profile = lines
    return report


def report_of(events: list[Any]) -> ExplainReport:
    """The report of a :func:`recording`'s events: captures and skips, and the kernel lines
    of the programs compiled (events with ``kernel_lines``, the backend's records)."""
    report = ExplainReport()
    report.kernels = [
        line for e in events if hasattr(e, "kernel_lines") for line in e.kernel_lines()
    ]
    report.cudagraphs = _cudagraph_lines(events)
    report.backends = [
        line for e in events if hasattr(e, "backend_lines") for line in e.backend_lines()
    ]
    for name, item in (e for e in events if isinstance(e, Captured)):
        if isinstance(item, BreakRecord):
            report.skips.append(item)
            continue
        report.captures.append((name, item))
        report.breaks += item.breaks
        if item.graph is not None:
            report.graphs.append(item.graph)
            for node in item.graph.nodes:
                # (autodiff's markers are not opaque calls)
                if node.op is Op.EXTERN and node.attrs.fn not in (
                    function_outputs,
                    untracked_write,
                ):
                    report.externs.append(
                        f"{node.origin.api} ({node.origin.file}:{node.origin.line})"
                    )
        report.guards += [f"[{name}] {guard}" for guard in item.guards]
        report.saved += [f"[{name}] {value}" for value in item.saved]
        if item.shapes is not None:
            report.sizes += [f"[{name}] {line}" for line in size_lines(item.shapes)]
    return report


def _cudagraph_lines(events: list[Any]) -> list[str]:
    """Each CUDA-graph runner's line as it is now (runners record an event on each change)."""
    runners = {id(e): e for e in events if hasattr(e, "cudagraph_lines")}
    return [line for runner in runners.values() for line in runner.cudagraph_lines()]


def size_lines(shapes: ShapeEnv) -> list[str]:
    """What ``explain`` and ``KILN_LOG=dynamic`` say about one capture's symbolic sizes."""
    lines = []
    for name in shapes.symbols:
        where = places_text(shapes.sources[name])
        lines.append(f"{name} = {where}: {shapes.reasons[name]}")
    for expression, why in dict.fromkeys(shapes.specializations):
        lines.append(f"specialized {expression}: {why}")
    return lines


def compiled_so_far() -> ExplainReport:
    """The report of every cache entry compiled so far in this process (the captures a
    running program made, including the recompiles that made sizes symbolic)."""
    events: list[Any] = []
    for code, code_cache in list(cache._CACHES.values()):
        for entry in reversed(code_cache.entries):
            events.append(Captured(code.co_qualname, entry.capture))
        if code_cache.skip is not None:
            events.append(Captured(code_cache.skip.function, code_cache.skip))
    return report_of(events + live())
