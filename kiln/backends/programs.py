"""Scheduled programs kept on disk beside the artifact cache, so that a process reusing a
stored capture (a warm start) skips scheduling too: ``<cache_dir>/artifacts/p-<key>.kart``,
written, checksummed and evicted as the artifact files are (``capture/driver/artifact.py``).

The key hashes what :func:`~kiln.schedule.scheduler.schedule` reads: the graph, pickled whole
(ops, attributes, types, constants, names, in order), each input's layout (shape, strides,
dtype, device), the options and configuration, and Kiln's source files, torch, Triton and
Python (``artifact.environment``). A graph that does not pickle, or a program built after
layout observations (keyed by node identity, which means nothing in another process), is
neither stored nor looked up.

What is stored is the program as the scheduler returned it, before code generation, with two
things rewritten: the graph's nodes and values it refers to are stored by position and bound
to this process's graph (the wrapper reports layout observations by node), and its buffer plan,
a dict keyed by ``id(buffer)``, is stored as pairs of buffers. Measured on ResNet-18 (CPU):
scheduling 74 ms, pickling 3 ms (132 KB), unpickling 6 ms. The code generated from a program
(C++ or Triton sources, and which kernels are duplicates) is stored beside it
(``g-<key>.kart``) and reused only with a program read from the disk.

A program in symbolic sizes (one for a range of sizes) is keyed without the sizes: the graph
with its symbols' hints left out and the inputs' layout pattern (``s-<key>.kart``). Its file
holds up to ``SYMBOLIC_VARIANTS`` programs, each with the relations on the sizes it holds for
(what scheduling and code generation decided) and its generated code; a process reads the
first whose relations hold for its sizes, its symbols' hints rebound to them, so questions
asked again decide by the sizes at hand. A program whose environment has checks (decisions
only code can test) is not stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.capture.driver import artifact
from kiln.capture.driver.cache import counters
from kiln.config import config, logger
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.symbolic import Relation, Symbol, relations_check
from kiln.options import Options
from kiln.schedule.program import Program

_log = logger("cache")


def key(graph: Graph, inputs: Sequence[Any], options: Options) -> str | None:
    """The file key of ``graph`` scheduled for ``inputs``; None when it cannot have one."""
    if not config.artifact_cache:
        return None
    try:
        graph_bytes = _canonical_bytes(graph)
    except Exception as error:  # (a Python object in an attribute: scheduled every time)
        _log.info("program of %s not cached: %s: %s", graph.name, type(error).__name__, error)
        return None
    layouts = [
        (tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else t
        for t in inputs
    ]
    text = f"{layouts!r}\n{options!r}\n{config!r}\n{artifact.environment()}"
    return hashlib.sha256(graph_bytes + text.encode()).hexdigest()[:40]


# Programs of one graph in symbolic sizes kept on disk (block-size buckets and other decided
# relations each make one): the newest this many.
SYMBOLIC_VARIANTS = 8


def symbolic_key(graph: Graph, pattern: tuple[object, ...], options: Options) -> str | None:
    """The file key of the programs of ``graph`` with symbols for inputs of ``pattern``
    (their layouts as such a program depends on them), whatever the sizes; None: no key."""
    if not config.artifact_cache:
        return None
    try:
        graph_bytes = _canonical_bytes(graph)
    except Exception as error:
        _log.info("program of %s not cached: %s: %s", graph.name, type(error).__name__, error)
        return None
    text = f"symbolic\n{pattern!r}\n{options!r}\n{config!r}\n{artifact.environment()}"
    return hashlib.sha256(graph_bytes + text.encode()).hexdigest()[:40]


@dataclasses.dataclass
class Stored:
    """A program in symbolic sizes read from the disk: the relations it holds for, its code."""

    program: Program
    relations: tuple[Relation, ...]
    generated: dict[Any, Any]


def load_symbolic(file_key: str, values: dict[str, int], graph: Graph) -> Stored | None:
    """The first program stored under ``file_key`` whose relations hold for ``values`` (the
    symbols' sizes now), bound to ``graph`` and hinted by ``values``; or None."""
    for data, meta in artifact.read_entries(_path(file_key, "s")):
        try:
            relations: tuple[Relation, ...] = pickle.loads(meta)
            if not relations_check(relations)(values):
                continue
            program, reuses, generated = _Unpickler(io.BytesIO(data), graph, values).load()
        except Exception as error:  # (never worth a failure: schedule instead)
            _log.info("stored program of %s not used: %s", graph.name, error)
            return None
        program.reuses = {id(temp): buffer for temp, buffer in reuses}
        counters.programs_reused += 1
        return Stored(program, relations, generated)
    return None


def store_symbolic(
    file_key: str,
    relations: tuple[Relation, ...],
    graph: Graph,
    program: Program,
    generated: dict[Any, Any],
) -> None:
    """Add ``program`` (in symbolic sizes, holding where ``relations`` do) to ``file_key``'s."""
    written = {id(b): b for kernel in program.kernels() for b in kernel.writes()}
    reuses = [(written[k], buffer) for k, buffer in program.reuses.items()]
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, graph).dump((dataclasses.replace(program, reuses={}), reuses, generated))
        path = _path(file_key, "s")
        kept = [e for e in artifact.read_entries(path) if pickle.loads(e[1]) != relations]
        entry = (buffer.getvalue(), pickle.dumps(relations, protocol=pickle.HIGHEST_PROTOCOL))
        artifact.write_entries(path, [*kept[-(SYMBOLIC_VARIANTS - 1) :], entry])
    except Exception as error:  # (an unpicklable attribute, a read-only cache: runs on)
        _log.info("program of %s not stored: %s: %s", graph.name, type(error).__name__, error)


