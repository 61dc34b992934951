"""How fast can a kernel that only reads go? The physical limit for cross-entropy (issue 21).

Cross-entropy over a 16384 x 4096 bf16 tensor reads it once and writes a scalar, so "copy
bandwidth" (read + write of the same bytes, ``y.copy_(x)``) is not its ceiling: a read-only
stream runs at a different rate. This script measures, on one card, in one process:

- copy: ``y.copy_(x)``, (read + write bytes) / time;
- pure read: the best of several configurations of a Triton kernel of our own that sums the
  tensor (each program reduces a contiguous chunk in fp32 and writes one partial);
- ``x.sum()`` (PyTorch's reduction, for reference; not the limit);
- cross-entropy with the fp32 upcast under Kiln (default mode and max-autotune), torch.compile
  and eager; bytes = the tensor once.

    python benchmarks/read_limit.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kiln
from kiln.bench.timing import median_seconds

ROWS, COLS = 16384, 4096


@triton.jit
def _read_sum(x_ptr, out_ptr, numel, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * CHUNK
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        index = start + offset + tl.arange(0, BLOCK)
        total += tl.load(x_ptr + index, mask=index < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(total, 0))


def seconds(run, *args) -> float:
    return median_seconds(lambda _: run(*args), [None], torch.device("cuda"), budget_s=1.0)[0]


def main() -> None:
    device = torch.device("cuda")
    x = torch.randn(ROWS, COLS, device=device).to(torch.bfloat16)
    target = torch.randint(0, COLS, (ROWS,), device=device)
    size = x.numel() * x.element_size()
    y = torch.empty_like(x)
    rows = []
    copy = 2 * size / seconds(lambda: y.copy_(x))
    rows.append(("copy (read + write)", copy))
    best = (0.0, "")
    for chunk in (8192, 16384, 65536):
        for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16)):
            if block > chunk:
                continue
            programs = triton.cdiv(x.numel(), chunk)
            partial = torch.empty(programs, device=device, dtype=torch.float32)

            def run(chunk=chunk, block=block, warps=warps, partial=partial, programs=programs):
                _read_sum[(programs,)](x, partial, x.numel(), chunk, block, num_warps=warps)

            run()
            torch.testing.assert_close(partial.sum(), x.float().sum(), rtol=1e-3, atol=1.0)
            rate = size / seconds(run)
            best = max(best, (rate, f"chunk {chunk}, block {block}, {warps} warps"))
    rows.append((f"pure read, Triton ({best[1]})", best[0]))
    rows.append(("x.sum() (PyTorch)", size / seconds(lambda: x.sum())))

    def ce(t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(t.float(), target)

    expected = ce(x)
    for name, fn in (
        ("cross-entropy, eager", ce),
        ("cross-entropy, torch.compile", torch.compile(ce)),
        ("cross-entropy, kiln", kiln.compile(ce)),
        ("cross-entropy, kiln max-autotune", kiln.compile(ce, mode="max-autotune-no-cudagraphs")),
    ):
        torch.testing.assert_close(fn(x), expected, rtol=1e-3, atol=1e-3)
        rows.append((name, size / seconds(fn, x)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| kernel | GB/s | of copy | of pure read |\n| --- | --- | --- | --- |")
    for name, rate in rows:
        print(f"| {name} | {rate / 1e9:.0f} | {rate / copy:.0%} | {rate / best[0]:.0%} |")


if __name__ == "__main__":
    main()
