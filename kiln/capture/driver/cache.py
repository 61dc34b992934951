"""Compiled wrappers and the per-code cache: the guarded fast path of every compiled function.

``compiled_function(fn)`` returns a generated function with ``fn``'s exact signature, so
CPython binds the arguments. It walks the cache entries of ``fn.__code__`` (newest first) and
runs the head of the first whose guard function passes::

    def forward(self, x, mask=___d0):
        for ___e in ___entries:
            if ___e.guard(___f, self, x, mask):
                ___e.hits += 1
                return ___e.head(___f, self, x, mask)
        return ___miss(self, x, mask)

A miss captures the frame (``driver/convert.py``). Past the recompile limit for one code
object (counted per module instance for methods), or when capture cannot handle the frame,
the code runs as its original function, with the reason logged and kept for ``explain``.
"""

from __future__ import annotations

import logging
import re
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from kiln.capture.bytecode.rewrite import route_calls
from kiln.capture.calls.routing import Router
from kiln.capture.core import frame
from kiln.capture.core.breaks import BreakRecord, FullGraphError, SkipReason
from kiln.capture.driver import artifact, resume
from kiln.capture.driver.convert import Capture, Skip, capture_frame, param_names
from kiln.capture.guards import native_guards
from kiln.capture.guards.guards import compile_guards, wants_native
from kiln.capture.guards.sizes import SizePolicy
from kiln.capture.guards.sources import safe_name
from kiln.collector import gc_paused
from kiln.config import logger
from kiln.ir.graph import Graph
from kiln.options import Options
from kiln.random_state import preserved_random_state
from kiln.recording import record as record_event

_log_breaks = logger("graph_breaks")
_log_recompiles = logger("recompiles")
_log_guards = logger("guards")
_log_graph = logger("graph")
_log_dynamic = logger("dynamic")


class GraphCompiler(Protocol):
    """What capture hands each graph to (``kiln.pipeline.Pipeline``, built by ``kiln.compile``
    and passed down, so capture imports no later stage): it returns the graph as optimized
    and the callable that runs it. Hashable: caches are kept per code object *and* compiler
    (the same function compiled with other options gets its own entries)."""

    @property
    def options(self) -> Options: ...

    def __call__(self, graph: Graph) -> tuple[Graph, Any]: ...


@dataclass
class Entry:
    capture: Capture
    guard: Callable[..., bool]
    guard_source: str
    first_failure: Callable[..., str | None]
    owner: int | None  # id of the module instance for methods (recompile accounting)
    head: Callable[..., Any] = field(init=False)
    hits: int = 0

    def __post_init__(self) -> None:
        self.head = self.capture.head


@dataclass
class Counters:
    """Process-wide statistics, readable from Python (``kiln.counters``)."""

    captures: int = 0
    artifact_hits: int = 0  # entries reused from the artifact cache (driver/artifact.py)
    programs_reused: int = 0  # scheduled programs read from it (kiln/backends/programs.py)
    recompiles: list[tuple[str, str]] = field(default_factory=list)
    graph_breaks: list[BreakRecord] = field(default_factory=list)
    fallbacks: list[BreakRecord] = field(default_factory=list)
    graphs: int = 0
    # torch.compile(backend="kiln") (kiln/dynamo.py): Dynamo graphs Kiln compiled (once per
    # call signature) and those it ran eagerly (why).
    dynamo_graphs: int = 0
    dynamo_fallbacks: list[str] = field(default_factory=list)

    @property
    def cache_hits(self) -> int:
        return sum(entry.hits for _, cache in _CACHES.values() for entry in cache.entries)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


counters = Counters()


@dataclass
class CodeCache:
    compiler: GraphCompiler
    entries: list[Entry] = field(default_factory=list)
    skip: BreakRecord | None = None
    routed: types.CodeType | None = None  # the original code with calls routed (for skips)
    warned: bool = False  # the recompile-limit warning was given
    # Which input dims are symbolic, per module instance for methods (two Linear layers
    # share forward's code: their inputs' sizes differ, but never change).
    sizes: dict[int | None, SizePolicy] = field(default_factory=dict)

    def size_policy(self, owner: int | None) -> SizePolicy:
        policy = self.sizes.get(owner)
        if policy is None:
            policy = self.sizes[owner] = SizePolicy(dynamic=self.compiler.options.dynamic)
        return policy


