"""The host program: Python source that runs a scheduled graph's steps in order.

For a :class:`~kiln.schedule.program.Program` it prints one function ``run(inputs)`` that
allocates buffers (or takes over dead ones: the buffer plan), launches each kernel with its
buffers, calls each extern through PyTorch, frees buffers after their last use and returns the
outputs (views of buffers, as eager returns views)::

    def run(inputs):
        x, w, b = inputs
        mm_1, = extern_0(x, as_strided(w, (64, 32), (1, 64), w.storage_offset()))
        buf_2 = empty_strided((8, 32), (32, 1), dtype=torch.float32, device=device)
        k1_add_relu(buf_2, mm_1, b)
        del mm_1
        return [buf_2]

A kernel that draws random numbers also gets the graph's seed (an int64 input, a 0-d CPU
tensor drawn per call): C++ kernels as an int (``seed = int(in_seed)``), Triton kernels as a
tensor on their device, which they load (``seed_cuda_0 = in_seed.to('cuda:0',
non_blocking=True)``, the input itself when already there): a CUDA graph bakes scalar
arguments in, so its runner refreshes a device seed in place before each replay instead.

The source is readable and dumped to the debug directory with the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import linecache
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.code_cache import compiled as compiled_code
from kiln.codegen import temp_pool
from kiln.ir.graph import Donated
from kiln.ir.op import Op, op_def
from kiln.ir.specialize import mentions_symbols, sized_node, substitute_deep
from kiln.ir.symbolic import Dim, bounded, is_symbolic, substitute
from kiln.ops.externs import extern_runner
from kiln.ops.host_calls import host_call, operand_types
from kiln.ops.indexing import index_put_in_place
from kiln.schedule.buffers import step_reads, step_writes
from kiln.schedule.loops import Buffer, BufferKind, Kernel, kernel_symbols
from kiln.schedule.program import ExternCall, Program, View, kernel_arguments

Launcher = Callable[..., Any]
# (graph node, each result's actual (shape, strides))
LayoutReport = Callable[[Any, Sequence[tuple[tuple[int, ...], tuple[int, ...]]]], None]
_serial = itertools.count()


class Wrapper:
    """Prints the host program of ``program``; ``launchers`` maps kernel names to callables
    taking tensors in kernel-argument order (and the seed when the kernel draws numbers: an
    int, or an int64 tensor on the kernel's device where the launcher has a true
    ``seed_as_tensor``; without a launcher, a tensor on CUDA)."""

    def __init__(
        self,
        program: Program,
        launchers: dict[str, Launcher],
        on_layout: LayoutReport | None = None,
        cpu_matmul: str = "auto",
        sizes: Sequence[tuple[str, tuple[int, int]]] = (),
        paired: dict[int, Launcher] | None = None,
        operands: dict[int, Sequence[View]] | None = None,
    ) -> None:
        self.program = program
        # max-autotune's matmul templates (kiln/backends/templates.py): the function of a
        # paired extern's step (by id), and the product's operands its kernel also takes
        self.paired = paired or {}
        self.operands = operands or {}
        self.sizes = sizes  # symbol -> (input, dim) it is read from, for a program with symbols
        self.on_layout = on_layout
        self.cpu_matmul = cpu_matmul  # the library of float32 CPU matmuls (Options.cpu_matmul)
        self.namespace: dict[str, Any] = {
            "torch": torch,
            "empty_strided": torch.empty_strided,
            "as_strided": torch.as_strided,
            "Donated": Donated,
        }
        self.namespace.update(launchers)
        self.launchers = launchers
        self.seeds: dict[str, str] = {}  # kernel name -> the host name of its seed argument
        self.names: dict[int, str] = {}
        self.lines: list[str] = []
        self.slots: dict[int, int] = {}  # id(buffer) -> its place in the pooled temporaries
        self.in_place: set[int] = set()  # buffers a kernel writes over in place (its last reader)
        # Line of the host program (1-based) -> the step it runs and the user lines behind it,
        # for errors raised there (an out-of-memory allocation, a failing extern).
        self.steps: dict[int, str] = {}

    def name(self, buffer: Buffer) -> str:
        if id(buffer) not in self.names:
            base = "".join(c if c.isalnum() else "_" for c in buffer.name)
            prefix = {BufferKind.INPUT: "in_", BufferKind.TEMP: "buf_", BufferKind.EXTERN: "ext_"}
            self.names[id(buffer)] = f"{prefix[buffer.kind]}{base}"
        return self.names[id(buffer)]

    def view(self, view: View) -> str:
        name = self.name(view.buffer)
        if view.is_whole:
            return name
        if not view.offset:  # as_strided keeps the base's storage offset: 0.2 us less a view
            return f"as_strided({name}, {view.shape!r}, {view.strides!r})"
        offset = f"{name}.storage_offset() + {view.offset!r}"
        return f"as_strided({name}, {view.shape!r}, {view.strides!r}, {offset})"

    def source(self) -> str:
        program = self.program
        self.lines = ["def run(inputs):"]
        self.steps = {}
        names = [self.name(b) for b in program.inputs]
        if names:
            self.lines.append(f"    {', '.join(names)}{',' if len(names) == 1 else ''} = inputs")
        released = self._last_reads()
        if released:  # (a runner that recorded the inputs' copies lets their memory be reused)
            self.lines.append("    if inputs.__class__ is Donated: inputs.clear()")
        for symbol, (position, dim) in self.sizes:  # (the sizes the steps below are written in)
            self.lines.append(f"    {symbol} = {names[position]}.shape[{dim}]")
        if self.sizes and any(_mentions_symbols(call) for call in program.externs()):
            self.lines.append(f"    sizes = ({''.join(f'{n}, ' for n, _ in self.sizes)})")
        self._seeds()
        pooled = temp_pool.pooled_allocations(program)  # kept from call to call (CPU)
        self.slots = {id(b): number for number, b in enumerate(pooled)}
        if pooled:
            slots = [temp_pool.Slot(_ints(b.shape), _ints(b.strides), b.dtype) for b in pooled]
            self.namespace["pool"] = temp_pool.TempPool(slots)
            self.lines.append("    temps = pool.take()")
        self._release(released, -1)  # (inputs no step reads: after the sizes and seeds)
        # Freed when taken over instead (one taken over in place is read by that kernel: it
        # goes after it, as usual).
        self.in_place = self._in_place()
        reused = {id(b) for b in program.reuses.values()} - self.in_place
        # Buffers read as tensors (extern operands, outputs): the rest only lend kernels their
        # data pointer, so one that takes over another's memory is that tensor, not a view
        # of it (torch.as_strided costs 2-3 us a call: 300 a ResNet-like step)
        self.as_tensors = {id(v.buffer) for v in program.outputs} | {
            id(o.buffer) for step in program.externs() for o in step.operands if isinstance(o, View)
        }
        for position, step in enumerate(program.steps):
            if isinstance(step, Kernel):
                self._kernel(step)
            else:
                self._extern(step, position)
            dead = [self.name(b) for b in program.dead_after[position] if id(b) not in reused]
            if dead:
                self.lines.append(f"    del {', '.join(dead)}")
            self._release(released, position)
        outputs = ", ".join(self.view(v) for v in program.outputs)
        if pooled:
            self.lines.append("    pool.give(temps)")
        self.lines.append(f"    return [{outputs}]")
        return "\n".join(self.lines) + "\n"

    def _last_reads(self) -> dict[int, list[str]]:
        """The inputs by the step that uses them last (-1: none does), but those an output
        views: their names are dropped there, so that a :class:`~kiln.ir.graph.Donated` input
        is freed while the program runs."""
        program = self.program
        viewed = {id(view.buffer) for view in program.outputs}
        last = {id(b): -1 for b in program.inputs if id(b) not in viewed}
        for position, step in enumerate(program.steps):
            used = [*step_reads(step), *step_writes(step)]
            used += [view.buffer for view in self.operands.get(id(step), ())]  # (a template's)
            if isinstance(step, Kernel) and (seed := step.seed()) is not None:
                used.append(seed)
            for buffer in used:
                if id(buffer) in last:
                    last[id(buffer)] = position
        released: dict[int, list[str]] = {}
        for buffer in program.inputs:
            if id(buffer) in last:
                released.setdefault(last.pop(id(buffer)), []).append(self.name(buffer))
        return released

    def _release(self, released: dict[int, list[str]], position: int) -> None:
        if position in released:
            self.lines.append(f"    del {', '.join(released[position])}")

    def _in_place(self) -> set[int]:
        """The buffers a kernel writes over in place (``schedule/buffers.py``)."""
        return {
            id(previous)
            for kernel in self.program.kernels()
            for buffer in kernel.writes()
            if (previous := self.program.reuses.get(id(buffer))) is not None
            and any(read is previous for read in kernel.reads())
        }

    def _seeds(self) -> None:
        """Once per call, the seed in each form a kernel takes: ``seed = int(in_seed)``, or
        ``seed_cuda_0 = in_seed.to('cuda:0', non_blocking=True)`` (no copy when already
        there), named in ``self.seeds``."""
        self.seeds = {}
        made: dict[tuple[int, str], str] = {}  # (seed buffer, device or "int") -> its name
        for kernel in self.program.kernels():
            buffer = kernel.seed()
            if buffer is None:
                continue
            default = kernel.device.type == "cuda"
            as_tensor = getattr(self.launchers.get(kernel.name), "seed_as_tensor", default)
            form = str(kernel.device) if as_tensor else "int"
            if (id(buffer), form) not in made:
                name = "seed" if form == "int" else "seed_" + re.sub(r"\W", "_", form)
                if name in made.values():  # (one seed input per graph: never, in practice)
                    name = f"{name}_{len(made)}"
                made[id(buffer), form] = name
                value = self.name(buffer)
                copy = f"{value}.to({form!r}, non_blocking=True)"
                self.lines.append(f"    {name} = {f'int({value})' if form == 'int' else copy}")
            self.seeds[kernel.name] = made[id(buffer), form]

    def _mark(self, first: int, step: str) -> None:
        """Lines ``first`` to the last one printed run ``step``."""
        for number in range(first + 1, len(self.lines) + 1):
            self.steps[number] = step

    def _kernel(self, kernel: Kernel) -> None:
        first = len(self.lines)
        self._emit_kernel(kernel)
        places = list(dict.fromkeys(f.split("  ", 1)[-1] for f in kernel.fused))
        self._mark(first, f"kernel {kernel.name} ({'; '.join(places[:6])})")

    def _emit_kernel(self, kernel: Kernel) -> None:
        for buffer in kernel.writes():
            if buffer.kind is BufferKind.INPUT:
                continue  # a mutated input written in place
            previous = self.program.reuses.get(id(buffer))
            if previous is not None:
                old = self.name(previous)
                view = f"as_strided({old}, {buffer.shape!r}, {buffer.strides!r})"
                if id(buffer) not in self.as_tensors:
                    view = old  # (the kernel indexes its memory by its own strides)
                if id(previous) in self.in_place:
                    self.lines.append(f"    {self.name(buffer)} = {view}  # in place of {old}")
                else:
                    self.lines.append(f"    {self.name(buffer)} = {view}; del {old}  # reuse")
            elif id(buffer) in self.slots:
                self.lines.append(f"    {self.name(buffer)} = temps[{self.slots[id(buffer)]}]")
            else:
                self.lines.append(
                    f"    {self.name(buffer)} = empty_strided({buffer.shape!r}, "
                    f"{buffer.strides!r}, dtype={buffer.dtype}, device={str(buffer.device)!r})"
                )
        if kernel.xnumel == 0:
            return  # nothing to compute: the outputs are empty
        arguments = [self.name(b) for b in kernel_arguments(kernel)]
        arguments += [self.view(v) for v in self.operands.get(id(kernel), ())]
        if kernel.seed() is not None:
            arguments.append(self.seeds[kernel.name])
        arguments += [symbol.name for symbol in kernel_symbols(kernel)]  # (bound above)
        self.lines.append(f"    {kernel.name}({', '.join(arguments)})")

    def _extern(self, call: ExternCall, position: int) -> None:
        function = f"extern_{position}"
        operands = ", ".join(
            self.view(o) if isinstance(o, View) else repr(o) for o in call.operands
        )
        if self.sizes and _mentions_symbols(call):
            symbols = [name for name, _ in self.sizes]
            self.namespace[function] = sized_extern(call, self.on_layout, self.cpu_matmul, symbols)
            operands = f"sizes, {operands}"
        elif id(call) in self.paired:
            self.namespace[function] = self.paired[id(call)]
        else:
            self.namespace[function] = extern_function(call, self.on_layout, self.cpu_matmul)
        results = ", ".join(self.name(b) for b in call.outputs)
        comment = f"  # {call.node.op.printed_name}  {call.node.origin}".rstrip()
        self.lines.append(f"    {results}, = {function}({operands}){comment}")
        origin = call.node.origin
        where = f"{origin.api} at {origin.file}:{origin.line}" if origin.file else origin.api
        self._mark(len(self.lines) - 1, f"{call.node.op.printed_name} ({where})")

    def compile(self) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
        self.text = self.source()  # (as the debug directory shows it)
        source = _noting_errors(self.text)
        filename = f"<kiln wrapper {self.program.name} {next(_serial)}>"
        # Tracebacks and memory snapshots show the host program's lines, not just numbers.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        code = compiled_code(source, filename)
        # The try of _noting_errors moves every body line one down.
        steps = {number + 1: step for number, step in self.steps.items()}
        self.namespace["note_error"] = functools.partial(
            note_error, filename=filename, steps=steps, graph=self.program.name
        )
        exec(code, self.namespace)
        run: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]] = self.namespace["run"]
        return run


def _noting_errors(source: str) -> str:
    """``run``'s body inside ``try``: an error on the way out gets a note naming the step
    and the user's source lines (no cost while nothing is raised)."""
    head, *body = source.rstrip("\n").split("\n")
    inner = [f"    {line}" for line in body]
    handler = ["    except BaseException as error:", "        note_error(error)", "        raise"]
    return "\n".join([head, "    try:", *inner, *handler]) + "\n"


