"""A language model's head and loss alone (GPT-2 small's: hidden [8192, 768] times the tied
embedding [50257, 768] under bf16 autocast, logits upcast to float, cross-entropy), forward plus
backward, eager against torch.compile and Kiln in one process: the median of 10 calls after
warm-up, peak memory above the inputs, the gradients checked against eager's, and the GPU
kernels of one call per compiler (``torch.profiler``) so that the loss's kernels are visible.

    python benchmarks/lm_loss.py [--rows 8192] [--vocab 50257] [--hidden 768] [--kernels 8]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import kiln


def loss_of(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), labels)


def _median_ms(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels(fn: Callable[[], object], top: int) -> list[tuple[str, float]]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time_total / 1e3
    return totals.most_common(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--kernels", type=int, default=8, help="kernels listed per compiler")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    device = torch.device("cuda")
    hidden = torch.randn(args.rows, args.hidden, device=device, dtype=torch.bfloat16)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device=device)).requires_grad_()
    hidden.requires_grad_()
    labels = torch.randint(args.vocab, (args.rows,), device=device)
    want = loss_of(hidden, weight, labels)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    rows = []
    for name, runner in (
        ("eager", loss_of),
        ("kiln", kiln.compile(loss_of)),
        ("torch.compile", torch.compile(loss_of)),
    ):

        def step(runner: Callable[..., torch.Tensor] = runner) -> tuple[torch.Tensor, ...]:
            loss = runner(hidden, weight, labels)
            return (loss, *torch.autograd.grad(loss, (hidden, weight)))

        loss, *grads = step()
        errors = [(loss - want).abs().item()] + [
            ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
            for g, w in zip(grads, want_grads, strict=True)
        ]
        del loss, grads
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = _median_ms(step)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows.append((name, ms, peak, max(errors)))
        print(f"{name}: kernels of one call (ms)")
        for kernel, total in _kernels(step, args.kernels):
            print(f"  {total:8.3f}  {kernel}")
    card = torch.cuda.get_device_name()
    print(f"\n{args.rows}x{args.vocab} logits, hidden {args.hidden}, {card}")
    print("| compiler | fwd+bwd ms | vs eager | peak MiB above inputs | max rel. error |")
    print("| --- | --- | --- | --- | --- |")
    for name, ms, peak, error in rows:
        print(f"| {name} | {ms:.3f} | {rows[0][1] / ms:.2f}x | {peak:.0f} | {error:.1e} |")


if __name__ == "__main__":
    main()
