"""Fused memory-bound kernels: eager, torch.compile and kiln.compile in GB/s and as a share
of the measured copy bandwidth (``benchmarks/kernels.py``).

These six cases are where a fusing compiler earns its keep: each reads and writes a few
64M-element bf16 tensors (16384 x 4096) once, so the best possible kernel runs at copy speed,
and the table says how close each compiler gets (TARGETS.md: Kiln at least 90% everywhere).
"Bytes" counts what one perfectly fused kernel must move: its inputs once and its output
once (small parameter vectors are ignored).

A GPU benchmark: on a machine without one it says so, unless ``--device cpu`` asks for a
small CPU run (useful to check the harness, not to read numbers from: a small CPU copy
runs in cache).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from kiln.bench.arguments import OneLineParser, UsageError
from kiln.bench.compare import max_relative_error
from kiln.bench.machine import (
    environment,
    resolve_device,
    use_fresh_compiler_caches,
    use_threads,
)
from kiln.bench.table import format_header
from kiln.bench.timing import median_seconds, synchronize

GPU_SHAPE = (16384, 4096)
CPU_SHAPE = (256, 1024)


@dataclass
class Case:
    """One fused computation, its arguments and the bytes a perfect kernel moves."""

    name: str
    fn: Callable[..., torch.Tensor]
    args: tuple[torch.Tensor, ...]
    bytes: int


def make_cases(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """TARGETS.md's six cases on ``rows x cols`` tensors."""
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    x, y, w, b = rand(rows, cols), rand(rows, cols), rand(cols), rand(cols)
    target = torch.randint(0, cols, (rows,), generator=generator).to(device)
    size = x.numel() * x.element_size()

    def cross_entropy(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.float(), target)

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return x * scale * w

    return [
        Case("layer_norm", lambda x: F.layer_norm(x, (cols,), w, b), (x,), 2 * size),
        Case("softmax", lambda x: torch.softmax(x, -1), (x,), 2 * size),
        Case("gelu(x + b) + y", lambda x, y: F.gelu(x + b) + y, (x, y), 3 * size),
        Case("rms_norm", rms_norm, (x,), 2 * size),
        Case(
            "cross_entropy (fp32 upcast)", lambda x: F.cross_entropy(x.float(), target), (x,), size
        ),
        Case("relu(x + 1) * 2 + y", lambda x, y: torch.relu(x + 1) * 2 + y, (x, y), 3 * size),
    ]


def seconds_of(fn: Callable[[], Any], device: torch.device) -> float:
    """Median seconds of ``fn``: Triton's ``do_bench`` on a GPU (it flushes the L2 cache between
    calls), CUDA events without Triton, ``perf_counter`` on a CPU."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            pass
        else:
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3
    seconds, _ = median_seconds(lambda _: fn(), [None], device, warmup=5, budget_s=1.0)
    return seconds


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of ``copy_`` between two ``nbytes`` buffers (1 GiB on a GPU, as TARGETS.md)."""
    if device.type == "cuda":
        nbytes = max(nbytes, 2**30)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    return 2 * nbytes / seconds_of(lambda: destination.copy_(source), device) / 1e9


@dataclass
class Result:
    """One case: GB/s per compiler, errors against eager, failures."""

    case: str
    gbps: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def measure_case(case: Case, compilers: Sequence[str], device: torch.device) -> Result:
    result = Result(case.name)
    expected = case.fn(*case.args)
    for name in ("eager", *compilers):
        try:
            fn = _compiled(case.fn, name)
            actual = fn(*case.args)  # compiles
            synchronize(device)
            result.errors[name] = max_relative_error([actual.float()], [expected.float()])
            seconds = seconds_of(functools.partial(fn, *case.args), device)
            result.gbps[name] = case.bytes / seconds / 1e9
        except Exception as error:
            result.failures[name] = f"{type(error).__name__}: {' '.join(str(error).split())}"[:200]
    return result


def _compiled(fn: Callable[..., torch.Tensor], compiler: str) -> Callable[..., torch.Tensor]:
    if compiler == "torch":
        torch._dynamo.reset()
        return torch.compile(fn)
    if compiler == "kiln":
        import kiln

        return kiln.compile(fn)
    return fn


def format_results(results: Sequence[Result], copy_gbps: float, compilers: Sequence[str]) -> str:
    names = ["eager", *compilers]
    titles = {"eager": "eager", "torch": "torch.compile", "kiln": "kiln"}
    header = ["case", *[f"{titles[n]} GB/s (share of copy)" for n in names], "max rel err (kiln)"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines.append(f"| copy | {copy_gbps:.0f} (100%) |" + " |" * len(header[2:]))
    for result in results:
        cells = [result.case]
        for name in names:
            gbps = result.gbps.get(name)
            share = f"{gbps:.0f} ({gbps / copy_gbps:.0%})" if gbps is not None else "error"
            cells.append(share)
        kiln_error = result.errors.get("kiln")
        cells.append(f"{kiln_error:.1e}" if kiln_error is not None else "—")
        lines.append("| " + " | ".join(cells) + " |")
    failures = [f"- {r.case}, {n}: {why}" for r in results for n, why in r.failures.items()]
    return "\n".join(lines + (["", *failures] if failures else []))


def main(argv: Sequence[str] | None = None, program: str = "benchmarks/kernels.py") -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = _parser(program).parse_args(arguments)
    if args.device is None and not torch.cuda.is_available():
        print(
            f"{program}: the fused-kernel cases are GPU benchmarks and there is no GPU here "
            "(pass --device cpu for a small CPU run of the harness)"
        )
        return 0
    try:
        device, (rows, cols), compilers = _resolve(args)
    except UsageError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    use_fresh_compiler_caches()
    cases = make_cases(rows, cols, dtype, device)
    copy_gbps = copy_bandwidth(device, cases[0].bytes // 2)
    results = []
    for case in cases:
        print(f"{case.name} ...", file=sys.stderr, flush=True)
        results.append(measure_case(case, compilers, device))
    command = " ".join([program, *map(shlex.quote, arguments)])
    print(format_header(environment(str(device), args.threads), command))
    print(f"- shape: {rows}x{cols} {str(dtype).removeprefix('torch.')}\n")
    print(format_results(results, copy_gbps, compilers))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"copy_gbps": copy_gbps, "cases": [asdict(r) for r in results]}, out, indent=1
            )
    return 0


def _parser(program: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=program, description="fused memory-bound kernels vs copy bandwidth")
    parser.add_argument("--device", help="cuda (default when there is a GPU) or cpu (small run)")
    parser.add_argument("--shape", help="ROWSxCOLS (default 16384x4096 on a GPU, 256x1024 on CPU)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--compilers", default="torch,kiln", help="default torch,kiln")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    return parser


def _resolve(args: argparse.Namespace) -> tuple[torch.device, tuple[int, int], list[str]]:
    device = torch.device(resolve_device(args.device))
    use_threads(args.threads)
    compilers = [name for name in args.compilers.split(",") if name]
    if any(name not in ("torch", "kiln") for name in compilers):
        raise UsageError(f"--compilers takes torch and/or kiln, got {args.compilers!r}")
    return device, _shape(args.shape, device), compilers


def _shape(text: str | None, device: torch.device) -> tuple[int, int]:
    if text is None:
        return GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    try:
        rows, cols = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--shape takes ROWSxCOLS, got {text!r}") from None
    return rows, cols


if __name__ == "__main__":
    sys.exit(main())
