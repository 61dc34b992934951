"""``kiln.trace``: symbolic tracing with proxy tensors, the role torch.fx's tracer plays.

Tracing runs the program once with :class:`~kiln.frontends.proxy.ProxyTensor` arguments and
module parameters/buffers, recording every torch call as prims. Python control flow runs for
real (on shapes and other static facts), so the graph is specialized to the example inputs'
shapes, dtypes and devices. Control flow on tensor *values* cannot be traced and raises
:class:`~kiln.errors.TraceError` naming the user's line::

    graph = kiln.trace(model, x)          # a kiln.ir.Graph
    outputs = run_traced(graph, model, x) # interpret it on (new) inputs of the same types
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.frontends.proxy import ROUTED, ProxyTensor, TraceMode, dispatch
from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.interpreter import run
from kiln.ir.printer import public_name
from kiln.ir.symbolic import Sym
from kiln.ir.types import TensorType
from kiln.ir.verify import verify


def trace(fn_or_module: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Trace ``fn_or_module(*args, **kwargs)`` into a verified :class:`~kiln.ir.Graph`.

    Tensor arguments become ``USER`` inputs (in ``pytree`` leaf order); a module's parameters and
    buffers become ``PARAMETER``/``BUFFER`` inputs named by attribute path; tensors the program
    closes over become ``CONSTANT`` inputs. In-place updates of inputs (BatchNorm running stats)
    become ``graph.mutations``.
    """
    return trace_call(fn_or_module, args, kwargs)


def trace_call(
    fn_or_module: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    type_of: Callable[[torch.Tensor], TensorType] = TensorType.of,
) -> Graph:
    """:func:`trace`, each tensor argument's input typed by ``type_of`` (``kiln.export`` gives
    some dims symbolic sizes; an active ``ShapeEnv`` then records what tracing decided on them)."""
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    target = module.forward if module is not None else fn_or_module
    graph = Graph(name=_graph_name(fn_or_module))
    with (
        GraphBuilder(graph),
        _compiling(),
        _module_proxies(module, graph) as state_proxies,
        # (symbolic inputs only: the routing patches torch for the whole process while it traces)
        _sized_calls() if type_of is not TensorType.of else contextlib.nullcontext(),
        TraceMode(),
    ):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        names = _leaf_names(target, args, kwargs, len(leaves))
        proxies: dict[int, ProxyTensor] = {}  # one input per tensor object, however often passed
        traced_leaves = []
        for leaf, name in zip(leaves, names, strict=True):
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in proxies:
                    value = graph.add_input(type_of(leaf), name=name, source=name)
                    proxies[id(leaf)] = ProxyTensor(value)
                    proxies[id(leaf)]._strides = tuple(leaf.stride())
                traced_leaves.append(proxies[id(leaf)])
            else:
                traced_leaves.append(leaf)
        traced_args, traced_kwargs = pytree.tree_unflatten(traced_leaves, spec)
        result = fn_or_module(*traced_args, **traced_kwargs)
        _set_outputs(graph, result)
        for proxy in [*proxies.values(), *state_proxies]:
            if proxy._mutations:
                graph.mutations.append((proxy._initial, proxy.current()))
    return verify(graph)


def _graph_name(fn: Any) -> str:
    name = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "fn")
    name = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return name if name.isidentifier() else "fn"


def _leaf_names(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], count: int
) -> list[str]:
    """A readable input name per pytree leaf: the parameter name, suffixed inside containers."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"arg{i}": a for i, a in enumerate(args)} | kwargs
    names: list[str] = []
    for name, value in bound.items():
        sub = pytree.tree_leaves(value)
        names += [name] if len(sub) == 1 else [f"{name}_{i}" for i in range(len(sub))]
    if len(names) != count:  # *args/**kwargs bound as containers in another order
        names = [f"arg{i}" for i in range(count)]
    return names


def _set_outputs(graph: Graph, result: Any) -> None:
    leaves, spec = pytree.tree_flatten(result)
    plan: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, ProxyTensor):
            plan.append(len(graph.outputs))
            graph.outputs.append(leaf.current())
        elif isinstance(leaf, torch.Tensor):
            from kiln.ir.builder import require_builder

            plan.append(len(graph.outputs))
            graph.outputs.append(require_builder().constant(leaf))
        else:
            plan.append(("constant", leaf))
    graph.output_spec = (spec, plan)


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Make ``torch.compiler.is_compiling()`` answer True, so libraries pick traceable paths."""
    compiler = torch.compiler
    previous = getattr(compiler, "_is_compiling_flag", False)
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = previous


