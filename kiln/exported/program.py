"""An exported program: one graph, its weights as data and its input spec, run by Kiln's
pipeline; saved to and loaded from one file (``kiln/exported/file.py``).

::

    prog = kiln.export(model, (x,))   # kiln/exported/tracing.py
    print(prog)                       # the input spec, weights, outputs and the graph as Python
    prog(x2)                          # checked against the spec, then compiled code
    prog.save("model.kiln")
    kiln.load("model.kiln")(x2)       # in a process that cannot import the model's source

A call is checked (structure, dtypes, devices, static sizes, each symbol's range and the
relations tracing decided), then runs through :class:`~kiln.pipeline.Pipeline` like a graph
of ``kiln.compile``: the first call per size schedules, generates and builds kernels; the
kernel cache entries it used are remembered, so :meth:`ExportedProgram.save` can bundle them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
from torch.utils import _pytree as pytree

from kiln.errors import KilnError
from kiln.exported.file import ExportFileError, read_archive, seed_cache, write_archive
from kiln.exported.graph_format import (
    Decoder,
    Encoder,
    decode_graph,
    encode_graph,
    encode_symbols,
)
from kiln.frontends.trace import rebuild_outputs
from kiln.ir.graph import Graph, InputKind, Value
from kiln.ir.symbolic import Relation, Sym, Symbol
from kiln.ir.verify import verify
from kiln.options import Options
from kiln.pipeline import Pipeline
from kiln.recording import recording
from kiln.runtime.kernel_files import KernelFiles


class ExportError(KilnError):
    """The program cannot be exported, or a call does not fit the exported input spec."""


@dataclass(eq=False)
class ExportedProgram:
    """A graph plus its weights and input spec; called like the original (see module doc)."""

    graph: Graph
    weights: dict[str, torch.Tensor]
    in_spec: pytree.TreeSpec
    leaves: list[int | tuple[str, Any]]  # per argument leaf: a USER input's index, or a constant
    relations: tuple[Relation, ...] = ()

    def __post_init__(self) -> None:
        self.user = [v for v in self.graph.inputs if v.kind is InputKind.USER]
        self.kernel_files: dict[str, str] = {}  # archive name -> file (kiln/exported/file.py)
        self._compiled: Any = None
        self._sizes_seen: set[tuple[int, ...]] = set()
        # Per graph input: the tensor held (a weight), or None for a user input; seeds drawn.
        self._held = [self.weights.get(v.name) for v in self.graph.inputs]
        self._seeds = [i for i, v in enumerate(self.graph.inputs) if v.kind is InputKind.RNG_SEED]
        for i in self._seeds:
            self._held[i] = torch.empty((), dtype=torch.int64)
        # The fast path: a call of plain tensor arguments, and static types to compare with.
        count = len(self.leaves)
        plain = pytree.tree_flatten((tuple(range(count)), {}))[1]
        self._plain = self.in_spec == plain and self.leaves == list(range(count))
        self._static = [
            None if v.type.is_symbolic else (v.type.shape, v.type.dtype, v.type.device)
            for v in self.user
        ]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors, sizes = self.check(args, kwargs)
        feed = iter(tensors)
        inputs = [next(feed) if held is None else held for held in self._held]
        for i in self._seeds:
            inputs[i] = torch.randint(0, 2**62, (), dtype=torch.int64)
        key = tuple(sizes[name] for name in self.graph.symbols)
        with torch.no_grad():
            results = (
                self._run(inputs, key) if key in self._sizes_seen else self._first(inputs, key)
            )
            mutated = results[len(self.graph.outputs) :]
            for (target, _), new in zip(self.graph.mutations, mutated, strict=True):
                inputs[self.graph.inputs.index(target)].copy_(new)
        return rebuild_outputs(self.graph, results)

    def _run(self, inputs: list[torch.Tensor], key: tuple[int, ...]) -> list[torch.Tensor]:
        return self._compiled(inputs, key) if self.graph.symbols else self._compiled(inputs)

    def _first(self, inputs: list[torch.Tensor], key: tuple[int, ...]) -> list[torch.Tensor]:
        """The first run at these sizes, which compiles: the kernel cache entries it uses are
        remembered for :meth:`save`."""
        if self._compiled is None:
            _, self._compiled = Pipeline(Options())(self.graph)
        with recording(KernelFiles) as used:
            results = self._run(inputs, key)
        self._sizes_seen.add(key)
        for entry in used:
            for path in entry.paths:
                self.kernel_files[f"kernels/{entry.kind}/{os.path.basename(path)}"] = path
        return results

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict]:
        """The tensors of the graph's user inputs and the symbols' values of a call; an
        :class:`ExportError` saying what differs when the call does not fit the spec."""
        plain = self._plain and not kwargs and len(args) == len(self.leaves)
        leaves, spec = (args, self.in_spec) if plain else pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            want, got = _arguments(self.in_spec), _arguments(spec)
            detail = f"got {got}" if got != want else f"nested as {spec}, not {self.in_spec}"
            raise ExportError(f"the program takes {want}: {detail}")
        tensors: list[Any] = [None] * len(self.user)
        for leaf, slot in zip(leaves, self.leaves, strict=True):
            if not isinstance(slot, int):
                if isinstance(leaf, torch.Tensor) or leaf != slot[1]:
                    raise ExportError(f"argument {leaf!r:.60} is not the exported {slot[1]!r}")
            elif tensors[slot] is None:
                tensors[slot] = leaf
            elif tensors[slot] is not leaf:
                raise ExportError(f"{self.user[slot].name} was one tensor passed twice at export")
        sizes: dict[str, int] = {}
        for value, tensor, static in zip(self.user, tensors, self._static, strict=True):
            # (one tuple compare for a static input; any mismatch is described by the slow path)
            same = isinstance(tensor, torch.Tensor) and static == (
                tensor.shape,
                tensor.dtype,
                tensor.device,
            )
            if not same:
                _check_tensor(value, tensor, sizes)
        for relation in self.relations:
            if not relation.holds(sizes):
                raise ExportError(f"sizes {sizes} break {relation.text()} ({relation.why})")
        return tensors, sizes

    def __str__(self) -> str:
        lines = [f"ExportedProgram {self.graph.name}: inputs"]
        for value in self.user:
            lines.append(f"  {value.name}: {value.type}  ({value.source})")
        symbols = {s.name: s for v in self.user for d in v.type.shape for s in _symbols(d)}
        for name, symbol in symbols.items():
            lines.append(f"  {name} in [{symbol.low}, {symbol.high or 'inf'}]")
        lines += [f"  {relation.text()}  ({relation.why})" for relation in self.relations]
        lines.append(f"weights: {len(self.weights)} tensors")
        lines += [
            f"  {v.name}: {v.type}  ({v.source})" for v in self.graph.inputs if v not in self.user
        ]
        names = ", ".join(value.name for value in self.graph.outputs)
        lines.append(f"outputs: {names}  (returned as {self.graph.output_spec[0]})")
        return "\n".join(lines) + "\n\n" + str(self.graph)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the program to one file (``docs/export-format.md``); :func:`load` reads it."""
        encoder = Encoder()
        spec, plan = self.graph.output_spec
        data = {
            "graph": encode_graph(self.graph, encoder),
            "in_spec": pytree.treespec_dumps(self.in_spec),
            "leaves": [s if isinstance(s, int) else encoder.value(s) for s in self.leaves],
            "out_spec": pytree.treespec_dumps(spec),
            "out_plan": [s if isinstance(s, int) else encoder.value(s) for s in plan],
            "relations": [encoder.relation(relation) for relation in self.relations],
        }
        data["symbols"] = encode_symbols(encoder)
        weights = {name: t.detach().contiguous().clone() for name, t in self.weights.items()}
        members = {
            "graph.json": json.dumps(data).encode(),
            "weights.safetensors": safetensors.torch.save(weights),
            "program.txt": str(self).encode(),
        }
        for name, file in sorted(self.kernel_files.items()):
            if os.path.exists(file):
                with open(file, "rb") as handle:
                    members[name] = handle.read()
        write_archive(path, members)


