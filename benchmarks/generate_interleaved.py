"""Per-token ``generate`` time with the compilers interleaved: GPT-2 (``dynamic_shapes.py``'s
model, random weights, bf16 on CUDA), one copy of the model per compiler, each warmed up by two
generates, then ``--rounds`` rounds of one generate per compiler in turn. Prints the median
ms/token of each and its ratio to torch.compile's in the same mode.

A batch-1 decode step is host-bound: its time moves with the host's state within one process
(1.09-1.24x between runs of the sequential script), so each Kiln sample here has a
torch.compile sample taken moments before or after it.

    python benchmarks/generate_interleaved.py --batch 1 --cache static \
        --compilers eager,kiln,torch,kiln-ro,torch-ro [--rounds 7] [--tokens 64]

``kiln-ro``/``torch-ro``: ``mode="reduce-overhead"`` (CUDA graphs; torch.compile's with
``torch.compiler.cudagraph_mark_step_begin()`` before each call, which it needs here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dynamic_shapes as ds

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.recording import listen, unlisten


def compiled_forward(compiler: str, forward: Any) -> Any:
    if compiler == "eager":
        return forward
    if compiler in ("kiln", "kiln-ro"):
        return kiln.compile(forward, mode="reduce-overhead" if compiler == "kiln-ro" else None)
    if compiler == "torch":
        return torch.compile(forward)
    if compiler == "torch-ro":
        inner = torch.compile(forward, mode="reduce-overhead")

        def stepped(*args: Any, **kwargs: Any) -> Any:
            # Without it the second call raises: the cache update reads an output of the
            # previous replay (transformers marks steps only when it compiles the model itself).
            torch.compiler.cudagraph_mark_step_begin()
            return inner(*args, **kwargs)

        return stepped
    raise ValueError(f"unknown compiler {compiler!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", choices=("static", "dynamic"), default="static")
    parser.add_argument("--compilers", default="eager,kiln,torch")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    arguments = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = ds.Settings(device, False, 1, arguments.size, [arguments.batch], "")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    base = ds.gpt2(settings)
    torch.manual_seed(1)
    ids = torch.randint(0, base.config.vocab_size, (arguments.batch, 16), device=device)
    options: dict[str, Any] = ds.generate_options(arguments.cache, arguments.tokens)
    options["attention_mask"] = torch.ones_like(ids)
    compilers = arguments.compilers.split(",")
    models, first, outputs = {}, {}, {}
    programs: dict[str, list[object]] = {}
    with torch.no_grad():
        for compiler in compilers:
            programs[compiler] = []
            listen(programs[compiler], CompiledProgramRecord)  # (Kiln's, in its two generates)
            model = ds.gpt2(settings)
            model.load_state_dict(base.state_dict())
            model.forward = compiled_forward(compiler, model.forward)
            start = time.perf_counter()
            outputs[compiler] = model.generate(ids, **options)
            sync()
            first[compiler] = time.perf_counter() - start
            print(f"# {compiler}: first generate {first[compiler]:.1f} s", flush=True)
            model.generate(ids, **options)
            unlisten(programs[compiler])
            models[compiler] = model
        samples: dict[str, list[float]] = {c: [] for c in compilers}
        for _ in range(arguments.rounds):
            for compiler in compilers:
                sync()
                start = time.perf_counter()
                models[compiler].generate(ids, **options)
                sync()
                samples[compiler].append((time.perf_counter() - start) / arguments.tokens * 1e3)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"# GPT-2 {arguments.size}, bs{arguments.batch}, {arguments.cache} cache, "
        f"{arguments.tokens} new tokens, {arguments.rounds} interleaved rounds; {name}, "
        f"torch {torch.__version__}"
    )
    print(
        "| compiler | ms/token (median) | min | / torch.compile | first generate s | ids "
        "| Kiln programs compiled |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for compiler in compilers:
        median = statistics.median(samples[compiler])
        torch_name = "torch-ro" if compiler.endswith("-ro") else "torch"
        ratio = (
            f"{median / statistics.median(samples[torch_name]):.2f}"
            if torch_name in samples and compiler != torch_name
            else "-"
        )
        ids_check = ds.same_ids(outputs[compiler], outputs[compilers[0]], ids.shape[1])
        print(
            f"| {compiler} | {median:.2f} | {min(samples[compiler]):.2f} | {ratio} | "
            f"{first[compiler]:.1f} | {ids_check} (vs {compilers[0]}) | "
            f"{len(programs[compiler]) if compiler.startswith('kiln') else '-'} |"
        )
    for compiler in compilers:
        print(f"# {compiler} samples: " + " ".join(f"{s:.2f}" for s in samples[compiler]))


if __name__ == "__main__":
    main()
