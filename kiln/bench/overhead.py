"""What compiling costs outside the kernels (``benchmarks/overhead.py``).

1. Per-call overhead on a cache hit: ``(x + y) * z`` on three small tensors, called back to
   back; a compiled call's time minus eager's is what guards and the wrapper add (TARGETS.md:
   under 20 us, and below torch.compile's, measured on the same machine).
2. Capture time of GPT-2's forward (GPT-2 small config, random weights): the first
   ``kiln.compile``'d call minus one eager call, beside torch.compile's first call (cold
   Inductor cache) minus the same eager call.
"""

from __future__ import annotations

import functools
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.bench.arguments import OneLineParser, UsageError
from kiln.bench.compare import max_relative_error
from kiln.bench.machine import (
    environment,
    resolve_device,
    use_fresh_compiler_caches,
    use_threads,
)
from kiln.bench.table import format_header
from kiln.bench.timing import per_call_seconds, timed

OVERHEAD_TARGET_US = 20.0


def add_mul(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The small function whose calls are timed (eager and kiln.compile)."""
    return (x + y) * z


def add_mul_for_torch(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The same function with its own code object: torch.compile and Kiln both key their
    caches by code object, and must not see each other's."""
    return (x + y) * z


@dataclass
class CallCost:
    """Microseconds per call: eager, and each compiler's call and its overhead over eager."""

    eager_us: float
    compiled_us: dict[str, float]

    def overhead_us(self, compiler: str) -> float:
        return self.compiled_us[compiler] - self.eager_us


def call_cost(device: torch.device, compilers: Sequence[str], calls: int = 2000) -> CallCost:
    """Per-call microseconds on a cache hit (the first call, which compiles, is not timed)."""
    x, y, z = (torch.randn(16, device=device) for _ in range(3))

    def per_call(fn: Callable[..., torch.Tensor]) -> float:
        fn(x, y, z)  # compile, fill the cache
        return per_call_seconds(lambda: fn(x, y, z), device, calls, rounds=7) * 1e6

    compiled = {name: per_call(_compile(name, _function_for(name))) for name in compilers}
    return CallCost(per_call(add_mul), compiled)


def _function_for(compiler: str) -> Callable[..., torch.Tensor]:
    return add_mul_for_torch if compiler == "torch" else add_mul


def _compile(compiler: str, fn: Any) -> Any:
    if compiler == "torch":
        return torch.compile(fn)
    import kiln

    return kiln.compile(fn)


@dataclass
class CaptureCost:
    """GPT-2 forward: one eager call, and each compiler's first call (seconds), its error."""

    eager_s: float
    first_call_s: dict[str, float]
    errors: dict[str, float]


def gpt2_capture_cost(
    device: torch.device, compilers: Sequence[str], length: int = 128
) -> CaptureCost:
    """First-call cost of GPT-2 small's forward on ``1 x length`` tokens, inference."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval().to(device)
    ids = torch.randint(0, 50257, (1, length), device=device)
    with torch.no_grad():
        model(ids)  # warm eager: the allocator, the kernels' first launches
        expected, eager_s = timed(lambda: model(ids).logits, device)
        first: dict[str, float] = {}
        errors: dict[str, float] = {}

        def first_logits(compiler: str) -> torch.Tensor:
            return _compile(compiler, model)(ids).logits

        # Kiln first, so its capture runs in a process no other compiler has touched (its
        # first call then includes Kiln's own lazy imports, as a user's would).
        for name in sorted(compilers, key=lambda name: name != "kiln"):
            print(f"GPT-2: {name} first call ...", file=sys.stderr, flush=True)
            result, first[name] = timed(functools.partial(first_logits, name), device)
            errors[name] = max_relative_error([result.float().cpu()], [expected.float().cpu()])
    return CaptureCost(eager_s, first, errors)


def format_call_cost(cost: CallCost) -> str:
    lines = [
        "| function | eager us/call | compiled us/call | overhead us | target |",
        "| --- | --- | --- | --- | --- |",
    ]
    torch_overhead = cost.overhead_us("torch") if "torch" in cost.compiled_us else None
    for name, us in cost.compiled_us.items():
        overhead = cost.overhead_us(name)
        verdict = "—"
        if name == "kiln":
            below = torch_overhead is None or overhead < torch_overhead
            met = overhead < OVERHEAD_TARGET_US and below
            rival = "torch.compile not measured" if torch_overhead is None else "below torch"
            verdict = f"{'met' if met else 'MISSED'} (< {OVERHEAD_TARGET_US:.0f} us, {rival})"
        title = "kiln.compile" if name == "kiln" else "torch.compile"
        numbers = f"{cost.eager_us:.1f} | {us:.1f} | {overhead:.1f}"
        lines.append(f"| {title}((x + y) * z) | {numbers} | {verdict} |")
    return "\n".join(lines)


def format_capture_cost(cost: CaptureCost) -> str:
    lines = [
        "| GPT-2 small forward | first call s | minus one eager call s | max rel err |",
        "| --- | --- | --- | --- |",
        f"| eager | {cost.eager_s:.3f} | — | — |",
    ]
    for name, seconds in cost.first_call_s.items():
        title = "kiln.compile" if name == "kiln" else "torch.compile (cold cache)"
        lines.append(
            f"| {title} | {seconds:.2f} | {seconds - cost.eager_s:.2f} | {cost.errors[name]:.1e} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, program: str = "benchmarks/overhead.py") -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(prog=program, description="per-call overhead and GPT-2 capture time")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
    parser.add_argument("--compilers", default="torch,kiln", help="default torch,kiln")
    parser.add_argument("--no-gpt2", action="store_true", help="skip GPT-2's capture time")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timing round")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(arguments)
    try:
        device = torch.device(resolve_device(args.device))
        use_threads(args.threads)
        compilers = [name for name in args.compilers.split(",") if name]
        if not compilers or any(name not in ("torch", "kiln") for name in compilers):
            raise UsageError(f"--compilers takes torch and/or kiln, got {args.compilers!r}")
    except UsageError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return 2
    use_fresh_compiler_caches()
    command = " ".join([program, *map(shlex.quote, arguments)])
    print(format_header(environment(str(device), args.threads), command) + "\n")
    print(format_call_cost(call_cost(device, compilers, args.calls)), flush=True)
    if not args.no_gpt2:
        try:
            cost = gpt2_capture_cost(device, compilers)
        except ImportError:
            print("\nGPT-2 capture time: skipped, transformers is not installed")
        else:
            print("\n" + format_capture_cost(cost))
    return 0


if __name__ == "__main__":
    sys.exit(main())