def load(path: str | os.PathLike[str]) -> ExportedProgram:
    """The program :meth:`ExportedProgram.save` wrote to ``path``; its kernels go into the
    kernel cache (``kiln/exported/file.py``). A damaged file, or one of another format version,
    raises :class:`~kiln.exported.file.ExportFileError`."""
    members = read_archive(path)
    try:
        data = json.loads(members["graph.json"])
        decoder = Decoder(data["symbols"])
        weights = safetensors.torch.load(members["weights.safetensors"])
        graph = decode_graph(data["graph"], decoder)
        for value in graph.inputs:  # (safetensors loads to the CPU: weights go to their device)
            if value.name in weights:
                weights[value.name] = weights[value.name].to(value.type.device)
        constants = [v.name for v in graph.inputs if v.kind is InputKind.CONSTANT]
        graph.constants = {name: weights[name] for name in constants}
        verify(graph)
        plan = [s if isinstance(s, int) else decoder.value(s) for s in data["out_plan"]]
        _import_containers(data["out_spec"])
        graph.output_spec = (pytree.treespec_loads(data["out_spec"]), plan)
        leaves = [s if isinstance(s, int) else decoder.value(s) for s in data["leaves"]]
        relations = tuple(decoder.relation(item) for item in data["relations"])
        program = ExportedProgram(
            graph, weights, pytree.treespec_loads(data["in_spec"]), leaves, relations
        )
    except Exception as error:  # (any damage the CRC did not catch, or a foreign file)
        raise ExportFileError(f"{path}: the saved program does not read back: {error!r}") from error
    program.kernel_files = seed_cache(members)  # (saving the loaded program keeps them)
    return program


