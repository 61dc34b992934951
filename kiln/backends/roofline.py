"""Per-kernel roofline: each GPU kernel of a compiled call, its measured time, the bytes its
buffers span and the share of the card's copy bandwidth that makes; for extern matmuls,
convolutions and attention, the share of the card's matmul FLOP/s instead.

``kiln.explain(fn, *args, profile=True)`` prints it (and ``kiln bench --profile`` in its
notes)::

    kernel                               calls    us/call   MB/call   of copy BW
    k12_native_layer_norm_add                1      41.2     52.4        86%
    extern aten::addmm (sm90_xmma_gemm...)   1     121.0   GFLOP 9.66   of matmul 71%

Bandwidths are measured on the card, once a process: a device-to-device copy of 256 MiB (read
plus write) and a 4096^3 matmul of the extern's dtype. A Kiln kernel's bytes are the sizes of
the buffers it reads and writes, so a kernel reading part of a buffer (a slice, a broadcast)
shows a share that is too high: the table is for finding slow kernels, not a proof of speed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from kiln.ir.symbolic import hint
from kiln.schedule.loops import Kernel
from kiln.schedule.program import Program, kernel_arguments

PROFILED_CALLS = 3


@dataclass
class KernelTime:
    """One GPU kernel name over the profiled calls."""

    name: str
    calls: int = 0
    microseconds: float = 0.0
    bytes: int | None = None  # a Kiln kernel's, per call
    flops: float | None = None  # an extern's, per call
    dtype: torch.dtype | None = None

    @property
    def per_call_us(self) -> float:
        return self.microseconds / max(self.calls, 1)


def kernel_bytes(kernel: Kernel) -> int:
    """The bytes of every buffer ``kernel`` reads or writes."""
    return sum(hint(b.numel) * b.dtype.itemsize for b in kernel_arguments(kernel))


def function_name(kernel_name: str) -> str:
    """The Triton function (and so the CUDA kernel) name of a Kiln kernel's name."""
    text = re.sub(r"\W", "_", kernel_name)
    return f"k_{text}" if text[:1].isdigit() else text


def extern_flops(op: str, shapes: Sequence[Sequence[int]], args: Sequence[object]) -> float | None:
    """The FLOPs of one extern call from its recorded input shapes (None for other ops)."""
    op = op.removeprefix("aten::")
    if op in ("mm", "addmm", "bmm", "baddbmm") and len(shapes) >= 2:
        a, b = (shapes[-2], shapes[-1]) if op in ("addmm", "baddbmm") else shapes[:2]
        if len(a) >= 2 and len(b) >= 2:
            return 2.0 * math.prod(a) * b[-1]
    if "flash_attention_forward" in op or "efficient_attention_forward" in op:
        q, k = shapes[0], shapes[1]  # (batch, length, heads, dim), the kernels' own layout
        if len(q) == 4 and len(k) == 4:
            return 4.0 * math.prod(q) * k[1]  # q @ k^T and p @ v
    if op in ("cudnn_convolution", "convolution", "_convolution") and len(shapes) >= 2:
        return _convolution_flops(op, shapes[0], shapes[1], args)
    return None


def _convolution_flops(
    op: str, image: Sequence[int], weight: Sequence[int], args: Sequence[object]
) -> float | None:
    """Needs the recorded stride, padding and dilation (``cudnn_convolution`` takes padding
    first, ``convolution`` stride first); None when the profiler did not record them."""
    spatial = len(image) - 2
    lists = [a for a in args if isinstance(a, list) and len(a) == spatial]
    if spatial < 1 or len(weight) != len(image) or len(lists) < 3:
        return None
    first, second, dilation = lists[:3]
    stride, padding = (second, first) if op == "cudnn_convolution" else (first, second)
    outputs = 1
    for size, k, s, p, d in zip(image[2:], weight[2:], stride, padding, dilation, strict=True):
        outputs *= (size + 2 * p - d * (k - 1) - 1) // s + 1
    return 2.0 * image[0] * weight[0] * outputs * math.prod(weight[1:])


@cache
def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (read plus write) of 256 MiB."""
    source = torch.empty(2**26, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = _time(lambda: target.copy_(source), device)
    return 2 * source.numel() * 4 / seconds


@cache
def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a 4096^3 matmul in ``dtype``."""
    a = torch.randn(4096, 4096, device=device).to(dtype)
    return 2 * 4096**3 / _time(lambda: a @ a, device)


def _time(run: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    run()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / repeats


def measure(run: Callable[[], object], programs: Iterable[Program]) -> list[KernelTime]:
    """The GPU kernels of ``run()`` (already compiled and warm), slowest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    kernels = {function_name(k.name): k for p in programs for k in p.kernels()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        for _ in range(PROFILED_CALLS):
            run()
        torch.cuda.synchronize()
    times: dict[str, KernelTime] = {}
    flops: dict[str, tuple[float, torch.dtype | None]] = {}
    for event in p.events():
        if event.device_type == DeviceType.CUDA:
            entry = times.setdefault(event.name, KernelTime(event.name))
            entry.calls += 1
            entry.microseconds += event.time_range.elapsed_us()
            continue
        work = extern_flops(event.name, event.input_shapes or [], _arguments(event))
        if work is not None:
            for launched in getattr(event, "kernels", []):
                flops[launched.name] = (work, _dtype(event))
    for entry in times.values():
        kernel = kernels.get(entry.name)
        if kernel is not None:
            entry.bytes = kernel_bytes(kernel)
        elif entry.name in flops:
            entry.flops, entry.dtype = flops[entry.name]
    for entry in times.values():
        entry.calls = max(entry.calls // PROFILED_CALLS, 1)
        entry.microseconds /= PROFILED_CALLS
    return sorted(times.values(), key=lambda t: -t.microseconds)


def _arguments(event: object) -> list[object]:
    concrete = getattr(event, "concrete_inputs", None)
    return list(concrete) if concrete else []


def _dtype(event: object) -> torch.dtype | None:
    names = {"c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "float": torch.float32}
    types = getattr(event, "input_type", None) or []  # e.g. ['c10::BFloat16', ...]
    return next((names[t] for t in types if t in names), None)


def report(times: Sequence[KernelTime], device: torch.device, top: int = 25) -> list[str]:
    """The table's lines (the ``top`` slowest kernels, and the total)."""
    total = sum(t.microseconds for t in times)
    lines = [f"GPU kernels of one call: {len(times)}, {total:.1f} us (slowest first)"]
    lines.append(f"  {'kernel':<48} {'calls':>5} {'us/call':>9} {'work/call':>14} {'roofline':>14}")
    for entry in times[:top]:
        work, share = "", ""
        if entry.bytes is not None:
            rate = entry.bytes / (entry.per_call_us * 1e-6)
            work = f"{entry.bytes / 1e6:.1f} MB"
            share = f"{rate / copy_bandwidth(device):.0%} of copy"
        elif entry.flops is not None:
            rate = entry.flops / (entry.per_call_us * 1e-6)
            work = f"{entry.flops / 1e9:.2f} GFLOP"
            peak = matmul_flops(device, entry.dtype or torch.bfloat16)
            share = f"{rate / peak:.0%} of matmul"
        name = entry.name if len(entry.name) <= 48 else entry.name[:45] + "..."
        lines.append(
            f"  {name:<48} {entry.calls:>5} {entry.per_call_us:>9.1f} {work:>14} {share:>14}"
        )
    return lines
