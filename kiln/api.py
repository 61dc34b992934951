"""The public entry points: ``kiln.compile``, ``kiln.explain``, ``kiln.reset``.

``compile`` wraps a function (or a module's call) in a guarded, cached dispatcher
(``kiln/capture/driver/cache.py``); the first call with new inputs captures the frame's bytecode
into graphs (``kiln/capture``), which the chosen backend compiles.
"""

from __future__ import annotations

import builtins
import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from kiln.backends import lookup_backend, roofline
from kiln.backends.kiln import CompiledProgramRecord
from kiln.capture.calls.builtins import graph_break
from kiln.capture.core.breaks import BreakReason, SkipReason
from kiln.capture.driver.cache import compiled_function, counters, reset
from kiln.capture.driver.explain import ExplainReport, compiled_so_far
from kiln.capture.driver.explain import explain as _explain
from kiln.capture.guards.sizes import mark_dynamic, mark_static
from kiln.options import Options
from kiln.pipeline import Pipeline
from kiln.runtime.cudagraphs import mark_step_begin
from kiln.runtime.triton_build import start_workers

__all__ = [
    "BreakReason",
    "CompiledModule",
    "SkipReason",
    "compile",
    "counters",
    "explain",
    "graph_break",
    "mark_dynamic",
    "mark_static",
    "mark_step_begin",
    "reset",
]


def compile(
    fn_or_module: Any = None,
    *,
    backend: str = "kiln",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    """Compile a function or ``nn.Module``; usable as ``@kiln.compile`` or
    ``@kiln.compile(fullgraph=True)``. The result computes what the original does, faster."""
    settings = Options.of(options, backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    lookup_backend(backend)  # unknown names fail here
    pipeline = Pipeline(settings)
    if fn_or_module is None:
        return functools.partial(_compile, pipeline=pipeline)
    return _compile(fn_or_module, pipeline)


def _compile(target: Any, pipeline: Pipeline) -> Any:
    if (
        pipeline.options.backend == "kiln"
        and torch.cuda.is_available()
        and torch.cuda.is_initialized()
    ):
        # The program already uses the GPU: start the kernel-compile workers now, so that
        # their start-up overlaps the first call's capture.
        start_workers([torch.device("cuda", torch.cuda.current_device())], pipeline.options.codegen)
    if isinstance(target, torch.nn.Module):
        return CompiledModule(target, pipeline)
    if isinstance(target, types.MethodType) and isinstance(target.__func__, types.FunctionType):
        return types.MethodType(compiled_function(target.__func__, pipeline), target.__self__)
    if isinstance(target, types.FunctionType):
        wrapper = compiled_function(target, pipeline)
        functools.update_wrapper(wrapper, target)
        return wrapper
    call = type(target).__dict__.get("__call__") if callable(target) else None
    if isinstance(call, types.FunctionType):
        return types.MethodType(compiled_function(call, pipeline), target)
    if callable(target):  # a builtin (torch.erfinv), a partial: compiled through a caller
        wrapper = functools.partial(compiled_function(_module_caller(), pipeline), target)
        functools.update_wrapper(wrapper, target)
        return wrapper
    raise TypeError(f"kiln.compile expects a callable or nn.Module, got {type(target).__name__}")


_CALLER_GLOBALS: dict[str, Any] = {}


def _module_caller() -> types.FunctionType:
    """A fresh ``lambda self, *args, **kwargs: self(*args, **kwargs)`` (its own code object,
    so each compiled module or callable has its own cache). The callers share one globals
    dict: the resume function after a break at the call (a data-parallel module) is one code
    object for all of them, and its guard on the globals then holds for every caller."""
    scope = _CALLER_GLOBALS
    source = "def __call__(self, *args, **kwargs):\n    return self(*args, **kwargs)\n"
    exec(builtins.compile(source, "<kiln module call>", "exec"), scope)
    return scope["__call__"]


def _compiled_module(module: torch.nn.Module, options: Options) -> CompiledModule:
    """A pickled or copied ``CompiledModule`` rebuilt: compiled afresh, on its first call."""
    return CompiledModule(module, Pipeline(options))


class CompiledModule(torch.nn.Module):
    """A module whose calls run compiled; it shares parameters and buffers with the original
    (registered as ``_orig_mod``, like ``torch.compile``'s wrapper).

    Pickling (``torch.save``) and ``copy.deepcopy`` store the original module and the options,
    as ``torch.compile``'s module does: the loaded or copied object is a ``CompiledModule`` of
    the loaded or copied module, with caches of its own, and compiles on its first call."""

    def __init__(self, module: torch.nn.Module, pipeline: Pipeline) -> None:
        super().__init__()
        self._orig_mod = module
        self._kiln_options = pipeline.options
        self._kiln_call = compiled_function(_module_caller(), pipeline)
        self._register_load_state_dict_pre_hook(_into_original)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The original module's state dict: its keys, without ``_orig_mod.`` (so checkpoints
        load into the uncompiled model, and ``torch.distributed.checkpoint`` sees its names)."""
        return self._orig_mod.state_dict(*args, **kwargs)

    def named_modules(
        self, memo: Any = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Any:
        """This module, then the original module's, under this module's own name (so that
        ``named_parameters`` has the original names, as the optimizer state of
        ``torch.distributed.checkpoint`` needs; ``fully_shard`` still finds this module's state)."""
        memo = set() if memo is None else memo
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
            yield from self._orig_mod.named_modules(memo, prefix, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For ``torch.distributed.checkpoint``: ``_orig_mod`` is no part of the state's names
        (it walks a model's children by this hook's name)."""
        return {"compiled": "_orig_mod"}

    def __reduce__(self) -> tuple[Any, tuple[torch.nn.Module, Options]]:
        return (_compiled_module, (self._orig_mod, self._kiln_options))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks:
            # Hooks on the compiled module itself (``fully_shard(kiln.compile(block))``
            # all-gathers its parameters in one) run around the compiled forward, eagerly.
            return super().__call__(*args, **kwargs)
        return self._kiln_call(self._orig_mod, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._kiln_call(self._orig_mod, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("_orig_mod", "_kiln_call") or name.startswith("_"):
            return super().__getattr__(name)
        return getattr(self._modules["_orig_mod"], name)


def _into_original(state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Before a load: the keys of the original module's state (``state_dict``'s) go to it."""
    inner = f"{prefix}_orig_mod."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix) :]] = state.pop(key)