def _import_containers(spec: str) -> None:
    """Import the modules that define the containers a tree spec names (a library's output
    classes, such as transformers' ``BaseModelOutput``), which register them with pytree."""
    for match in re.finditer(r'"type": "([\w.]+)\.\w+"', spec):
        with contextlib.suppress(ImportError):
            importlib.import_module(match.group(1))


def _arguments(spec: pytree.TreeSpec) -> str:
    """What a call's ``(args, kwargs)`` tree spec holds, in words."""
    positional, keywords = spec.children()
    return f"{positional.num_children} positional arguments, keywords {list(keywords.context)}"


def _symbols(dim: Any) -> list[Symbol]:
    return sorted(dim.symbols(), key=lambda s: s.name) if isinstance(dim, Sym) else []


def _check_tensor(value: Value, tensor: Any, sizes: dict[str, int]) -> None:
    """Whether ``tensor`` fits ``value``'s type, binding its symbols' sizes into ``sizes``."""
    kind = value.type
    if not isinstance(tensor, torch.Tensor):
        raise ExportError(f"input {value.name} must be a tensor of {kind}, got {type(tensor)}")
    problem = ""
    if tensor.dtype != kind.dtype or tensor.device.type != kind.device.type:
        problem = "its dtype or device differs"
    elif tensor.dim() != kind.rank:
        problem = f"it has {tensor.dim()} dims, not {kind.rank}"
    else:
        for dim, (want, size) in enumerate(zip(kind.shape, tensor.shape, strict=True)):
            problem = problem or _dim_problem(dim, want, size, sizes)
    if problem:
        got = f"{tensor.dtype}{list(tensor.shape)} on {tensor.device}"
        raise ExportError(f"input {value.name} ({value.source}) is {got}, not {kind}: {problem}")


def _dim_problem(dim: int, want: Any, size: int, sizes: dict[str, int]) -> str:
    if not isinstance(want, Sym):
        return f"dim {dim} is {size}, not {want}" if size != want else ""
    (symbol,) = _symbols(want)
    bound = sizes.setdefault(symbol.name, size)
    if bound != size:
        return f"dim {dim} ({symbol.name}) is {size} here but {bound} in another input"
    if size < symbol.low or (symbol.high is not None and size > symbol.high):
        return (
            f"dim {dim} ({symbol.name}) is {size}, outside [{symbol.low}, {symbol.high or 'inf'}]"
        )
    return ""