# Keyed by the code object's identity (code objects compare equal by value) and the compiler.
_CACHES: dict[tuple[int, GraphCompiler], tuple[types.CodeType, CodeCache]] = {}
_WRAPPERS: dict[Any, Any] = {}
_ROUTERS: dict[GraphCompiler, Router] = {}
_LOCK = threading.RLock()


class Captured(NamedTuple):
    """A recorded event (``kiln.recording``): a capture of ``function``, or a frame of it run
    uncompiled (``kiln.explain`` listens)."""

    function: str
    item: Capture | BreakRecord


def reset() -> None:
    """Forget every cache entry, compiled wrapper and counter."""
    with _LOCK:
        for _, cache in _CACHES.values():  # emptied in place: live wrappers hold them
            cache.entries.clear()
            cache.skip = None
            cache.sizes.clear()
            cache.routed = None
        _WRAPPERS.clear()
        counters.reset()
        frame.forget_instructions()
        resume.forget_resume_codes()


def cache_of(code: types.CodeType, compiler: GraphCompiler) -> CodeCache:
    key = (id(code), compiler)
    known = _CACHES.get(key)
    if known is None or known[0] is not code:
        known = _CACHES[key] = (code, CodeCache(compiler))
    return known[1]


def compiled_function(fn: types.FunctionType, compiler: GraphCompiler) -> Any:
    """The compiled wrapper of ``fn`` (one per function object and compiler)."""
    key = (fn, compiler)
    wrapper = _WRAPPERS.get(key)
    if wrapper is None:
        with _LOCK:
            wrapper = _WRAPPERS.get(key)
            if wrapper is None:
                wrapper = _WRAPPERS[key] = _make_wrapper(fn, compiler)
    return wrapper


def router(compiler: GraphCompiler) -> Router:
    """Routes the callees of code compiled with ``compiler`` through wrappers with the same."""
    known = _ROUTERS.get(compiler)
    if known is None:
        known = _ROUTERS[compiler] = Router(lambda fn: compiled_function(fn, compiler))
    return known


def _signature(fn: types.FunctionType, binder: dict[str, Any]) -> str:
    code = fn.__code__
    names = tuple(safe_name(name) for name in code.co_varnames)
    positional = code.co_argcount
    keyword = code.co_kwonlyargcount
    defaults = fn.__defaults__ or ()
    first_default = positional - len(defaults)
    parts: list[str] = []
    for i, name in enumerate(names[:positional]):
        if i >= first_default:
            binder[f"___d{i}"] = defaults[i - first_default]
            parts.append(f"{name}=___d{i}")
        else:
            parts.append(name)
        if code.co_posonlyargcount and i + 1 == code.co_posonlyargcount:
            parts.append("/")
    index = positional + keyword
    if code.co_flags & 0x04:
        parts.append(f"*{names[index]}")
        index += 1
    elif keyword:
        parts.append("*")
    kwdefaults = fn.__kwdefaults__ or {}
    for name in names[positional : positional + keyword]:
        if name in kwdefaults:
            binder[f"___k_{name}"] = kwdefaults[name]
            parts.append(f"{name}=___k_{name}")
        else:
            parts.append(name)
    if code.co_flags & 0x08:
        parts.append(f"**{names[index]}")
    return ", ".join(parts)


def _make_wrapper(fn: types.FunctionType, compiler: GraphCompiler) -> Any:
    code = fn.__code__
    cache = cache_of(code, compiler)
    scope: dict[str, Any] = {"___entries": cache.entries, "___f": fn}
    signature = _signature(fn, scope)
    args = ", ".join(param_names(code))
    call_args = ", ".join(["___f", *param_names(code)])
    source = (
        f"def {_identifier(code.co_name)}({signature}):\n"
        f"    for ___e in ___entries:\n"
        f"        if ___e.guard({call_args}):\n"
        f"            ___e.hits += 1\n"
        f"            return ___e.head({call_args})\n"
        f"    return ___miss(({args}{',' if args else ''}))\n"
    )
    scope["___miss"] = lambda values: _miss(fn, cache, values, compiler)
    exec(compile(source, f"<kiln wrapper of {code.co_qualname}>", "exec"), scope)
    wrapper = scope[_identifier(code.co_name)]
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    wrapper.__module__ = fn.__module__
    wrapper.__wrapped__ = fn
    wrapper._kiln_cache = cache
    return wrapper


def _identifier(name: str) -> str:
    cleaned = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return cleaned if cleaned.isidentifier() else "compiled"


