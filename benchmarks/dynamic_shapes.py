"""Dynamic shapes: eager, Kiln and torch.compile on inputs whose sizes change from call to call.

Each workload runs in one process under every compiler, each on a fresh copy of the model
after ``kiln.reset()`` and ``torch._dynamo.reset()``, with fresh kernel caches (Inductor's and
Triton's per process, Kiln's per run, its once-per-machine files kept):

- ``mlp``: a 64-256-GELU-64 MLP over 12 batch sizes;
- ``cnn``: three conv-BN-ReLU layers, adaptive average pooling and a linear layer (eval mode)
  over 6 image sizes;
- ``block``: a pre-LN transformer block (attention with a causal mask built from
  ``torch.ones(t, t).tril()``, MLP) over 8 sequence lengths;
- ``generate``: a GPT-2 from transformers with random weights, its ``forward`` compiled, then
  greedy ``model.generate`` with the dynamic (default) and the static key-value cache.

Usage::

    PYTHONPATH=. python benchmarks/dynamic_shapes.py [--device cpu|cuda] [--threads 1]
        [--workloads mlp,cnn,block,generate] [--gpt2-size tiny|small] [--quick]

Columns: captures (torch.compile: frames it compiled), graphs (torch.compile: unique graphs),
recompiles (torch.compile: compiles with a recompile reason), fallbacks (frames run
uncompiled; torch.compile: frames it failed to compile, the recompile limit included), backend
compiles (programs Kiln's backend built; ``4+1``: one more during the steady passes), first
pass (seconds over all sizes, compiles included), steady (ms, the median of later passes over
the same sizes; generate: of whole ``generate`` calls after the first, and per new token),
check (the largest absolute difference from eager over every size; generate: whether the ids
equal eager's). The recompile reasons and fallbacks are printed as each row finishes.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shlex
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch import nn

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.machine import environment, use_fresh_compiler_caches, use_threads
from kiln.bench.table import format_header
from kiln.bench.timing import timed
from kiln.config import config as kiln_config
from kiln.recording import listen, unlisten

COMPILERS = ("eager", "kiln", "kiln dynamic=True", "torch.compile")
WORKLOADS = ("mlp", "cnn", "block", "generate")
USUAL_KILN_CACHE = kiln_config.cache_dir


@dataclass
class Row:
    workload: str
    compiler: str
    captures: str = "-"
    graphs: str = "-"
    recompiles: str = "-"
    fallbacks: str = "-"
    backend_compiles: str = "-"
    first_s: float = math.nan
    steady_ms: float = math.nan
    per_token_ms: float = math.nan
    check: str = "-"
    error: str = ""
    reasons: list[str] = field(default_factory=list)  # recompile reasons
    programs: list[Any] = field(default_factory=list)  # Kiln's backend programs so far
    programs_first: int = 0  # how many the first pass built


@dataclass
class Settings:
    device: torch.device
    quick: bool
    passes: int
    gpt2_size: str
    batches: list[int]
    caches: str  # the folder of this run's fresh compiler caches


# -- workloads with changing sizes --------------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for inputs, outputs, stride in [(3, 16, 1), (16, 32, 2), (32, 64, 2)]:
            layers += [nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)]
            layers += [nn.BatchNorm2d(outputs), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class Block(nn.Module):
    """Pre-LN transformer block with hand-written causal attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, device=x.device).tril()
        scores = scores.masked_fill(mask == 0, float("-inf"))
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.out(attended)
        return x + self.mlp(self.norm2(x))


