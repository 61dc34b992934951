"""What crosses the edge of a CUDA-graph pool (``cudagraphs.py``): inputs copied into static
buffers (made in the recording when donated), results copied out of the pool, and the use
counts that say whether anyone still holds a tensor the runner handed out."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from kiln.ir.graph import Donated
from kiln.ir.types import dense

_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def use_counts(addresses: list[int]) -> list[int]:
    """The use counts of the storages at these C++ addresses (``storage._cdata``; kept alive
    by the caller): one call into C++ each, without Python's storage objects."""
    return list(map(_USE_COUNT, addresses)) if _USE_COUNT is not None else [-1] * len(addresses)


def use_count(storage: torch.UntypedStorage) -> int:
    if _USE_COUNT is None:  # (an older PyTorch: every result counts as held)
        return -1
    return int(_USE_COUNT(storage._cdata))


def expanded(tensor: torch.Tensor) -> bool:
    sizes, strides = tensor.size(), tensor.stride()
    return any(stride == 0 and size > 1 for size, stride in zip(sizes, strides, strict=True))


def buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor with ``tensor``'s size and strides (the layout the compiled
    graph was warmed up with, so recording compiles nothing new)."""
    return new_buffer(tensor.size(), tensor.stride(), tensor.dtype, tensor.device)


def new_buffer(
    size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


# A tensor's place: storage address and bytes, storage offset, size, strides, dtype, device
Layout = tuple[int, int, int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def layout_of(tensor: torch.Tensor) -> Layout:
    storage = tensor.untyped_storage()
    return (
        storage.data_ptr(),
        storage.nbytes(),
        int(tensor.storage_offset()),
        tuple(tensor.size()),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.device,
    )


def unowned(layout: Layout) -> torch.Tensor:
    """A tensor at ``layout`` that does not own its memory (a recording's donated input
    buffer: freed in the recording's pool, which keeps it while the recording lives)."""
    address, nbytes, offset, size, stride, dtype, device = layout
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


def copy_into(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``target.copy_(source)``, returning ``target``; an expanded layout (stride 0) copies
    its distinct elements."""
    into, what = target, source
    for dim, (size, stride) in enumerate(zip(target.size(), target.stride(), strict=True)):
        if stride == 0 and size > 1:
            into, what = into.narrow(dim, 0, 1), what.narrow(dim, 0, 1)
    into.copy_(what)
    return target


def view_on(output: torch.Tensor, static: torch.Tensor | None, given: torch.Tensor) -> torch.Tensor:
    """``output``, a view of the static copy ``static``, as the same view of ``given``."""
    assert static is not None
    offset = output.storage_offset() - static.storage_offset() + given.storage_offset()
    return given.as_strided(output.size(), output.stride(), offset)


def plan_batches(
    outputs: list[torch.Tensor], visible: list[tuple[int, int]]
) -> tuple[frozenset[int], list[list[int]]]:
    """For the user-visible pool outputs (``(number, storage)``): the storages several of them
    share, and per dtype and device the numbers of the ``dense`` ones alone in theirs, which
    :func:`copy_batches` copies together."""
    users: dict[int, int] = {}
    for _, at in visible:
        users[at] = users.get(at, 0) + 1
    shared = frozenset(at for at, count in users.items() if count > 1)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for number, at in visible:
        output = outputs[number]
        if at not in shared and dense(output) and output.numel() > 0:
            groups.setdefault((output.dtype, output.device), []).append(number)
    return shared, list(groups.values())


def copy_batches(outputs: list[torch.Tensor], batches: list[list[int]]) -> dict[int, torch.Tensor]:
    """Copies of the batched (``dense``) outputs: per dtype, one concatenation of their
    storage ranges into a new buffer and views of it, in their own strides (two calls into
    PyTorch however many outputs: a backward returns one gradient per parameter, a decoder
    its attention keys and values)."""
    copies: dict[int, torch.Tensor] = {}
    for numbers in batches:
        sources = [outputs[n] for n in numbers]
        if len(sources) == 1:  # (flattening one tensor is a view of it, not a copy)
            copies[numbers[0]] = sources[0].clone(memory_format=torch.preserve_format)
            continue
        ranges = [t if t.is_contiguous() else t.as_strided((t.numel(),), (1,)) for t in sources]
        flat = torch._C._nn.flatten_dense_tensors(ranges)
        pieces = torch._C._nn.unflatten_dense_tensors(flat, ranges)
        for number, source, span, piece in zip(numbers, sources, ranges, pieces, strict=True):
            same = span is source  # (contiguous: the piece has its shape already)
            copies[number] = piece if same else piece.as_strided(source.size(), source.stride())
    return copies


def copy_out(
    output: torch.Tensor,
    storage: int,
    copied: dict[int, torch.Tensor],
    shared: frozenset[int],
    storages: list[torch.UntypedStorage],
) -> torch.Tensor:
    """A copy of ``output`` outside the pool; outputs sharing one storage share the copy. A
    gapped one (a padded product's slice) keeps its strides, as the graph returns it uncopied."""
    if storage not in shared:
        if dense(output) or expanded(output):
            return output.clone(memory_format=torch.preserve_format)
        return buffer_like(output).copy_(output)
    whole = copied.get(storage)
    if whole is None:
        source = storages[storage]
        whole = torch.empty(source.nbytes(), dtype=torch.uint8, device=output.device)
        whole.untyped_storage().copy_(source)
        copied[storage] = whole
    fresh = torch.empty((0,), dtype=output.dtype, device=output.device)
    return fresh.set_(
        whole.untyped_storage(), output.storage_offset(), output.size(), output.stride()
    )


def recorded_run(
    compiled: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    static: list[torch.Tensor | None],
) -> tuple[Callable[[], list[torch.Tensor]], dict[int, tuple[Any, Layout]]]:
    """What a recorder runs: ``compiled`` on the static inputs. A copied input without a
    buffer (None in ``static``: donated) gets one made in the recording (pool memory), held
    by the program alone, which drops it after its last read: the recording's later steps may
    take its memory (ResNet-50's 36.75 MiB of images). Also returned, by position: a weak
    reference to each such buffer and its layout (for a tensor on that memory afterwards)."""
    if all(t is not None for t in static):
        return lambda: compiled(cast(list[torch.Tensor], static)), {}
    made: dict[int, tuple[Any, Layout]] = {}
    # (their layouts, not the inputs: a backward's are the values its forward saved, which
    # the forward's replays check nobody holds)
    layouts = [
        (i, tensor.size(), tensor.stride(), tensor.dtype, tensor.device)
        for i, tensor in enumerate(inputs)
        if static[i] is None
    ]

    def run() -> list[torch.Tensor]:
        donated = Donated(static)
        if not made:  # (an emulated replay runs it again, on the buffers by then)
            for position, size, stride, dtype, device in layouts:
                buffer = new_buffer(size, stride, dtype, device)
                made[position] = (weakref.ref(buffer), layout_of(buffer))
                donated[position] = buffer
                del buffer
        return compiled(donated)

    return run, made