def _canonical_bytes(graph: Graph) -> bytes:
    """``graph`` pickled so that equal graphs give equal bytes in any process: without the
    pickle memo (whether two equal strings or tuples are one object varies between processes,
    and the memo writes a back-reference for one and a copy for the other), nodes and values
    written once each, in order, and referred to by position (which breaks the cycles that
    memo-less pickling cannot follow). Only hashed, never read back."""
    positions = {id(value): i for i, value in enumerate(_values(graph))}
    positions.update((id(node), i) for i, node in enumerate(graph.nodes))
    digests: dict[tuple[object, ...], str] = {}

    class Canonical(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            kind = "value" if isinstance(obj, Value) else "node" if isinstance(obj, Node) else ""
            return (kind, positions[id(obj)]) if kind and id(obj) in positions else None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, Symbol):  # (its hint is one call's size)
                return tuple, (("symbol", obj.name, obj.low, obj.high),)
            if not isinstance(obj, torch.Tensor):
                return NotImplemented
            digest = _span_digest(obj, digests)
            return tuple, ((str(obj.dtype), tuple(obj.shape), obj.stride(), digest),)

    def fields(obj: Value | Node, *left_out: str) -> dict[str, Any]:
        return {k: v for k, v in vars(obj).items() if k not in left_out}

    state = {k: v for k, v in vars(graph).items() if k != "_names"}  # (a set: order varies)
    state["inputs"] = [fields(value, "node") for value in graph.inputs]
    state["nodes"] = [
        (fields(node, "outputs"), [fields(value, "node") for value in node.outputs])
        for node in graph.nodes
    ]
    buffer = io.BytesIO()
    pickler = Canonical(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = True  # (no memo: a cycle left would raise, and the graph is not cached)
    pickler.dump(state)
    return buffer.getvalue()


def _span_digest(tensor: torch.Tensor, digests: dict[tuple[object, ...], str]) -> str:
    """The sha256 of the stretch of storage ``tensor`` views, from its first element to its last.
    An expanded constant (DeBERTa's relative positions: [12, 512, 512] int64 over one
    [512, 512]) hashes its 2 MB once, not 25 MB materialized per use: 24 of them made
    DeBERTa-v3's forward key take 1 s. Bytes the view skips are hashed too, which can only
    make two graphs' keys differ, never match wrongly."""
    tensor = tensor.detach()
    if tensor.numel() == 0:
        return ""
    low = tensor.storage_offset()  # (strides are never negative)
    high = low + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    memo = (tensor.untyped_storage().data_ptr(), low, high, tensor.dtype)
    if memo not in digests:
        span = tensor.as_strided((high - low + 1,), (1,), low).cpu()
        digests[memo] = hashlib.sha256(span.view(torch.uint8).numpy().tobytes()).hexdigest()
    return digests[memo]


def _path(file_key: str, kind: str = "p") -> Path:
    """``p-``: the program; ``g-``: the code generated from it; ``s-``: programs in symbolic
    sizes with their relations and code."""
    return Path(config.cache_dir) / "artifacts" / f"{kind}-{file_key}.kart"


def load(file_key: str, graph: Graph) -> Program | None:
    """The program stored under ``file_key``, bound to ``graph``'s nodes, or None."""
    for data, _ in artifact.read_entries(_path(file_key)):
        try:
            program, reuses = _Unpickler(io.BytesIO(data), graph).load()
        except Exception as error:  # (never worth a failure: schedule instead)
            _log.info("stored program of %s not used: %s", graph.name, error)
            return None
        program.reuses = {id(temp): buffer for temp, buffer in reuses}
        counters.programs_reused += 1
        return program
    return None


def store(file_key: str, graph: Graph, program: Program) -> None:
    written = {id(b): b for kernel in program.kernels() for b in kernel.writes()}
    reuses = [(written[k], buffer) for k, buffer in program.reuses.items()]
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, graph).dump((dataclasses.replace(program, reuses={}), reuses))
        artifact.write_entries(_path(file_key), [(buffer.getvalue(), b"")])
    except Exception as error:  # (an unpicklable attribute, a read-only cache: runs on)
        _log.info("program of %s not stored: %s: %s", graph.name, type(error).__name__, error)


