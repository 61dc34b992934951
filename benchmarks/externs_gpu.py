"""The extern calls of a compiled model on the GPU, with operand dtypes and shapes (which
matmuls run in which precision): ``python benchmarks/externs_gpu.py --model bert_base``."""

from __future__ import annotations

import argparse
import collections

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.models import MODELS
from kiln.recording import listen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bert_base")
    args = parser.parse_args()
    spec = MODELS[args.model]
    workload = spec.build(spec.batch)
    model = workload.model.cuda().eval()
    inputs = [t.cuda() for t in workload.make_input(torch.Generator().manual_seed(0))]
    records: list = []
    listen(records, CompiledProgramRecord)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        kiln.compile(model)(*inputs)
    counts: collections.Counter = collections.Counter()
    for record in records[-1:]:
        for call in record.program.externs():
            operands = tuple(
                f"{str(o.buffer.dtype).removeprefix('torch.')}{list(o.shape)}"
                for o in call.operands
                if hasattr(o, "buffer")
            )
            counts[(call.node.op.name, operands, call.node.origin.api)] += 1
    for key, count in counts.most_common():
        print(count, *key)


if __name__ == "__main__":
    main()
