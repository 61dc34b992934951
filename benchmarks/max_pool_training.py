"""Training step time of a torchvision model with max pooling, Kiln's max pool as now and as
before, interleaved in one process.

A differentiated max pool keeps each window's winning position (``max_pool_by_offsets`` in
``kiln/ops/translations/pooling.py``) and the partitioner saves what a window's recomputation
would read (``MAX_WINDOW_READS`` in ``kiln/autodiff/partition.py``); ``kiln-before`` compiles
the same model with both off: the separable decomposition, whose backward recomputed the
window's comparisons from the convolution output. Eager and torch.compile run beside them;
each compiler has its own copy of the model, and the rounds take one step of each in turn
(bf16 autocast on CUDA).

    PYTHONPATH=. python benchmarks/max_pool_training.py --model resnet18 --size 64 --batch 8 \
        [--device cpu] [--compilers eager,kiln,kiln-before,torch] [--rounds 9]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision

import kiln
from kiln.autodiff import partition
from kiln.ops.translations import pooling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compilers", default="eager,kiln,kiln-before")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    device = torch.device(arguments.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    base = getattr(torchvision.models, arguments.model)(num_classes=100)
    base = base.to(device, memory_format=torch.channels_last)
    x = torch.randn(arguments.batch, 3, arguments.size, arguments.size, device=device)
    x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (arguments.batch,), device=device)

    def autocast() -> Any:
        return torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()

    def step(model: Callable[..., Any], parameters: list[torch.nn.Parameter]) -> list[Any]:
        with autocast():
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        grads = [p.grad for p in parameters]
        for parameter in parameters:
            parameter.grad = None
        return grads

    steps: dict[str, Callable[[], list[Any]]] = {}
    first: dict[str, float] = {}
    grads: dict[str, list[Any]] = {}
    real_rule, real_window = partition._window_reads, pooling.MAX_OFFSET_WINDOW
    for compiler in arguments.compilers.split(","):
        model = copy.deepcopy(base)
        parameters = list(model.parameters())
        if compiler == "eager":
            run: Callable[..., Any] = model
        elif compiler == "torch":
            run = torch.compile(model)
        else:
            run = kiln.compile(model)
        before = compiler == "kiln-before"
        partition._window_reads = (lambda *_: False) if before else real_rule  # type: ignore[assignment]
        pooling.MAX_OFFSET_WINDOW = 0 if before else real_window
        try:
            sync()
            start = time.perf_counter()
            grads[compiler] = step(run, parameters)
            sync()
            first[compiler] = time.perf_counter() - start
        finally:
            partition._window_reads = real_rule
            pooling.MAX_OFFSET_WINDOW = real_window
        steps[compiler] = lambda run=run, parameters=parameters: step(run, parameters)
        print(f"# {compiler}: first step {first[compiler]:.1f} s", flush=True)
    for _ in range(3):
        for run_step in steps.values():
            run_step()
    samples: dict[str, list[float]] = {c: [] for c in steps}
    for _ in range(arguments.rounds):
        for compiler, run_step in steps.items():
            sync()
            start = time.perf_counter()
            run_step()
            sync()
            samples[compiler].append((time.perf_counter() - start) * 1e3)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"# {arguments.model} {arguments.batch}x3x{arguments.size}x{arguments.size} training, "
        f"{arguments.rounds} interleaved rounds; {name}, torch {torch.__version__}"
    )
    print("| compiler | ms/step (median) | min | / eager | first step s | max grad diff vs eager |")
    print("| --- | --- | --- | --- | --- | --- |")
    eager = statistics.median(samples["eager"]) if "eager" in samples else None
    for compiler, values in samples.items():
        median = statistics.median(values)
        ratio = f"{median / eager:.2f}" if eager else "-"
        diff = "-"
        if "eager" in grads and compiler != "eager":
            pairs = zip(grads[compiler], grads["eager"], strict=True)
            diff = f"{max((a.float() - b.float()).abs().max().item() for a, b in pairs):.2g}"
        print(
            f"| {compiler} | {median:.2f} | {min(values):.2f} | {ratio} | "
            f"{first[compiler]:.1f} | {diff} |"
        )
    for compiler, values in samples.items():
        print(f"# {compiler} samples: " + " ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
