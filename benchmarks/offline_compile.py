"""Compile a model's GPU Triton kernels for Hopper on a machine without a GPU: finds the kernels
a Triton version fails to compile before any device time is spent.

The model is scheduled as on the GPU (the passes' and the scheduler's device checks claimed,
as the CPU tests claim them), run once on the CPU with C++ kernels (a training step, so the
backward compiles too), and every kernel's GPU form is compiled for ``sm_90`` with its
pointers 16-byte aligned, as Triton specializes them at a real launch. Triton 3.6's layout
pass failed on three BatchNorm kernels of ResNet-50's backward this way, as on the H200
(until 6ac5e5e removed the sum those kernels failed on)::

    pip install --target /tmp/triton36 triton==3.6.0
    export PYTHONPATH=/tmp/triton36:.
    python benchmarks/offline_compile.py --model resnet50 --batch 64  # 0 of 368 fail
    python benchmarks/offline_compile.py --model resnet50 --batch 64 --reshaped  # 0 fail

Prints one line per kernel that fails, then a count.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench import worker
from kiln.bench.models import MODELS
from kiln.codegen.triton import generate_triton
from kiln.passes import reduction_split
from kiln.recording import listen
from kiln.schedule import inlining

POINTERS = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float64: "*fp64",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}


def claim_the_gpu() -> None:
    """Schedule as on the GPU: chunked channels-last statistics, the GPU's budgets."""
    reduction_split._chunks_columns = lambda value: True
    reduction_split._holds_channels_last = lambda value: True
    for name in ("STENCIL_LIMIT", "TRAFFIC_RECOMPUTE_LIMIT", "BROADCAST_STORE_COST"):
        if hasattr(inlining, name):  # (older trees lack some)
            gpu = getattr(inlining, name)[1]
            setattr(inlining, name, (gpu, gpu))


def compile_for_hopper(source: object, directory: Path) -> str | None:
    """Compile one generated source for sm_90; the error's last line, or None."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = directory / f"{source.name}.py"  # type: ignore[attr-defined]
    path.write_text(source.source)  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    function = getattr(module, source.name)  # type: ignore[attr-defined]
    dtypes = list(source.argument_dtypes)  # type: ignore[attr-defined]
    constexprs = dict(source.constexprs)  # type: ignore[attr-defined]
    signature: dict[str, str] = {}
    for position, name in enumerate(function.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif position < len(dtypes):
            signature[name] = POINTERS[dtypes[position]]
        else:
            signature[name] = "i64"  # (a seed pointer or a size)
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(function.arg_names)
        if signature[name].startswith("*")
    }
    options = {"num_warps": source.num_warps, "enable_fp_fusion": True}  # type: ignore[attr-defined]
    if getattr(source, "num_stages", 0):
        options["num_stages"] = source.num_stages  # type: ignore[attr-defined]
    ast = triton.compiler.ASTSource(
        fn=function, signature=signature, constexprs=constexprs, attrs=aligned
    )
    try:
        triton.compile(ast, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as error:  # (a compiler failure is what this script looks for)
        text = str(error).strip().splitlines()
        return text[-1] if text else type(error).__name__
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="train", choices=["infer", "train"])
    parser.add_argument("--batch", type=int, default=0, help="default: the suite's")
    parser.add_argument("--reshaped", action="store_true", help="the second form")
    args = parser.parse_args()
    claim_the_gpu()
    records: list[CompiledProgramRecord] = []
    listen(records, CompiledProgramRecord)
    spec = MODELS[args.model]
    torch.manual_seed(0)
    workload = spec.build(args.batch or spec.batch)
    model = workload.model.train(args.mode == "train")
    inputs = tuple(workload.make_input(torch.Generator().manual_seed(0)))
    step = worker._step(args.mode, torch.device("cpu"), torch.bfloat16, list(model.parameters()))
    step(kiln.compile(model, options={"codegen": "cpp"}), inputs)
    import triton

    directory = Path(tempfile.mkdtemp(prefix="kiln_offline_"))
    failed = total = 0
    for record in records:
        for kernel in record.program.kernels() if record.program else []:
            total += 1
            second: dict[str, Any] = {"reshaped": True} if args.reshaped else {}  # (older trees)
            source = generate_triton(kernel, interpret=False, **second)
            error = compile_for_hopper(source, directory)
            if error is not None:
                failed += 1
                print(f"{record.graph} {kernel.name}: {error} ({directory / source.name}.py)")
    print(f"Triton {triton.__version__}: {failed} of {total} kernels failed to compile for sm_90")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
