"""GPT-2 small trained data-parallel: eager, torch.compile or Kiln, under DDP or FSDP2 (issue 24).

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --mode ddp --compiler kiln
    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --mode fsdp2 --profile
    torchrun --standalone --nproc-per-node 2 benchmarks/distributed.py --device cpu --tiny

GPT2LMHeadModel from its config (random weights, seed 0 on every rank), bf16 autocast on the
GPU, AdamW; each rank draws its own token batches from a fixed seed. Prints the loss of each of
the first ``--steps`` steps (mean over ranks), the first call's time, ms/step (median of
``--timed`` steps), the peak memory of each GPU, and with ``--profile`` the communication time
(NCCL kernels) and how much of it ran under compute kernels, from the profiler's kernel
intervals. Rank 0 ends with one ``RESULT {json}`` line (``distributed_all.sh`` tabulates them;
``--table FILE`` prints the table of a file of such lines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--compiler", choices=["eager", "torch", "kiln"], default="kiln")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 (CPU tests)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="steps whose losses are printed")
    parser.add_argument("--timed", type=int, default=20, help="steps timed after those")
    parser.add_argument("--autocast", choices=["bf16", "none"], default=None)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size")
    parser.add_argument(
        "--scope",
        choices=["whole", "blocks"],
        default="whole",
        help="compile the whole model, or each transformer block (FSDP2's usual unit)",
    )
    parser.add_argument("--profile", action="store_true", help="measure comm/compute overlap")
    parser.add_argument("--table", metavar="FILE", help="print the table of RESULT lines")
    args = parser.parse_args(argv)
    if args.autocast is None:
        args.autocast = "bf16" if args.device == "cuda" else "none"
    return args


def gpt2(tiny: bool, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=256) if tiny else {}
    # No dropout: its masks come from different generators in each compiler, and the losses
    # must be comparable step by step.
    config = GPT2Config(
        n_positions=max(seq, 1024), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **sizes
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def wrap(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> Any:
    """The model as ``--mode`` distributes it and ``--compiler`` compiles it."""
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        model = DDP(model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    if args.compiler == "eager":
        return model
    if args.compiler == "kiln":
        import kiln

        compile_: Callable[[Any], Any] = kiln.compile
    else:
        compile_ = torch.compile
    if args.scope == "whole":
        return compile_(model)
    blocks = model.module.transformer.h if args.mode == "ddp" else model.transformer.h
    for index, block in enumerate(blocks):
        blocks[index] = compile_(block)
    return model


def batches(args: argparse.Namespace, vocab: int, device: torch.device) -> Iterable[Any]:
    step = 0
    while True:
        generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(vocab, (args.batch, args.seq), generator=generator)
        yield tokens.to(device)
        step += 1


def make_step(model: Any, args: argparse.Namespace, device: torch.device) -> Callable[..., Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = torch.bfloat16 if args.autocast == "bf16" else None

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def hidden(comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]) -> float:
    """How long communication ran while some compute kernel ran too (same units as given).

    >>> hidden([(0, 10)], [(2, 4), (3, 5), (8, 12)])
    5
    """
    busy = merged(compute)
    total = 0
    for start, end in merged(comm):
        total += sum(max(0, min(end, b) - max(start, a)) for a, b in busy)
    return total


def overlap_line(trace: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """Communication time and the part of it hidden under compute, from a Chrome trace's
    device kernels (NCCL kernels are communication; every other kernel is compute). On the
    CPU (gloo, no kernels) the trace's ``gloo:``/``c10d`` ops stand in for communication."""
    events = [e for e in trace.get("traceEvents", []) if "dur" in e and "ts" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        is_comm = lambda e: "nccl" in e["name"].lower()
    else:
        kernels = [e for e in events if e.get("cat") == "cpu_op"]
        is_comm = lambda e: e["name"].startswith(("gloo:", "c10d::"))
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e)]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_comm(e)]
    total = sum(end - start for start, end in merged(comm)) / 1000
    under = hidden(comm, compute) / 1000
    share = 100 * under / total if total else 0.0
    line = f"communication {total:.1f} ms, {under:.1f} ms of it under compute ({share:.0f}%)"
    if not kernels or kernels[0].get("cat") != "kernel":
        line += " (CPU ops: they nest, so this only shows the measurement runs)"
    return line, {"comm_ms": total, "hidden_ms": under, "hidden_pct": share}