# Skips after which the frame runs with its calls routed through compiled wrappers.
_ROUTED_SKIPS = frozenset(
    {
        SkipReason.BREAK_IN_TRY,
        SkipReason.BREAK_IN_LOOP,
        SkipReason.BREAK_IN_WITH,
        SkipReason.GENERATOR,
        SkipReason.ITERATOR_ARGUMENT,
        SkipReason.RECOMPILE_LIMIT,
        SkipReason.UNRECONSTRUCTIBLE,
    }
)


def run_uncompiled(fn: types.FunctionType, cache: CodeCache, values: tuple[Any, ...]) -> Any:
    """Run a skipped frame: its original code, with calls routed through compiled wrappers
    where the skip reason allows (so callees are still compiled)."""
    if cache.skip is None or cache.skip.reason not in _ROUTED_SKIPS:
        return run_original(fn, values)
    if cache.routed is None:
        try:
            cache.routed = route_calls(fn.__code__, router(cache.compiler))
        except Exception:  # routing is an optimization: the original code is always right
            cache.routed = fn.__code__
    routed = types.FunctionType(
        cache.routed, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    routed.__kwdefaults__ = fn.__kwdefaults__
    return run_original(routed, values)


def run_original(fn: types.FunctionType, values: tuple[Any, ...]) -> Any:
    """Call ``fn`` natively with its argument locals ``values``."""
    code = fn.__code__
    positional = code.co_argcount
    keyword = code.co_kwonlyargcount
    args = list(values[:positional])
    kwargs = dict(
        zip(code.co_varnames[positional : positional + keyword], values[positional:], strict=False)
    )
    index = positional + keyword
    if code.co_flags & 0x04:
        args += list(values[index])
        index += 1
    if code.co_flags & 0x08:
        kwargs.update(values[index])
    return fn(*args, **kwargs)


def _owner(values: tuple[Any, ...]) -> int | None:
    return id(values[0]) if values and isinstance(values[0], torch.nn.Module) else None


def _miss(
    fn: types.FunctionType, cache: CodeCache, values: tuple[Any, ...], compiler: GraphCompiler
) -> Any:
    with _LOCK:
        if cache.skip is not None:
            return run_uncompiled(fn, cache, values)
        # Another thread may have compiled an entry for these inputs while this one waited.
        entry: Entry | _Eager | None = next(
            (e for e in cache.entries if e.guard(fn, *values)), None
        )
        if isinstance(entry, Entry):
            entry.hits += 1
        else:
            with gc_paused():
                entry = _compile_entry(fn, cache, values, compiler)
            if entry is None:
                return run_uncompiled(fn, cache, values)
    if isinstance(entry, _Eager):
        return entry.result
    return entry.head(fn, *values)


_NUMBER_GUARD = re.compile(r"(?!len\()(.+) == -?\d[\d.e+-]*")  # (an Equals guard, not LengthIs)


def _number_hint(reason: str) -> str:
    """What to do when the guard that keeps failing is on a Python number: Kiln compiles a
    graph per value of an int or float it reads (only sizes become symbolic)."""
    match = _NUMBER_GUARD.fullmatch(reason)
    if match is None:
        return ""
    return (
        f" ({match.group(1)} is a Python number: each value compiles a graph of its own; "
        "pass it as a tensor to compile one graph for all values)"
    )


@dataclass
class _Eager:
    """The frame already ran as its original code (capture failed and eager succeeded)."""

    result: Any


def _compile_entry(
    fn: types.FunctionType, cache: CodeCache, values: tuple[Any, ...], compiler: GraphCompiler
) -> Entry | _Eager | None:
    """A new cache entry for ``values``; None when the frame must run uncompiled."""
    owner = _owner(values)
    mine = [entry for entry in cache.entries if entry.owner == owner]
    if mine:
        reason = mine[0].first_failure(fn, *values) or "no guard failed"
        counters.recompiles.append((fn.__qualname__, reason))
        _log_recompiles.info("recompiling %s: %s", fn.__qualname__, reason)
        if len(mine) >= compiler.options.recompile_limit:
            record = BreakRecord(
                SkipReason.RECOMPILE_LIMIT,
                f"{len(mine)} entries; last guard failure: {reason}",
                None,
                fn.__qualname__,
            )
            _skip(cache, record, permanent=False)
            if not cache.warned:
                cache.warned = True
                warnings.warn(
                    f"kiln: {fn.__qualname__} hit the recompile limit "
                    f"(recompile_limit={compiler.options.recompile_limit}) and runs uncompiled "
                    f"from now on; last guard failure: {reason}{_number_hint(reason)}",
                    stacklevel=5,
                )
            return None
    with preserved_random_state():  # (compiling the stored graphs draws nothing of the user's)
        reused = artifact.reuse(fn, values, compiler, router(compiler))
    if reused is not None:
        return _install(fn, cache, reused[0], owner, reused[1])
    try:
        with preserved_random_state():
            capture = capture_frame(
                fn,
                values,
                compiler,
                router(compiler),
                compiler.options.fullgraph,
                cache.size_policy(owner),
            )
    except Skip as skip:
        if compiler.options.strict and skip.reason is SkipReason.BACKEND_ERROR:
            raise skip.__cause__ or skip from None
        record = BreakRecord(skip.reason, skip.detail, skip.location, fn.__qualname__)
        if compiler.options.fullgraph:
            raise FullGraphError(f"fullgraph=True: {record}", skip.location) from skip
        _skip(cache, record, permanent=True)
        return None
    except FullGraphError:
        raise
    except Exception as error:
        return _Eager(_capture_failed(fn, cache, values, compiler, error))
    artifact.store(fn, capture, compiler.options)
    return _install(fn, cache, capture, owner)


def _install(
    fn: types.FunctionType,
    cache: CodeCache,
    capture: Capture,
    owner: int | None,
    reused: tuple[Any, str, Any] | None = None,
) -> Entry:
    """``reused``: the compiled guards of an entry from the artifact cache."""
    params = param_names(fn.__code__)
    guard, source, first_failure = reused or compile_guards(capture.guards, params)
    entry = Entry(capture, guard, source, first_failure, owner)
    cache.entries.insert(0, entry)
    if wants_native(capture.guards, source):  # rebuilt with C++ checks once they load
        native_guards.when_ready(lambda: _nativize(entry, params))
    counters.artifact_hits += reused is not None
    counters.captures += reused is None
    counters.graphs += capture.graph is not None
    for record in capture.breaks:
        counters.graph_breaks.append(record)
        _log_breaks.info("graph break: %s", record)
    for record in capture.uncompiled:
        counters.fallbacks.append(record)
        _log_breaks.info("running part of %s uncompiled: %s", record.function, record)
    if capture.shapes is not None:
        from kiln.capture.driver.explain import size_lines

        _log_dynamic.info(
            "symbolic sizes of %s:\n%s",
            fn.__qualname__,
            "\n".join(f"  {line}" for line in size_lines(capture.shapes)),
        )
    if capture.graph is not None and _log_graph.isEnabledFor(logging.INFO):
        from kiln.ir.printer import format_graph

        _log_graph.info("graph of %s:\n%s", fn.__qualname__, format_graph(capture.graph))
    if _log_guards.isEnabledFor(logging.INFO):  # (printing 3000 guards: 0.2 s)
        lines = "\n".join(f"  {g}" for g in capture.guards)
        _log_guards.info("guards of %s:\n%s", fn.__qualname__, lines)
    record_event(Captured(fn.__qualname__, capture))
    for record in capture.uncompiled:
        record_event(Captured(record.function, record))
    return entry


def _nativize(entry: Entry, params: Sequence[str]) -> None:
    """Swap ``entry``'s guard function for one checking its tensors natively (called from the
    extension's build thread; the wrapper reads ``entry.guard`` at each call)."""
    guard, source, _ = compile_guards(entry.capture.guards, params)
    entry.guard_source = source
    entry.guard = guard


def _skip(cache: CodeCache, record: BreakRecord, *, permanent: bool) -> None:
    counters.fallbacks.append(record)
    _log_breaks.info("running %s uncompiled: %s", record.function, record)
    if permanent or record.reason is SkipReason.RECOMPILE_LIMIT:
        cache.skip = record
    record_event(Captured(record.function, record))


def _capture_failed(
    fn: types.FunctionType,
    cache: CodeCache,
    values: tuple[Any, ...],
    compiler: GraphCompiler,
    error: Exception,
) -> Any:
    """Capture raised: if eager raises too, that is the user's error (re-raised as eager's);
    if eager succeeds, it was Kiln's: warn, skip the frame, never return a wrong result."""
    result = run_original(fn, values)
    if compiler.options.strict:
        raise error
    record = BreakRecord(
        SkipReason.INTERNAL_ERROR, f"{type(error).__name__}: {error}", None, fn.__qualname__
    )
    # stacklevel: the user's call (here, _compile_entry, _miss, the miss lambda, the wrapper).
    warnings.warn(f"kiln: {fn.__qualname__} runs uncompiled: {record.detail}", stacklevel=6)
    _skip(cache, record, permanent=True)
    return result