def sized_workload(name: str, settings: Settings) -> tuple[nn.Module, list[torch.Tensor]]:
    """The model of a workload and one input per size."""
    quick, gpu = settings.quick, settings.device.type == "cuda"
    if name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        sizes = [3, 5, 8, 2] if quick else [3, 5, 8, 13, 21, 34, 55, 89, 2, 7, 100, 17]
        inputs = [torch.randn(n, 64) for n in sizes]
    elif name == "cnn":
        model, batch = ConvNet(), 32 if gpu else 4
        sizes = [32, 40, 48] if quick else [32, 40, 48, 56, 64, 72]
        inputs = [torch.randn(batch, 3, n, n) for n in sizes]
    else:
        width, batch = (256, 8) if gpu else (64, 2)
        model = Block(width, heads=4)
        sizes = [16, 24, 40] if quick else [16, 24, 32, 40, 48, 64, 80, 96]
        inputs = [torch.randn(batch, n, width) for n in sizes]
    model = model.eval().to(settings.device)
    return model, [x.to(settings.device) for x in inputs]


def run_sized(
    name: str, compiler: str, model: nn.Module, inputs: list[torch.Tensor], settings: Settings
) -> tuple[Row, list[torch.Tensor]]:
    """One compiler over every size: first pass, then the median of ``passes`` passes."""
    row, device = Row(name, compiler), settings.device
    model = copy.deepcopy(model)
    with counting(row, compiler, settings), torch.no_grad():
        runner = compiled(compiler, model)
        outputs, row.first_s = timed(lambda: [runner(x) for x in inputs], device)
        row.programs_first = len(row.programs)
        samples = [
            timed(lambda: [runner(x) for x in inputs], device)[1] for _ in range(settings.passes)
        ]
        row.steady_ms = statistics.median(samples) * 1e3
    return row, outputs