def explain(
    fn: Callable[..., Any] | None = None, *args: Any, profile: bool = False, **kwargs: Any
) -> ExplainReport:
    """Run ``fn(*args, **kwargs)`` compiled, from fresh caches, and report what capture did:
    graphs, graph breaks (reason, file, line, source text), frames run uncompiled, externs
    and guards, symbolic sizes, and the kernels each graph compiled to (the forward's; a
    backward compiles when it first runs). ``fn`` may be plain or already compiled.

    ``kiln.explain()`` without arguments reports every capture this process has made so far
    (a running program's recompiles, and which sizes they made symbolic, and why).

    ``profile=True`` adds a per-kernel roofline (``kiln/backends/roofline.py``): each GPU
    kernel's measured time, the bytes it moves and its share of the card's copy bandwidth, or
    of its matmul FLOP/s for externs."""
    if fn is None:
        return compiled_so_far()
    pipeline = Pipeline(_options_of(fn))
    profiler = _roofline if profile else None
    return _explain(lambda: _compile(_original(fn), pipeline), *args, profiler=profiler, **kwargs)


def _roofline(call: Callable[[], Any], events: list[Any]) -> list[str]:
    """The profile lines of a compiled call (its kernels ran once already)."""
    call()  # a second call: what compiles late (a CUDA graph's recording) is done
    programs = [e.program for e in events if isinstance(e, CompiledProgramRecord) and e.program]
    devices = {b.device for p in programs for b in p.inputs if b.device.type == "cuda"}
    if not devices:
        return ["per-kernel times are measured on CUDA devices only (this call ran on the CPU)"]
    device = min(devices, key=str)
    return roofline.report(roofline.measure(call, programs), device)


def _options_of(fn: Any) -> Options:
    """The options ``fn`` was compiled with (the defaults for a plain function), so that
    ``explain`` shows what the user's compile makes (a mode's CUDA graphs and tuning)."""
    call = getattr(fn, "_kiln_call", None) if isinstance(fn, CompiledModule) else None
    target = getattr(fn, "__func__", fn)
    cache = getattr(call if call is not None else target, "_kiln_cache", None)
    compiler = getattr(cache, "compiler", None)
    return compiler.options if isinstance(compiler, Pipeline) else Options()


def _original(fn: Any) -> Any:
    """The uncompiled function or module behind a compiled one."""
    if isinstance(fn, CompiledModule):
        return fn._orig_mod
    if isinstance(fn, types.MethodType) and hasattr(fn.__func__, "_kiln_cache"):
        return types.MethodType(getattr(fn.__func__, "__wrapped__"), fn.__self__)  # noqa: B009
    if hasattr(fn, "_kiln_cache"):
        return fn.__wrapped__
    return fn
