"""Clocks and memory meters shared by every benchmark.

GPU times are CUDA-event intervals (what the GPU spent, not what Python waited); CPU times
are ``perf_counter`` intervals. Either way a benchmark reports the median of many samples
taken after warm-up calls, so one slow call (a page fault, a clock change) cannot move it.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on CPU), so a host clock measures finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its wall-clock seconds, queued GPU work included (first-call timing)."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def median_seconds(
    step: Callable[[Any], Any],
    inputs: Sequence[Any],
    device: torch.device,
    warmup: int = 3,
    budget_s: float = 2.0,
    min_repeats: int = 5,
    max_repeats: int = 100,
) -> tuple[float, int]:
    """The median seconds of ``step(inputs[i])``, cycling through the input sets, and the number
    of samples. The sample count fits ``budget_s`` (slow models get ``min_repeats``)."""
    for index in range(warmup):
        step(inputs[index % len(inputs)])
    one = timed(lambda: step(inputs[0]), device)[1]  # (its result dies here, as in a loop)
    repeats = max(min_repeats, min(max_repeats, int(budget_s / max(one, 1e-9))))
    samples = [_sample(step, inputs[index % len(inputs)], device) for index in range(repeats)]
    return statistics.median(samples), repeats


def _sample(step: Callable[[Any], Any], inputs: Any, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        step(inputs)
        return time.perf_counter() - start
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    step(inputs)
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end)) / 1e3


def per_call_seconds(fn: Callable[[], Any], device: torch.device, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean seconds per call of ``calls`` back-to-back calls:
    host-side cost of tiny calls, where one call is below a clock's resolution."""
    means = []
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


class PeakMemory:
    """Peak memory of a run, in bytes. CUDA: the caching allocator's peak allocation since
    ``start()``, and its peak reservation (:meth:`reserved`). CPU: the process's peak resident
    set since start-up minus the resident set at ``start()`` (Linux keeps no resettable peak,
    which is why each benchmark runs in its own process: the peak then belongs to one compiler
    alone).

    Why both on CUDA: under CUDA graphs the allocation peak does not compare compilers.
    torch.compile's recorded graphs hand out tensors it builds on pool memory outside the
    allocator's count (ResNet-50's training step "peaked" at 308 MiB, less than its
    activations), while Kiln's pool tensors are the allocator's and count. The reservation
    counts every segment, pools included; ``start()`` first returns cached free segments
    (compiling's, warm-up's) to the driver, so it holds what the steps need, for any compiler."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.baseline = resident_bytes()

    def peak(self) -> int:
        if self.device.type == "cuda":
            synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return max(0, peak_kib * 1024 - self.baseline)

    def reserved(self) -> int | None:
        """CUDA: the peak of memory reserved from the driver since ``start()``; else None."""
        if self.device.type != "cuda":
            return None
        synchronize(self.device)
        return int(torch.cuda.max_memory_reserved(self.device))


def resident_bytes() -> int:
    """The current resident set size (Linux ``/proc``; the peak so far elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
