"""Launching independent kernels together: a kernel joins the kernel before it as one of its
``parts`` when neither reads what the other writes.

Each launch costs host time (a Triton launch about 6-10 us on the H100 hosts, more than many
small kernels run), so a program whose GPU work is shorter than its host work runs at the
speed of its launches. Under autocast every convolution and matmul weight is cast to 16 bits
by its own small kernel, scheduled just before the extern that reads it, and so right after
the previous extern's epilogue kernel, which it does not depend on: ResNet-50's inference
program launched 53 such casts a call beside 53 epilogues. Combined, the two run in one
launch: the programs of the first kernel, then those of its parts (``kiln/codegen/triton.py``),
or one loop after the other in C++.

A kernel joins the one before it when:

- the two are adjacent steps on the same device, and neither draws random numbers;
- neither reads a buffer the other writes, and they write different buffers;
- the joining kernel is pointwise: what it reads was written before the first of the two
  (a ReLU recomputed for a convolution's weight gradient, from the saved input and the
  per-channel factors, beside the BatchNorm backward before it).

A pointwise kernel that reads only graph inputs (weights, parameters) and finds no kernel just
before it (it follows an extern, or starts the program: a BatchNorm's ``num_batches_tracked
+= 1`` in training) joins a later kernel's launch instead, when no step between them reads
what it writes or writes what it reads: it then runs after that kernel's own programs.
"""

from __future__ import annotations

from kiln.schedule.loops import BufferKind, Kernel, KernelKind
from kiln.schedule.program import Step, View

MAX_PARTS = 8  # kernels a launch combines at most (each part adds a branch to the kernel)


def combine_kernels(steps: list[Step]) -> list[Step]:
    """``steps`` with each kernel that can run in the launch of the kernel before it moved
    into that kernel's ``parts`` (in place)."""
    combined: list[Step] = []
    movable: list[Kernel] = []  # input-only kernels on their own, free to run later
    for step in steps:
        head = combined[-1] if combined else None
        if isinstance(head, Kernel) and isinstance(step, Kernel) and joins(head, step):
            head.parts.append(step)
            head.fused += step.fused
            continue
        if isinstance(step, Kernel):
            for early in [k for k in movable if joins(step, k)]:
                combined.remove(early)
                movable.remove(early)
                step.parts.append(early)
                step.fused += early.fused
        movable = [k for k in movable if not _conflicts(step, k)]
        combined.append(step)
        if isinstance(step, Kernel) and all(b.kind is BufferKind.INPUT for b in step.reads()):
            movable.append(step)  # (joins() checks the rest)
    return combined


def _conflicts(step: Step, kernel: Kernel) -> bool:
    """Whether ``kernel`` must stay before ``step``: ``step`` reads what it writes, or writes
    what it reads or writes."""
    if isinstance(step, Kernel):
        reads, writes = step.reads(), step.writes()
    else:
        reads, writes = [o.buffer for o in step.operands if isinstance(o, View)], [*step.outputs]
    written = {id(b) for b in kernel.writes()}
    touched = written | {id(b) for b in kernel.reads()}
    return any(id(b) in written for b in reads) or any(id(b) in touched for b in writes)


def joins(head: Kernel, kernel: Kernel) -> bool:
    """Whether ``kernel`` can run in ``head``'s launch (see the module docstring)."""
    if head.device != kernel.device or len(head.parts) >= MAX_PARTS or kernel.parts:
        return False
    if head.xnumel == 0 or kernel.xnumel == 0 or kernel.kind is not KernelKind.POINTWISE:
        return False
    if head.seed() is not None or kernel.seed() is not None:
        return False
    head_writes = {id(b) for b in head.writes()}
    kernel_writes = {id(b) for b in kernel.writes()}
    if head_writes & kernel_writes or any(id(b) in kernel_writes for b in head.reads()):
        return False
    return not any(id(b) in head_writes for b in kernel.reads())
