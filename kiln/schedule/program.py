"""A scheduled graph: the ordered steps a code generator turns into a host program.

A :class:`Program` lists kernels and extern calls in execution order, the graph's inputs as
buffers, and the outputs as :class:`View`\\ s of buffers (an output that is a view of an input or
of another output stays a view, as in eager). The buffer plan says, for each temporary buffer,
whether it takes over the memory of a buffer that died earlier (``reuses``) and after which
step each buffer dies, so peak memory stays at or below eager's.

Kernel calling convention (both code generators): a kernel's arguments are the data pointers
of :func:`kernel_arguments` in that order, then, when the kernel draws random numbers, the
int64 seed (a scalar in C++, a pointer to it in Triton), then the values of the symbolic
sizes the kernel is written in (:func:`~kiln.schedule.loops.kernel_symbols`, in that order;
the host program computes them from its inputs). Other shapes, strides and offsets are
compile-time constants of the kernel's index expressions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.ir.graph import Node
from kiln.ir.symbolic import Dim
from kiln.ir.types import Scalar
from kiln.schedule.loops import Buffer, Kernel


@dataclass(eq=False)
class View:
    """``torch.as_strided(buffer, shape, strides, offset)``; ``is_whole`` when it is the buffer
    itself (no view needed)."""

    buffer: Buffer
    shape: tuple[Dim, ...]
    strides: tuple[Dim, ...]
    offset: Dim

    @property
    def is_whole(self) -> bool:
        buffer = self.buffer
        return (self.shape, self.strides, self.offset) == (
            buffer.shape,
            buffer.strides,
            buffer.offset,
        )


Operand = View | Scalar | None


@dataclass(eq=False)
class ExternCall:
    """A graph node run by PyTorch (matmul, convolution, attention, sort, ...): its registry
    row's reference implementation applied to views of buffers."""

    node: Node
    operands: tuple[Operand, ...]
    outputs: tuple[Buffer, ...]
    reason: str = ""  # why a non-extern op runs here (the codegen does not handle it)
    # An index_put into the graph input it mutates or a temporary only it reads, in place (no
    # copy of the operand, no write-back): its result is operand 0 itself
    # (Scheduler._writes_in_place).
    in_place: bool = False


Step = Kernel | ExternCall


@dataclass(eq=False)
class Program:
    name: str
    inputs: list[Buffer]
    steps: list[Step]
    outputs: list[View]
    reuses: dict[int, Buffer] = field(default_factory=dict)  # id(temp) -> buffer it takes over
    dead_after: list[list[Buffer]] = field(default_factory=list)  # per step: buffers freed

    def kernels(self) -> list[Kernel]:
        return [step for step in self.steps if isinstance(step, Kernel)]

    def externs(self) -> list[ExternCall]:
        return [step for step in self.steps if isinstance(step, ExternCall)]


def kernel_arguments(kernel: Kernel) -> list[Buffer]:
    """The buffers a kernel takes, in argument order: stored buffers first, then read-only
    ones, each once, in order of first appearance."""
    written = kernel.writes()
    read_only = [b for b in kernel.reads() if all(b is not w for w in written)]
    return [*written, *read_only]