def profile(step: Callable[..., Any], data: Iterable[Any], device: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profiler(activities=activities) as prof:
        for _, tokens in zip(range(3), data, strict=False):
            step(tokens)
        synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"trace{dist.get_rank()}.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    line, numbers = overlap_line(trace)
    print(f"[rank {dist.get_rank()}] profile of 3 steps: {line}", flush=True)
    if dist.get_rank() == 0:
        print(kernel_summary(trace, steps=3), flush=True)
    return numbers


def kernel_summary(trace: dict[str, Any], steps: int, top: int = 12) -> str:
    """GPU-busy time per step (the union of all kernels' intervals) and the kernels taking
    the most time, per step: whether a step waits on the host or on its kernels, and which."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return "(no GPU kernels in the trace)"
    busy = sum(end - start for start, end in merged((e["ts"], e["ts"] + e["dur"]) for e in kernels))
    totals: dict[str, list[float]] = {}
    for event in kernels:
        entry = totals.setdefault(event["name"][:70], [0.0, 0])
        entry[0] += event["dur"]
        entry[1] += 1
    lines = [f"GPU busy {busy / 1000 / steps:.2f} ms a step, {len(kernels) // steps} kernels"]
    for name, (time_us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {time_us / 1000 / steps:7.3f} ms  x{count // steps:<4} {name}")
    return "\n".join(lines)


def peak_memory(device: torch.device) -> list[float]:
    """Each rank's peak allocated GiB (empty on the CPU)."""
    if device.type != "cuda":
        return []
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [round(t.item(), 2) for t in every]


def train(args: argparse.Namespace) -> dict[str, Any]:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, default)  # run without torchrun: one process
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = gpt2(args.tiny, args.seq).to(device)
    step = make_step(wrap(model, args, device), args, device)
    data = iter(batches(args, model.config.vocab_size, device))
    losses, times = [], []
    for index in range(args.steps + args.timed):
        synchronize(device)
        start = time.perf_counter()
        loss = step(next(data))
        synchronize(device)
        times.append(time.perf_counter() - start)
        if index < args.steps:
            losses.append(mean_over_ranks(loss))
            if dist.get_rank() == 0:
                print(
                    f"step {index}: loss {losses[-1]:.6f}  ({times[-1] * 1000:.1f} ms)", flush=True
                )
    timed = times[args.steps :] or times[1:] or times
    if dist.get_rank() == 0:  # drift or outliers show here, not in the median
        print("timed steps ms: " + " ".join(f"{1000 * t:.1f}" for t in timed), flush=True)
    result: dict[str, Any] = {
        "mode": args.mode,
        "compiler": args.compiler,
        "scope": args.scope if args.compiler != "eager" else "-",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": dist.get_world_size(),
        "first_call_s": round(times[0], 3),
        "ms_per_step": round(1000 * statistics.median(timed), 2),
        "peak_gib": peak_memory(device),
        "losses": losses,
    }
    if args.profile:
        result.update(profile(step, data, device))
    if args.compiler == "kiln":
        import kiln

        result["kiln_graphs"] = kiln.counters.graphs
        result["kiln_recompiles"] = len(kiln.counters.recompiles)
        result["kiln_fallbacks"] = [str(record) for record in kiln.counters.fallbacks]
    # Tear down in order: the wrapped model (DDP's reducer, FSDP's hooks) before its process
    # group, after every rank is done; gloo aborted at exit now and then otherwise
    # ("terminate called without an active exception" in one rank, after its last step).
    del step, data, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


def table(path: str) -> str:
    """One row per run; loss difference against the eager run of the same mode."""
    with open(path) as file:
        rows = [json.loads(line.split(" ", 1)[1]) for line in file if line.startswith("RESULT ")]
    eager = {r["mode"]: r["losses"] for r in rows if r["compiler"] == "eager"}
    lines = [
        "| mode | compiler | scope | ms/step | first call s | peak GiB/GPU | max loss gap to eager "
        "| comm ms | hidden under compute |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        base = eager.get(r["mode"])
        pairs = zip(r["losses"], base or [], strict=False)  # (no eager run: no gap)
        gap = max((abs(a - b) for a, b in pairs), default=0.0)
        gap_text = f"{gap:.2e}" if base else "-"
        comm = f"{r['comm_ms']:.1f}" if "comm_ms" in r else "-"
        under = f"{r['hidden_ms']:.1f} ({r['hidden_pct']:.0f}%)" if "comm_ms" in r else "-"
        memory = "/".join(str(g) for g in r["peak_gib"]) or "-"
        lines.append(
            f"| {r['mode']} | {r['compiler']} | {r['scope']} | {r['ms_per_step']} "
            f"| {r['first_call_s']} "
            f"| {memory} | {gap_text} | {comm} | {under} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.table:
        print(table(args.table))
        return
    result = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
