"""What is alive at a training step's peak of GPU memory: per compiler, in a process of its own,
a suite model's step (forward, backward, AdamW step) is recorded with PyTorch's allocator
history; the script replays the trace, finds the moment of the peak and groups the blocks alive
then by the first frame of the code that allocated them (Kiln, torch.compile's generated code,
the model, or PyTorch).

    python benchmarks/memory_peak.py [--models gpt2,gpt2-lm] [--compilers eager,torch,kiln]
        [--top 12] [--ddp]

``gpt2-lm`` is ``benchmarks/distributed.py``'s step (GPT-2 small 8x1024, the loss computed by the
model, AdamW); ``--ddp`` wraps the model in DDP on one rank.

Prints per compiler the allocator's peak, the replayed peak, and the largest groups.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from typing import Any


def _frame(frames: list[dict[str, Any]]) -> str:
    """The frame that names who allocated: the first one outside PyTorch's own modules (or
    torch.compile's generated code), else the innermost."""
    for frame in frames:
        name = frame.get("filename", "")
        if "torch/_inductor" in name or "/tmp/" in name or "kiln/" in name:
            return f"{name.split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
        if "site-packages/torch" not in name and "python3" not in name and name:
            return f"{name.split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    if not frames:
        return "?"
    return f"{frames[0].get('filename', '?').split('/')[-1]}:{frames[0].get('name')}"


def child(name: str, compiler: str, top: int, ddp: bool) -> None:
    import torch

    device = torch.device("cuda")
    if name == "gpt2-lm":  # benchmarks/distributed.py's step: the loss inside the model
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model: Any = GPT2LMHeadModel(config).to(device)
        tokens = torch.randint(config.vocab_size, (8, 1024), device=device)
    else:
        from kiln.bench.worker import prepare

        model, inputs, step = prepare(name, "train", device, torch.bfloat16)
    if ddp:  # (one rank: DDP's buckets and hooks as on two, without a second GPU)
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        model = DDP(model, device_ids=[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    runner: Any = model
    if compiler == "torch":
        runner = torch.compile(model)
    elif compiler == "kiln":
        import kiln

        runner = kiln.compile(model)

    def full_step() -> None:
        if name == "gpt2-lm":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = runner(tokens, labels=tokens).loss
            loss.backward()
        else:
            step(runner, inputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        full_step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
    full_step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    live: dict[int, tuple[int, str]] = {}
    total = best = base
    at_best: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, _frame(event.get("frames", [])))
            total += size
            if total > best:
                best, at_best = total, dict(live)
        elif action == "free_completed" and address in live:
            total -= live.pop(address)[0]
    groups: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for size, frame in at_best.values():
        groups[frame] += size
        counts[frame] += 1
    rows = [(frame, groups[frame], counts[frame]) for frame, _ in groups.most_common(top)]
    print(json.dumps({"peak": peak, "base": base, "replayed": best, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2")
    parser.add_argument("--compilers", default="eager,torch,kiln")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--ddp", action="store_true", help="under DDP (one rank)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.top, args.ddp)
    for name in args.models.split(","):
        for compiler in args.compilers.split(","):
            command = [sys.executable, __file__, "--child", name, compiler, "--top", str(args.top)]
            command += ["--ddp"] * args.ddp
            done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
            if done.returncode:
                print(f"{name} {compiler}: failed\n{done.stderr[-3000:]}")
                continue
            report = json.loads(done.stdout.splitlines()[-1])
            mib = 2**20
            print(
                f"\n{name} {compiler}: peak {report['peak'] / mib:.0f} MiB (replayed "
                f"{report['replayed'] / mib:.0f}; before the step {report['base'] / mib:.0f})"
            )
            for frame, size, count in report["rows"]:
                print(f"  {size / mib:8.0f} MiB {count:4d} blocks  {frame}")


if __name__ == "__main__":
    main()