def load_generated(file_key: str) -> dict[Any, Any]:
    """The code generated for the program stored under ``file_key`` (``kernels.Memo``): only
    asked for when that program itself came from the disk, so its kernels are the ones the
    code was generated from."""
    for data, _ in artifact.read_entries(_path(file_key, "g")):
        with contextlib.suppress(Exception):
            memo: dict[Any, Any] = pickle.loads(data)
            return memo
    return {}


def store_generated(file_key: str, memo: dict[Any, Any]) -> None:
    try:
        data = pickle.dumps(memo, protocol=pickle.HIGHEST_PROTOCOL)
        artifact.write_entries(_path(file_key, "g"), [(data, b"")])
    except Exception as error:  # (a read-only cache: the next process generates again)
        _log.info("generated code not stored: %s: %s", type(error).__name__, error)


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, graph: Graph) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.nodes = {id(node): i for i, node in enumerate(graph.nodes)}
        self.values = {id(value): i for i, value in enumerate(_values(graph))}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Node) and id(obj) in self.nodes:
            return ("node", self.nodes[id(obj)])
        if isinstance(obj, Value) and id(obj) in self.values:
            return ("value", self.values[id(obj)])
        if isinstance(obj, Symbol):  # (hinted by the sizes of the process that reads it)
            return ("symbol", obj.name, obj.low, obj.high)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, graph: Graph, sizes: dict[str, int] | None = None) -> None:
        super().__init__(file)
        self.graph = graph
        self.sizes = sizes or {}

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "symbol":
            _, name, low, high = pid
            return Symbol(name, self.sizes[name], low, high)
        kind, position = pid
        if kind == "node":
            return self.graph.nodes[position]
        if kind == "value":
            return _values(self.graph)[position]
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def _values(graph: Graph) -> list[Value]:
    return [*graph.inputs, *(value for node in graph.nodes for value in node.outputs)]
