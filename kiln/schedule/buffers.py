"""Buffers: which stores a program keeps, when each temporary dies, and what reuses its memory.

Fusion stores every value a kernel computes; a store nobody reads afterwards (a softmax's max,
needed only inside its own kernel) is dropped. The buffer plan then frees each temporary after
its last reader and lets a later kernel's temporary of the same device, dtype and size take
over its memory, so peak memory stays at or below eager's.
"""

from __future__ import annotations

from kiln.schedule.loops import Buffer, BufferKind, Kernel, Load, walk
from kiln.schedule.program import ExternCall, Program, Step, View


def drop_dead_stores(steps: list[Step], outputs: list[View]) -> list[Step]:
    """``steps`` without the stores nobody reads (nor ``outputs``), and without kernels left
    with no store."""
    used = _used_buffers(steps, outputs)
    kept: list[Step] = []
    for step in steps:
        if isinstance(step, Kernel):
            step.stores = [s for s in step.stores if id(s.buffer) in used]
            if not step.stores:
                continue  # a kernel with xnumel == 0 stays: the wrapper allocates its outputs
        kept.append(step)
    return kept


def _used_buffers(steps: list[Step], outputs: list[View]) -> set[int]:
    used = {id(view.buffer) for view in outputs}
    for step in steps:
        if isinstance(step, ExternCall):
            used |= {id(o.buffer) for o in step.operands if isinstance(o, View)}
            continue
        written = {id(s.buffer) for s in step.stores}
        for expr in walk([s.value for s in step.stores]):
            if isinstance(expr, Load) and id(expr.buffer) not in written:
                used.add(id(expr.buffer))
    return used


def step_reads(step: Step) -> list[Buffer]:
    if isinstance(step, ExternCall):
        return [o.buffer for o in step.operands if isinstance(o, View)]
    return step.reads()


def step_writes(step: Step) -> list[Buffer]:
    return list(step.outputs) if isinstance(step, ExternCall) else step.writes()


def plan_buffers(program: Program) -> None:
    """Free each temporary after its last reader and let later kernels reuse its memory."""
    keep = {id(view.buffer) for view in program.outputs} | {id(b) for b in program.inputs}
    last: dict[int, int] = {}
    buffers: dict[int, Buffer] = {}
    for position, step in enumerate(program.steps):
        for buffer in [*step_writes(step), *step_reads(step)]:
            last[id(buffer)] = position
            buffers[id(buffer)] = buffer
    program.dead_after = [[] for _ in program.steps]
    for key, position in last.items():
        if key not in keep:
            program.dead_after[position].append(buffers[key])
    pool: dict[tuple[object, ...], list[Buffer]] = {}
    for position, step in enumerate(program.steps):
        if isinstance(step, Kernel):
            for buffer in step.writes():
                if buffer.kind is not BufferKind.TEMP:
                    continue
                free = pool.get(_reuse_key(buffer))
                if free:
                    program.reuses[id(buffer)] = free.pop()
        for buffer in program.dead_after[position]:
            if buffer.kind is BufferKind.TEMP:
                pool.setdefault(_reuse_key(buffer), []).append(buffer)


def _reuse_key(buffer: Buffer) -> tuple[object, ...]:
    return (buffer.device, buffer.dtype, buffer.numel)
