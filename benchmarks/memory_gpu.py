"""Why a compiled model's peak memory is what it is: the peak of one inference or training step
for eager and Kiln (the caching allocator's, as `kiln bench` measures it), and the tensors live
at Kiln's peak with the line that allocated each (a host-program line, or the model's source).

    python benchmarks/memory_gpu.py --models resnet50,gpt2 [--mode infer|train] [--top 12]
        [--compile-mode reduce-overhead] [--compiler kiln|torch]

The allocator's history is recorded from the start, so every block keeps the stack that
allocated it. Eager's peak is measured first; then the compiled steps run past recording and
lending (as `kiln bench` does before its peak), free segments go back to the driver, and two
steps are traced: their events are replayed to find the peak and what was live then, and list
the segments those steps reserved. After them: the memory reserved and allocated by pool (the
default pool, and each CUDA-graph pool), and the blocks live outside the graph pools summed by
the two innermost lines outside torch that allocated them (Kiln's own included; no line: C++
on another thread, such as cuDNN's or autograd's).
"""

from __future__ import annotations

import argparse
import linecache
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench.worker import STEADY_STEPS, prepare

MIB = 1 << 20


def _where(frames: list[dict[str, Any]]) -> str:
    """The most telling frame: Kiln's host program, else the first one outside torch."""
    for frame in frames:
        if frame["filename"].startswith("<kiln wrapper"):
            line = linecache.getline(frame["filename"], frame["line"]).strip()
            return f"wrapper:{frame['line']}: {line[:150]}"
    for frame in frames:
        name = frame["filename"]
        if "/torch/" not in name and "kiln/" not in name and not name.startswith(("<", "?")):
            line = linecache.getline(name, frame["line"]).strip()
            return f"{name.rsplit('/', 1)[-1]}:{frame['line']}: {line[:120]}"
    return " < ".join(f"{f['name']}" for f in frames[:4])


def _live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, list[tuple[int, str]]]:
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, sorted(at_peak, key=lambda item: -item[0])


def _peak(step: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _compiled(model: Any, compiler: str, compile_mode: str) -> Any:
    if compiler == "kiln":
        return kiln.compile(model, mode=compile_mode)
    compiled = torch.compile(model, mode=compile_mode)

    def marked(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return marked


def _pools() -> str:
    """Reserved MiB by pool (``default`` and each CUDA-graph pool): allocated / reserved in
    how many segments (what a pool holds beyond its live blocks is its fragmentation)."""
    sizes: dict[str, list[int]] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        name = "default" if pool == (0, 0) else f"graph pool {pool}"
        total = sizes.setdefault(name, [0, 0, 0])
        total[0] += segment["allocated_size"]
        total[1] += segment["total_size"]
        total[2] += 1
    return ", ".join(
        f"{name} {used / MIB:.0f}/{size / MIB:.0f} in {count}"
        for name, (used, size, count) in sorted(sizes.items())
    )


def _segments(trace: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The segments the caching allocator reserved from the driver during the trace."""
    return [
        (event["size"], _where(event.get("frames", [])))
        for event in trace
        if event["action"] == "segment_alloc"
    ]


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost two frames outside torch (Kiln's own included) of an allocation."""
    mine = [
        f
        for f in frames
        if "/torch/" not in f["filename"] and not f["filename"].startswith(("<", "?"))
    ]
    return " < ".join(
        f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in mine[:2]
    )


def _resident(top: int) -> None:
    """The live blocks outside the CUDA-graph pools, summed by where they were allocated."""
    sites: dict[str, list[int]] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                total = sites.setdefault(_site(block.get("frames", [])), [0, 0])
                total[0] += block["size"]
                total[1] += 1
    print("   live outside the graph pools, by site:")
    for where, (size, count) in sorted(sites.items(), key=lambda item: -item[1][0])[:top]:
        print(f"   {size / MIB:8.1f} MiB in {count:4d}  {where}")


def report(name: str, mode: str, top: int, compiler: str, compile_mode: str) -> None:
    # (recorded from the start: every block keeps the stack that allocated it)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    model, inputs, step = prepare(name, mode, torch.device("cuda"))
    for _ in range(2):
        step(model, inputs)
    eager = _peak(lambda: step(model, inputs))
    compiled = _compiled(model, compiler, compile_mode)
    for _ in range(STEADY_STEPS + 2):  # (as `kiln bench`: past recording and lending)
        step(compiled, inputs)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    begin = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    ours = _peak(lambda: [step(compiled, inputs) for _ in range(2)])
    reserved = torch.cuda.max_memory_reserved()
    snapshot = torch.cuda.memory._snapshot()
    trace = snapshot["device_traces"][torch.cuda.current_device()][begin:]
    peak, live = _live_at_peak(trace)
    segments = _segments(trace)
    print(
        f"== {name} {mode} {compiler} {compile_mode}: peak MiB eager {eager / MIB:.0f}, "
        f"{compiler} {ours / MIB:.0f}, peak reserved {reserved / MIB:.0f}, after it "
        f"{torch.cuda.memory_reserved() / MIB:.0f} ({_pools()})"
        f" (allocated before the steps {base / MIB:.0f}); step allocations live at the peak: "
        f"{peak / MIB:.0f} MiB in {len(live)} blocks; {len(segments)} segments reserved in "
        f"two steps, {sum(size for size, _ in segments) / MIB:.0f} MiB",
        flush=True,
    )
    for size, where in live[:top]:
        print(f"   {size / MIB:8.1f} MiB  {where}")
    for size, where in sorted(segments, key=lambda item: -item[0])[:top]:
        print(f"   segment {size / MIB:8.1f} MiB  {where}")
    _resident(top)
    print(flush=True)
    torch.cuda.memory._record_memory_history(enabled=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--compiler", choices=["kiln", "torch"], default="kiln")
    parser.add_argument("--compile-mode", default="default")
    args = parser.parse_args()
    for name in args.models.split(","):
        report(name, args.mode, args.top, args.compiler, args.compile_mode)


if __name__ == "__main__":
    main()
