"""CPU temporaries kept from one call of a host program to the next.

PyTorch's CPU allocator is glibc's ``malloc``: a buffer above its mmap threshold (128 KiB, or
what it has grown to) is a fresh ``mmap`` on every call, and each of its pages faults on the
first write (about 0.75 us a 4 KiB page here). small_cnn's inference step took 1000 such
faults a call and ran in 1.6 ms, against 0.85 ms in a process whose allocator happened to
serve the same buffers from its heap. The GPU has PyTorch's caching allocator; on the CPU the
host program keeps its own temporaries instead: a :class:`TempPool` holds one set of them,
``run`` takes the set at its start and gives it back before it returns (a concurrent or
re-entrant call finds the pool empty and allocates its own set).

Only memory that never leaves the call is pooled: an allocation (a kernel's ``TEMP`` output
with no buffer to take over) together with the buffers that later take its memory over
(``Program.reuses``) must not include a graph output, nor be read by an extern that may return
a view of its operands (only matmuls, convolutions, attention, sort and cumsum are known to
return fresh tensors). The pool is capped at ``POOL_BYTES`` a program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.symbolic import Sym
from kiln.schedule.buffers import FRESH_RESULTS
from kiln.schedule.loops import Buffer, BufferKind, Kernel
from kiln.schedule.program import ExternCall, Program, View

POOL_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Slot:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype


def pooled_allocations(program: Program) -> list[Buffer]:
    """The CPU allocations of ``program`` whose memory stays inside one call, in program
    order, within ``POOL_BYTES``."""
    owner: dict[int, Buffer] = {}  # id(buffer) -> the allocation whose memory it uses
    sites: list[Buffer] = []
    for step in program.steps:
        if not isinstance(step, Kernel):
            continue
        for buffer in step.writes():
            if buffer.kind is not BufferKind.TEMP:
                continue
            previous = program.reuses.get(id(buffer))
            if previous is None:
                owner[id(buffer)] = buffer
                sites.append(buffer)
            elif id(previous) in owner:
                owner[id(buffer)] = owner[id(previous)]
    escaping = {id(owner[id(v.buffer)]) for v in program.outputs if id(v.buffer) in owner}
    for step in program.steps:
        if isinstance(step, ExternCall) and step.node.op not in FRESH_RESULTS:
            for operand in step.operands:
                if isinstance(operand, View) and id(operand.buffer) in owner:
                    escaping.add(id(owner[id(operand.buffer)]))
    chosen: list[Buffer] = []
    total = 0
    for site in sites:
        if id(site) in escaping or site.device.type != "cpu":
            continue
        if any(isinstance(n, Sym) for n in (*site.shape, *site.strides)):
            continue  # (a size that varies from call to call: allocated per call)
        size = int(site.numel) * site.dtype.itemsize
        if total + size > POOL_BYTES:
            continue
        total += size
        chosen.append(site)
    return chosen


class TempPool:
    """One set of a program's pooled temporaries, lent to one call at a time."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self.free: list[list[torch.Tensor]] = []

    def take(self) -> list[torch.Tensor]:
        try:
            return self.free.pop()  # atomic under the GIL: one caller gets the set
        except IndexError:
            return [
                torch.empty_strided(s.shape, s.strides, dtype=s.dtype, device="cpu")
                for s in self.slots
            ]

    def give(self, tensors: list[torch.Tensor]) -> None:
        if not self.free:
            self.free.append(tensors)