# torch functions and tensor methods whose size arguments torch's argument parser reads before
# any override sees them (``torch.arange(n)``: a Number; ``x.expand(b, -1)``: a first list item
# is read with ``__index__``, which specializes a symbolic size). Bytecode capture routes such
# calls at the call site; tracing routes them here, while tracing.
_SIZED_FACTORIES = ("arange", "full", "linspace", "zeros", "ones", "empty", "rand", "randn")
_SIZED_METHODS = (
    *("view", "reshape", "expand", "repeat", "broadcast_to", "unflatten", "tile"),
    *("new_zeros", "new_ones", "new_empty", "new_full"),
)


@contextlib.contextmanager
def _sized_calls() -> Iterator[None]:
    """Route the sized calls above given a symbolic size to the proxies' dispatch."""
    public_name(torch.zeros)  # (the printer's cached names are those of the unwrapped calls)
    owners = ((torch, _SIZED_FACTORIES), (torch.Tensor, _SIZED_METHODS))
    patched = [(owner, name, vars(owner).get(name)) for owner, names in owners for name in names]

    def routed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(leaf, Sym) for leaf in pytree.tree_leaves((args, kwargs))):
                return dispatch(fn, args, kwargs)
            return fn(*args, **kwargs)

        ROUTED[call] = fn  # (torch hands overrides the method it finds: this wrapper)
        return call

    for owner, name, _ in patched:
        setattr(owner, name, routed(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, own in patched:
            ROUTED.pop(getattr(owner, name), None)
            if own is None:
                delattr(owner, name)  # (a method torch.Tensor inherits from its C base)
            else:
                setattr(owner, name, own)


@contextlib.contextmanager
def _module_proxies(module: torch.nn.Module | None, graph: Graph) -> Iterator[list[ProxyTensor]]:
    """Swap a module's parameters and buffers for proxies (graph inputs) while tracing."""
    if module is None:
        yield []
        return
    saved: list[tuple[dict[str, Any], str, Any]] = []
    by_tensor: dict[int, ProxyTensor] = {}
    proxies: list[ProxyTensor] = []
    try:
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for slot, kind in (
                (owner._parameters, InputKind.PARAMETER),
                (owner._buffers, InputKind.BUFFER),
            ):
                for attr, tensor in list(slot.items()):
                    if tensor is None or isinstance(tensor, ProxyTensor):
                        continue  # absent, or a module reached twice (already swapped)
                    if id(tensor) not in by_tensor:
                        path = f"{prefix}.{attr}" if prefix else attr
                        value = graph.add_input(
                            TensorType.of(tensor), name=path, kind=kind, source=path
                        )
                        proxy = ProxyTensor(value)
                        proxy._strides = tuple(tensor.stride())
                        by_tensor[id(tensor)] = proxy
                        proxies.append(proxy)
                    saved.append((slot, attr, tensor))
                    slot[attr] = by_tensor[id(tensor)]
        yield proxies
    finally:
        for slot, attr, tensor in saved:
            slot[attr] = tensor


def graph_inputs(graph: Graph, fn_or_module: Any, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """The tensors to feed ``graph`` for a call ``fn_or_module(*args, **kwargs)``."""
    unique = {
        id(leaf): leaf
        for leaf in pytree.tree_leaves((args, kwargs))
        if isinstance(leaf, torch.Tensor)
    }
    user = iter(unique.values())
    module = fn_or_module if isinstance(fn_or_module, torch.nn.Module) else None
    tensors: list[torch.Tensor] = []
    for value in graph.inputs:
        tensors.append(_input_tensor(value, graph, module, user))
    return tensors


def _input_tensor(
    value: Value, graph: Graph, module: torch.nn.Module | None, user: Iterator[torch.Tensor]
) -> torch.Tensor:
    if value.kind is InputKind.USER:
        return next(user)
    if value.kind is InputKind.CONSTANT:
        return graph.constants[value.name]
    if value.kind is InputKind.RNG_SEED:
        return torch.randint(0, 2**62, (), dtype=torch.int64)
    assert module is not None, f"input {value.name} needs the module it was traced from"
    owner_path, _, attr = value.source.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    tensor = getattr(owner, attr)
    assert isinstance(tensor, torch.Tensor)
    return tensor


def rebuild_outputs(graph: Graph, outputs: list[torch.Tensor]) -> Any:
    """The user's return structure, rebuilt from the graph's outputs."""
    spec, plan = graph.output_spec
    leaves = [outputs[slot] if isinstance(slot, int) else slot[1] for slot in plan]
    return pytree.tree_unflatten(leaves, spec)


def run_traced(graph: Graph, fn_or_module: Any, *args: Any, **kwargs: Any) -> Any:
    """Interpret ``graph`` for the call ``fn_or_module(*args, **kwargs)``, like eager would."""
    inputs = graph_inputs(graph, fn_or_module, *args, **kwargs)
    return rebuild_outputs(graph, run(graph, inputs))
