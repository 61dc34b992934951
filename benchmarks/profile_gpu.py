"""Where a compiled model's GPU time goes: the top CUDA kernels of Kiln (and eager, and
torch.compile when asked) under torch.profiler, a breakdown by kind of kernel (generated
Triton, cuBLAS/cuDNN externs, copies, other), GPU-busy time against the step's wall time
(the rest is host overhead), and what Kiln compiled.

    python benchmarks/profile_gpu.py --models gpt2,resnet50 [--compilers kiln,eager,torch]
        [--mode infer|train] [--compile-mode reduce-overhead] [--top 15] [--roofline 20]
        [--host]   (also: the CUDA runtime calls on the host, and synchronizing calls)
"""

from __future__ import annotations

import argparse
import re
import time
import warnings
from collections import defaultdict

import torch

import kiln
from kiln.backends import roofline
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.worker import prepare
from kiln.recording import listen, unlisten

STEPS = 5


def kind_of(name: str) -> str:
    """A coarse category of a CUDA kernel name."""
    lowered = name.lower()
    if lowered.startswith("triton") or re.match(r"k_?\d+_", name):
        return "triton"  # Inductor's triton_* and Kiln's k<position>_<ops>
    if any(key in lowered for key in ("gemm", "cublas", "sm90", "sm80", "cutlass", "xmma")):
        return "matmul"
    if any(key in lowered for key in ("conv", "cudnn", "wgrad", "dgrad", "implicit")):
        return "conv"
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if "memcpy" in lowered or "memset" in lowered or "copy" in lowered:
        return "copy"
    return "other"


def profile(
    name: str,
    compiler: str,
    mode: str,
    top: int,
    compile_mode: str | None,
    roofline_top: int = 0,
    host: bool = False,
    groups: int = 0,
) -> None:
    model, inputs, base = prepare(name, mode, torch.device("cuda"))
    if compiler == "kiln":
        run = kiln.compile(model, mode=compile_mode)
    elif compiler == "torch":
        run = torch.compile(model, mode=compile_mode)
    else:
        run = model

    def step(runner: object, inputs: object) -> object:
        if compiler == "torch" and compile_mode in ("reduce-overhead", "max-autotune"):
            torch.compiler.cudagraph_mark_step_begin()
        return base(runner, inputs)

    records: list = []
    listen(records, CompiledProgramRecord)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        step(run, inputs)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        for _ in range(3):
            step(run, inputs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS):
            step(run, inputs)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / STEPS * 1e3
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if host:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(STEPS):
                step(run, inputs)
            torch.cuda.synchronize()
        syncs = synchronizing_calls(lambda: step(run, inputs)) if host else []
        split = host_phases(lambda: step(run, inputs)) if host else ""
    unlisten(records)
    print(
        f"== {name} {mode} {compiler}: first call {first:.2f} s, step {wall_ms:.2f} ms", flush=True
    )
    for warning in caught:
        print(f"   warning: {str(warning.message)[:300]}")
    for record in records:
        kernels = record.program.kernels() if record.program else []
        print(
            f"   graph {record.graph}: {record.codegen}, {len(kernels)} kernels, "
            f"{len(record.program.externs()) if record.program else 0} externs, "
            f"compile {record.seconds:.2f} s {record.fallback}"
        )
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in record.phases.items())
        print(f"   {record.unique_kernels} distinct kernels; {phases}")
    if compiler == "kiln":
        for line in kiln.explain().cudagraphs:
            print(f"   {line}")
    if host:
        print(f"   host time per step (no sync): {split}")
        print_host(prof, syncs)
    # Kernels only: with CPU activity on, the ops that launched them carry device time too.
    events = [
        e
        for e in prof.key_averages()
        if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA
    ]
    by_kind: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for event in events:
        kind = kind_of(event.key)
        by_kind[kind] += event.self_device_time_total / STEPS / 1e3
        launches[kind] += event.count // STEPS
    busy = sum(by_kind.values())
    parts = ", ".join(
        f"{kind} {ms:.2f} ms/{launches[kind]}"
        for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])
    )
    print(f"   GPU busy {busy:.2f} of {wall_ms:.2f} ms per step: {parts}")
    for event in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(
            f"   {event.self_device_time_total / STEPS / 1e3:8.3f} ms  x{event.count // STEPS:<4d} "
            f"[{kind_of(event.key)}] {event.key[:110]}"
        )
    if groups:
        print_groups(events, groups)
    if compiler == "kiln" and roofline_top:
        programs = [record.program for record in records if record.program]
        times = roofline.measure(lambda: step(run, inputs), programs)
        for line in roofline.report(times, torch.device("cuda"), top=roofline_top):
            print(f"   {line}")
    print(flush=True)


