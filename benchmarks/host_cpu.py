"""Kiln's host time a step under ``mode="reduce-overhead"``, on a machine without a GPU: a
recorder that records and replays nothing stands in for CUDA graphs, so what is timed is the
host work a step (guard, head, runners, copies' bookkeeping, autograd) without device work.
For A/B runs of two Kiln trees in alternating processes (``PYTHONPATH=<tree>``):

    PYTHONPATH=$tree python benchmarks/host_cpu.py --model gpt2_32 --mode infer
    PYTHONPATH=$tree python benchmarks/host_cpu.py --bert-layers 12 --mode train

``--bert-layers N``: instead of a suite model, BERT's structure at width 64 (N layers, about
16 parameters a layer, 16 tokens): BERT-base's host work a step with little compute.

Prints the best of ``--rounds`` rounds of ``--steps`` steps, in microseconds a step. A training
step's eager loss runs for real on the CPU: pick a model whose loss is small (a suite
``*_tiny`` model) to see Kiln's part.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.bench.worker import prepare
from kiln.capture.guards import native_guards
from kiln.runtime import cudagraphs


class NullRecorder:
    """Records by running once; replays by doing nothing."""

    def supports(self, tensor: torch.Tensor) -> str | None:
        return None

    def new_pool(self) -> Any:
        return []

    def capture(
        self, run: Callable[[], list[torch.Tensor]], pool: Any
    ) -> tuple[Callable[[], None], list[torch.Tensor]]:
        return (lambda: None), run()


def _narrow_bert(layers: int, mode: str) -> tuple[Any, tuple[torch.Tensor, ...], Any]:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = transformers.BertForMaskedLM(config).train(mode == "train")
    params = list(model.parameters())

    def step(run: Any, ids: torch.Tensor) -> torch.Tensor:
        if mode == "infer":
            with torch.no_grad():
                return run(ids).logits
        for param in params:
            param.grad = None
        loss = run(ids).logits.logsumexp(-1).mean()
        loss.backward()
        return loss.detach()

    return model, (torch.randint(0, 1000, (1, 16)),), lambda run, inputs: step(run, *inputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2_32")
    parser.add_argument("--mode", default="infer", choices=["infer", "train"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bert-layers", type=int, default=0)
    args = parser.parse_args()
    cudagraphs.RECORDER = NullRecorder()
    torch.set_num_threads(1)
    if args.bert_layers:
        model, inputs, step = _narrow_bert(args.bert_layers, args.mode)
        args.model = f"bert_{args.bert_layers}x64"
    else:
        model, inputs, step = prepare(args.model, args.mode, torch.device("cpu"), torch.float32)
    compiled = kiln.compile(model, mode="reduce-overhead")
    for _ in range(8):  # (warm-up, recording, and the replays before results are lent)
        step(compiled, inputs)
    native_guards.wait(timeout=120)
    gc.collect()
    gc.disable()
    best = float("inf")
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            step(compiled, inputs)
        best = min(best, (time.perf_counter() - start) / args.steps)
    states = "; ".join(status.line() for status in cudagraphs.statuses())
    print(f"{args.model} {args.mode}: {best * 1e6:.0f} us a step (host only) [{states}]")


if __name__ == "__main__":
    main()