def note_error(error: BaseException, *, filename: str, steps: dict[int, str], graph: str) -> None:
    """Add to ``error`` which step of graph ``graph``'s host program raised it."""
    traceback = error.__traceback__
    line = None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == filename:
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    step = steps.get(line) if line is not None else None
    if step is not None:
        error.add_note(f"kiln: raised by {step} in compiled graph {graph}")


def extern_function(
    call: ExternCall, on_layout: LayoutReport | None = None, cpu_matmul: str = "auto"
) -> Callable[..., list[torch.Tensor]]:
    """Runs the node's reference implementation and lays its results out as the kernels that
    read them expect: when PyTorch chose other strides than the schedule assumed, a copy, and
    ``on_layout(node, layouts)`` (each result's shape and strides) so the next compilation
    assumes what PyTorch does."""
    attrs = call.node.attrs
    if call.node.op is Op.EXTERN:
        bound = extern_runner(attrs)
    elif call.in_place:  # (its result is operand 0, laid out as it is)
        bound = functools.partial(index_put_in_place, attrs)
    else:
        row = functools.partial(op_def(call.node.op).impl, attrs)
        bound = host_call(call.node.op, attrs, operand_types(call.node), cpu_matmul) or row
    layouts = [(b.shape, b.strides) for b in call.outputs]

    def run(*operands: Any) -> list[torch.Tensor]:
        return laid_out(bound(*operands))

    def laid_out(result: Any) -> list[torch.Tensor]:
        results = result if isinstance(result, tuple) else (result,)
        if all(_same_layout(t, *layout) for t, layout in zip(results, layouts, strict=True)):
            return list(results)
        if on_layout is not None:
            on_layout(call.node, [(tuple(t.shape), tuple(t.stride())) for t in results])
        return [
            t if _same_layout(t, shape, strides) else _restride(t, shape, strides)
            for t, (shape, strides) in zip(results, layouts, strict=True)
        ]

    if len(layouts) != 1:
        return run
    (only_shape, only_strides) = layouts[0]

    def run_one(*operands: Any) -> list[torch.Tensor]:
        # one output, laid out as predicted (the common case): two tuple comparisons
        result = bound(*operands)
        if not isinstance(result, torch.Tensor):
            return laid_out(result)
        if result.stride() == only_strides and result.shape == only_shape:
            return [result]
        return laid_out(result)

    return run_one


