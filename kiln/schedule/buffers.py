"""Buffers: which stores a program keeps, when each temporary dies, and what reuses its memory.

Fusion stores every value a kernel computes; a store nobody reads afterwards (a softmax's max,
needed only inside its own kernel) is dropped. The buffer plan then frees each temporary after
its last reader and lets a later kernel's temporary of the same device, dtype and size take
over its memory, so peak memory stays at or below eager's.

A pointwise kernel's one store may also take over, in place, a buffer of its size that dies in
that kernel, when every load of it reads the element the store writes (ResNet's residual
``relu(bn(conv(x)) + identity)`` writes over the convolution's output: one activation less
at the peak). Extern results qualify only from externs known to return fresh tensors.
"""

from __future__ import annotations

from kiln.ir.op import Op
from kiln.schedule.loops import Buffer, BufferKind, Kernel, KernelKind, Load, walk
from kiln.schedule.program import ExternCall, Program, Step, View

# Externs whose results are always new tensors (never a view of an operand).
FRESH_RESULTS = frozenset(
    {Op.MM, Op.BMM, Op.ADDMM, Op.BADDBMM, Op.CONVOLUTION, Op.SDPA, Op.CUMSUM, Op.SORT, Op.TOPK}
)


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


def plan_buffers(program: Program, also_reads: dict[int, list[Buffer]] | None = None) -> None:
    """Free each temporary after its last reader and let later kernels reuse its memory.
    ``also_reads``: buffers a step (by ``id``) reads besides its own (``templates.py``)."""
    keep = {id(view.buffer) for view in program.outputs} | {id(b) for b in program.inputs}
    last: dict[int, int] = {}
    buffers: dict[int, Buffer] = {}
    extra = also_reads or {}
    for position, step in enumerate(program.steps):
        for buffer in [*step_writes(step), *step_reads(step), *extra.get(id(step), ())]:
            last[id(buffer)] = position
            buffers[id(buffer)] = buffer
    program.dead_after = [[] for _ in program.steps]
    for key, position in last.items():
        if key not in keep:
            program.dead_after[position].append(buffers[key])
    fresh = {id(b) for e in program.externs() if e.node.op in FRESH_RESULTS for b in e.outputs}
    pool: dict[tuple[object, ...], list[Buffer]] = {}
    for position, step in enumerate(program.steps):
        taken: set[int] = set()  # (died here, its memory now another buffer's)
        if isinstance(step, ExternCall) and step.in_place:  # (its memory is the result's)
            taken |= {id(o.buffer) for o in step.operands[:1] if isinstance(o, View)}
        if isinstance(step, Kernel):
            for buffer in step.writes():
                if buffer.kind is not BufferKind.TEMP:
                    continue
                dying = [b for b in program.dead_after[position] if id(b) not in taken]
                target = _in_place_target(step, buffer, dying, fresh)
                free = pool.get(_reuse_key(buffer))
                if target is not None:
                    program.reuses[id(buffer)] = target
                    taken.add(id(target))
                elif free:
                    program.reuses[id(buffer)] = free.pop()
        for buffer in program.dead_after[position]:
            if buffer.kind is BufferKind.TEMP and id(buffer) not in taken:
                pool.setdefault(_reuse_key(buffer), []).append(buffer)


def _in_place_target(
    kernel: Kernel, written: Buffer, dying: list[Buffer], fresh: set[int]
) -> Buffer | None:
    """A buffer dying in ``kernel`` whose memory its one store can write in place: of the
    store's size, read only at the store's own offset (so each element is read before it is
    overwritten, by the same program), and not by the kernels launched with it."""
    if kernel.kind is not KernelKind.POINTWISE or len(kernel.stores) != 1:
        return None
    (store,) = kernel.stores
    if store.buffer is not written or store.offset.indirects():
        return None
    loads = [e for e in walk([store.value]) if isinstance(e, Load)]
    for candidate in dying:
        if _reuse_key(candidate) != _reuse_key(written):
            continue
        beside = any(candidate in part.reads() for part in kernel.parts)  # (one launch)
        if beside or (candidate.kind is not BufferKind.TEMP and id(candidate) not in fresh):
            continue
        reads = [load for load in loads if load.buffer is candidate]
        if reads and all(load.offset == store.offset for load in reads):
            return candidate
    return None


def _reuse_key(buffer: Buffer) -> tuple[object, ...]:
    return (buffer.device, buffer.dtype, buffer.numel)