def group_of(name: str) -> str:
    """A kernel's name without what makes each launch site's name unique: Kiln's position
    prefix (``k123_``) and Inductor's numeric suffix (``triton_poi_fused_add_0``)."""
    name = re.sub(r"^k_?\d+_", "", name)
    return re.sub(r"_\d+$", "", name)


def print_groups(events: list, top: int) -> None:
    """GPU time per step summed over kernels of one group (``group_of``): which kinds of
    fused kernel take the time, comparable between compilers."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        total = totals[f"[{kind_of(event.key)}] {group_of(event.key)}"]
        total[0] += event.self_device_time_total / STEPS / 1e3
        total[1] += event.count // STEPS
    print("   by group (ms per step, launches):")
    for key, (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {ms:8.3f} ms  x{count:<4d} {key[:120]}")


def synchronizing_calls(step: object) -> list[str]:
    """One step under ``torch.cuda.set_sync_debug_mode("warn")``: each synchronizing call's
    message and the innermost frames of its Python stack (a synchronization leaves the GPU
    idle until the host catches up)."""
    import traceback

    found: list[str] = []

    def show(message: object, *args: object, **kwargs: object) -> None:
        frames = traceback.extract_stack()[:-2][-4:]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames)
        found.append(f"{str(message)[:80]} at {where}")

    original = warnings.showwarning
    warnings.showwarning = show  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show  # type: ignore[assignment]
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()  # type: ignore[operator]
                torch.cuda.set_sync_debug_mode(0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = original
    return found


def host_phases(step: object) -> str:
    """Host time of a step's parts without synchronizing: up to ``loss.backward()``, inside
    it (the autograd engine runs the backward's host work before returning), and the wait
    for the GPU after it. A step whose wait is near zero is host-bound."""
    marks: list[float] = []
    original = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: object, **kwargs: object) -> None:
        marks.append(time.perf_counter())
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        marks.append(time.perf_counter())

    torch.cuda.synchronize()
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        step()  # type: ignore[operator]
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]
    if len(marks) == 2:
        return (
            f"forward {(marks[0] - start) * 1e3:.2f} ms, backward {(marks[1] - marks[0]) * 1e3:.2f}"
            f" ms, then GPU wait {(end - enqueued) * 1e3:.2f} ms"
        )
    return (
        f"enqueue {(enqueued - start) * 1e3:.2f} ms, then GPU wait {(end - enqueued) * 1e3:.2f} ms"
    )


def print_host(prof: torch.profiler.profile, syncs: list[str]) -> None:
    """The CUDA runtime calls a step makes on the host (launches, allocations, copies,
    synchronizations), and the synchronizing calls' Python frames."""
    runtime = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
    runtime = [e for e in runtime if e.self_device_time_total == 0]
    for event in sorted(runtime, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(
            f"   host {event.self_cpu_time_total / STEPS / 1e3:7.3f} ms  "
            f"x{event.count / STEPS:<6.1f} {event.key[:80]}"
        )
    counts: dict[str, int] = defaultdict(int)
    for line in syncs:
        counts[line] += 1
    print(f"   synchronizing calls in one step: {len(syncs)}")
    for line, count in sorted(counts.items(), key=lambda kv: -kv[1])[:6]:
        print(f"     x{count} {line[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--compilers", default="kiln")
    parser.add_argument("--mode", choices=["infer", "train"], default="infer")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compile-mode", default=None)
    parser.add_argument("--roofline", type=int, default=0, help="Kiln: the N slowest kernels")
    parser.add_argument("--host", action="store_true", help="CUDA runtime calls, syncs")
    parser.add_argument("--groups", type=int, default=0, help="the N costliest kernel groups")
    args = parser.parse_args()
    for name in args.models.split(","):
        for compiler in args.compilers.split(","):
            profile(
                name,
                compiler,
                args.mode,
                args.top,
                args.compile_mode,
                args.roofline,
                args.host,
                args.groups,
            )


if __name__ == "__main__":
    main()