def difference(outputs: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> str:
    """The largest absolute difference, ``FAIL`` when above float32 rounding of the values."""
    worst, scale = 0.0, 1.0
    for got, want in zip(outputs, expected, strict=True):
        worst = max(worst, (got.double() - want.double()).abs().max().item())
        scale = max(scale, want.double().abs().max().item())
    text = f"{worst:.1e}"
    return text if worst <= 1e-3 * scale else f"FAIL {text}"


# -- generation ---------------------------------------------------------------------------


def gpt2(settings: Settings) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    shape = (
        {"n_layer": 12, "n_head": 12, "n_embd": 768}
        if settings.gpt2_size == "small"
        else {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 1000, "n_positions": 256}
    )
    # No token ends generation early: every call makes exactly max_new_tokens.
    config = GPT2Config(**shape, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval().to(settings.device)
    return model.to(torch.bfloat16) if settings.device.type == "cuda" else model


def generate_options(cache: str, tokens: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    options: dict[str, Any] = {"max_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        options["cache_implementation"] = "static"
    if hasattr(GenerationConfig(), "disable_compile"):
        # On CUDA transformers would torch.compile a static-cache forward itself.
        options["disable_compile"] = True
    return options


def run_generate(
    name: str, compiler: str, model: nn.Module, ids: torch.Tensor, cache: str, settings: Settings
) -> tuple[Row, torch.Tensor]:
    """A warm-up ``generate`` (the first pass), then the median of ``passes`` more."""
    row, device = Row(name, compiler), settings.device
    tokens = generation_tokens(settings)
    options = generate_options(cache, tokens)
    options["attention_mask"] = torch.ones_like(ids)
    model = copy.deepcopy(model)
    with counting(row, compiler, settings), torch.no_grad():
        model.forward = compiled(compiler, model.forward)
        ids_out, row.first_s = timed(lambda: model.generate(ids, **options), device)
        row.programs_first = len(row.programs)
        samples = [
            timed(lambda: model.generate(ids, **options), device)[1] for _ in range(settings.passes)
        ]
        row.steady_ms = statistics.median(samples) * 1e3
        row.per_token_ms = row.steady_ms / tokens
    return row, ids_out


def generation_tokens(settings: Settings) -> int:
    if settings.device.type == "cuda":
        return 16 if settings.quick else 128
    return 8 if settings.quick else 40


def same_ids(got: torch.Tensor, want: torch.Tensor, prompt: int) -> str:
    """Whether the ids equal eager's. In bfloat16, greedy decoding of random weights meets
    near-ties that any change in rounding flips (torch.compile's ids differ too), so a
    difference is reported there, not failed."""
    if got.shape == want.shape and torch.equal(got, want):
        return "ids equal"
    if got.shape != want.shape:
        return f"FAIL shape {tuple(got.shape)}"
    column = int((got != want).any(dim=0).nonzero()[0])
    verdict = "differ" if got.device.type == "cuda" else "FAIL ids differ"
    return f"{verdict} from new token {column - prompt}"


# -- compilers and their counters ---------------------------------------------------------


def compiled(compiler: str, fn: Any) -> Any:
    if compiler == "eager":
        return fn
    if compiler == "kiln":
        return kiln.compile(fn)
    if compiler == "kiln dynamic=True":
        return kiln.compile(fn, dynamic=True)
    return torch.compile(fn)


@contextmanager
def counting(row: Row, compiler: str, settings: Settings) -> Iterator[None]:
    """Run one compiler from empty caches and counters; fill ``row``'s counters after."""
    kiln.reset()
    torch._dynamo.reset()  # (which keeps Dynamo's counters and compilation metrics)
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.clear_compilation_metrics()
    use_fresh_kiln_cache(settings.caches)
    listen(row.programs, CompiledProgramRecord)
    try:
        yield
    finally:
        unlisten(row.programs)
        if compiler.startswith("kiln"):
            kiln_counters(row)
        elif compiler == "torch.compile":
            torch_counters(row)


def kiln_counters(row: Row) -> None:
    counters = kiln.counters
    row.captures, row.graphs = str(counters.captures), str(counters.graphs)
    row.recompiles, row.fallbacks = str(len(counters.recompiles)), str(len(counters.fallbacks))
    later = len(row.programs) - row.programs_first  # built by the steady passes
    row.backend_compiles = f"{row.programs_first}+{later}" if later else str(row.programs_first)
    row.reasons = [
        f"recompile {function}: {reason}"[:170] for function, reason in counters.recompiles
    ]
    row.reasons += [" ".join(f"fallback {record}".split())[:170] for record in counters.fallbacks]


def torch_counters(row: Row) -> None:
    from torch._dynamo import utils

    frames = utils.counters["frames"]
    row.captures = str(frames["ok"])
    row.graphs = str(utils.counters["stats"]["unique_graphs"])
    row.fallbacks = str(frames["total"] - frames["ok"])
    reasons = [m.recompile_reason for m in utils.get_compilation_metrics() if m.recompile_reason]
    row.recompiles = str(len(reasons))
    row.reasons = [" ".join(f"recompile {reason}".split())[:170] for reason in reasons]


def use_fresh_kiln_cache(root: str) -> None:
    """Point Kiln's kernel cache at a new empty folder, as Inductor's is: a first pass then
    builds every kernel. The files Kiln makes once per machine (its float32 matmul library
    choice, the native guard extension) are linked from the usual cache."""
    folder = tempfile.mkdtemp(prefix="kiln-", dir=root)
    for name in ("cpu_matmul.json", "guards"):
        if os.path.exists(os.path.join(USUAL_KILN_CACHE, name)):
            os.symlink(os.path.join(USUAL_KILN_CACHE, name), os.path.join(folder, name))
    kiln_config.cache_dir = folder


# -- the run ------------------------------------------------------------------------------


def run_workload(name: str, compilers: Sequence[str], settings: Settings) -> list[Row]:
    """Every compiler on one workload (eager first: its outputs are the reference)."""
    if name == "generate":
        return [
            row
            for batch in settings.batches
            for cache in ("dynamic", "static")
            for row in run_generation(batch, cache, compilers, settings)
        ]
    try:
        model, inputs = sized_workload(name, settings)
    except Exception as error:
        return [report(Row(name, "-", error=describe(error)))]
    rows, expected = [], None
    for compiler in compilers:
        row = guarded(
            name, compiler, lambda c=compiler: run_sized(name, c, model, inputs, settings)
        )
        if isinstance(row, tuple):
            row, outputs = row
            expected = outputs if compiler == "eager" else expected
            row.check = "-" if expected is None else difference(outputs, expected)
        rows.append(report(row))
    return rows


def run_generation(
    batch: int, cache: str, compilers: Sequence[str], settings: Settings
) -> list[Row]:
    name = f"generate {cache} bs{batch}"
    try:
        model = gpt2(settings)
    except Exception as error:
        return [report(Row(name, "-", error=describe(error)))]
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, 8)).to(settings.device)
    rows, expected = [], None
    for compiler in compilers:
        run = lambda c=compiler: run_generate(name, c, model, ids, cache, settings)
        row = guarded(name, compiler, run)
        if isinstance(row, tuple):
            row, out = row
            expected = out if compiler == "eager" else expected
            row.check = "-" if expected is None else same_ids(out, expected, ids.shape[1])
        rows.append(report(row))
    return rows


def guarded(name: str, compiler: str, run: Callable[[], Any]) -> Any:
    """``run()``, or a row that says how it failed."""
    try:
        return run()
    except Exception as error:
        traceback.print_exc(limit=-3)
        return Row(name, compiler, error=describe(error))


def describe(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:200]


def report(row: Row) -> Row:
    print(
        f"{row.workload} / {row.compiler}: {row.error or 'ok'}; first {row.first_s:.2f} s, "
        f"steady {row.steady_ms:.2f} ms, captures {row.captures}, check {row.check}",
        flush=True,
    )
    for reason in row.reasons:
        print(f"    {reason}", flush=True)
    return row


HEADERS = (
    "workload",
    "compiler",
    "captures",
    "graphs",
    "recompiles",
    "fallbacks",
    "backend compiles",
    "first pass s",
    "steady ms",
    "ms/token",
    "check",
)


def format_rows(rows: Sequence[Row]) -> str:
    def number(value: float, digits: int) -> str:
        return "-" if math.isnan(value) else f"{value:.{digits}f}"

    lines = ["| " + " | ".join(HEADERS) + " |", "|" + " --- |" * len(HEADERS)]
    for row in rows:
        if row.error:
            cells = [row.workload, row.compiler, f"ERROR {row.error}"]
        else:
            cells = [
                row.workload,
                row.compiler,
                row.captures,
                row.graphs,
                row.recompiles,
                row.fallbacks,
                row.backend_compiles,
                number(row.first_s, 2),
                number(row.steady_ms, 2),
                number(row.per_token_ms, 2),
                row.check,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(arguments: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--compilers", default=",".join(COMPILERS))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--gpt2-size", choices=("tiny", "small"), help="default: tiny on CPU")
    parser.add_argument("--batches", help="generate's batch sizes (default: 1; 1,8 on CUDA)")
    parser.add_argument("--passes", type=int, help="steady-state passes (default 5, quick 2)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and tokens")
    args = parser.parse_args(arguments)
    for option, known in (("workloads", WORKLOADS), ("compilers", COMPILERS)):
        unknown = set(getattr(args, option).split(",")) - set(known)
        if unknown:
            parser.error(f"--{option}: unknown {sorted(unknown)} (known: {', '.join(known)})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU on this machine")
    return args


def main(arguments: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if arguments is None else list(arguments)
    args = parse(arguments)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        use_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 workloads compare with eager
    torch.backends.cudnn.allow_tf32 = False
    settings = Settings(
        device=device,
        quick=args.quick,
        passes=args.passes or (3 if args.quick else 5),
        gpt2_size=args.gpt2_size or ("small" if gpu else "tiny"),
        batches=[int(b) for b in (args.batches or ("1,8" if gpu else "1")).split(",")],
        caches=use_fresh_compiler_caches(),
    )
    compilers = ["eager", *(c for c in args.compilers.split(",") if c != "eager")]
    rows = [
        row for name in args.workloads.split(",") for row in run_workload(name, compilers, settings)
    ]
    command = " ".join(["benchmarks/dynamic_shapes.py", *map(shlex.quote, arguments)])
    print("\n" + format_header(environment(str(device), args.threads), command))
    print(f"- generate: GPT-2 {settings.gpt2_size}, {generation_tokens(settings)} new tokens\n")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