def _ints(sizes: tuple[Dim, ...]) -> tuple[int, ...]:
    """Sizes known to be ints here (a program's symbolic ones are substituted before)."""
    return tuple(int(n) for n in sizes)


def _mentions_symbols(call: ExternCall) -> bool:
    buffers = [(b.shape, b.strides, b.offset) for b in call.outputs]
    return mentions_symbols(call.node) or any(is_symbolic(n) for b in buffers for n in flat(b))


def flat(items: tuple[Any, ...]) -> list[Any]:
    return [x for item in items for x in (item if isinstance(item, tuple) else (item,))]


def sized_extern(
    call: ExternCall, on_layout: LayoutReport | None, cpu_matmul: str, symbols: Sequence[str]
) -> Callable[..., list[torch.Tensor]]:
    """:func:`extern_function` of an extern whose attributes or result layouts are written in
    the program's symbols: made per distinct ``sizes`` (their values, in ``symbols`` order),
    which the host program passes first."""
    made: dict[tuple[int, ...], Callable[..., list[torch.Tensor]]] = {}

    def run(sizes: tuple[int, ...], *operands: Any) -> list[torch.Tensor]:
        function = made.get(sizes)
        if function is None:
            values = dict(zip(symbols, sizes, strict=True))
            outputs = tuple(
                dataclasses.replace(
                    b,
                    shape=substitute(b.shape, values),
                    strides=substitute(b.strides, values),
                    offset=substitute(b.offset, values),
                )
                for b in call.outputs
            )
            node = call.node
            if node.op in (Op.MM, Op.ADDMM):  # (host_call picks their library by the types)
                node = sized_node(node, values)
            else:  # (the attributes are all the call reads: cheaper, once per new size)
                node = dataclasses.replace(node, attrs=substitute_deep(node.attrs, values))
            sized = dataclasses.replace(call, node=node, outputs=outputs)
            function = bounded(made)[sizes] = extern_function(sized, on_layout, cpu_matmul)
        return function(*operands)

    return run


def _same_layout(tensor: torch.Tensor, shape: tuple[Dim, ...], strides: tuple[Dim, ...]) -> bool:
    if tuple(tensor.shape) != shape:
        return False
    actual = tensor.stride()
    return all(size == 1 or a == s for size, a, s in zip(shape, actual, strides, strict=True))


def _restride(
    tensor: torch.Tensor, shape: tuple[Dim, ...], strides: tuple[Dim, ...]
) -> torch.Tensor:
    out = torch.empty_strided(
        _ints(shape), _ints(strides), dtype=tensor.dtype, device=tensor.device
    )
    return out.copy_(tensor)
