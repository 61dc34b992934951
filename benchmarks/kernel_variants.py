"""Launch-shape sweep of the reduction kernels of ``benchmarks/kernels.py``'s fused cases: each
persistent-reduction kernel Kiln generates for a case, rebuilt with other rows per program
(``XBLOCK``) and warps, and with its row loads moved ahead of gathered loads ("rows first"),
timed alone on the arguments of a real call (Triton's ``do_bench``, L2 flushed) and checked
against the default build's outputs. Bandwidth is the kernel's own bytes (each argument
tensor read or written once) against a clone of the case's input.

    python benchmarks/kernel_variants.py [--cases cross_entropy,softmax] [--shape 16384x4096]

With ``--model`` it sweeps a suite model's looped reductions instead (a training step's
BatchNorm statistics and backward sums over channels-last columns): the ``--top`` slowest
looped reduction kernels of one default-mode step, each rebuilt with other column and row
blocks and warps (compiled together in the compile workers), timed and checked the same way.
Kernels that write what they read (running statistics) or gather are left out::

    python benchmarks/kernel_variants.py --model resnet50 --mode train --top 8
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.bench.kernels import make_cases
from kiln.bench.worker import prepare
from kiln.codegen.triton import Blocks, Form, choose_blocks, generate_triton
from kiln.recording import listen, unlisten
from kiln.runtime.triton_build import TritonLauncher, build_triton, build_triton_kernels
from kiln.schedule.loops import Kernel, Load, walk
from kiln.schedule.program import kernel_arguments


def _recorded_calls(case: Any) -> list[tuple[Kernel, tuple[Any, ...]]]:
    """Each kernel of one compiled call of ``case`` with the tensors it was launched on."""
    return _recorded(lambda: kiln.compile(case.fn)(*case.args))


def _recorded_step(model: str, mode: str) -> list[tuple[Kernel, tuple[Any, ...]]]:
    """Each kernel of a suite model's first compiled step (default mode) with the tensors it
    was launched on. A tensor's values may be a later kernel's, where the program reused its
    memory: the sweep compares variants with the default build on the same tensors, and
    leaves out kernels that gather, whose addresses depend on values."""
    module, inputs, step = prepare(model, mode, torch.device("cuda"))
    return _recorded(lambda: step(kiln.compile(module), inputs))


def _recorded(run: Callable[[], object]) -> list[tuple[Kernel, tuple[Any, ...]]]:
    """Each kernel the programs ``run()`` compiles, with the tensors of its first launch."""
    records: list[Any] = []
    arguments: dict[str, tuple[Any, ...]] = {}
    original = TritonLauncher.__call__

    def recording(self: TritonLauncher, *args: Any, seed: Any = None) -> None:
        arguments.setdefault(self.source.kernel_name, args)
        original(self, *args, seed=seed)

    listen(records, CompiledProgramRecord)
    TritonLauncher.__call__ = recording  # type: ignore[method-assign]
    try:
        run()
        torch.cuda.synchronize()
    finally:
        TritonLauncher.__call__ = original  # type: ignore[method-assign]
        unlisten(records)
    kernels = [k for r in records if r.program for k in r.program.kernels()]
    return [(k, arguments[k.name]) for k in kernels if k.name in arguments]


def _sweepable(kernel: Kernel) -> bool:
    """A looped reduction that writes nothing it reads and gathers nothing (run again and
    again on one call's tensors, it must compute the same thing)."""
    if not isinstance(kernel.xnumel, int) or not isinstance(kernel.rnumel, int):
        return False
    if choose_blocks(kernel, interpret=False).form is not Form.LOOPED:
        return False
    if {id(b) for b in kernel.reads()} & {id(s.buffer) for s in kernel.stores}:
        return False
    loads = [e for e in walk([s.value for s in kernel.stores]) if isinstance(e, Load)]
    return not any(e.offset.indirects() for e in loads)


def _looped_variants(kernel: Kernel) -> list[tuple[str, Any]]:
    """The default build, then looped column and row blocks of 1024-8192 elements with 4 or
    8 warps, and the persistent form where the rows fit one block."""
    out: list[tuple[str, Any]] = [("default", generate_triton(kernel, False))]
    rnumel, xnumel = int(kernel.rnumel), int(kernel.xnumel)  # (static: see _sweepable)
    rows = 1 << max(rnumel - 1, 0).bit_length()  # (a power of two, at least rnumel)
    for xblock in (16, 32, 64, 128):
        for rblock in (16, 32, 64, 128):
            if not 1024 <= xblock * rblock <= 8192 or xblock > 2 * xnumel:
                continue
            for warps in (4, 8):
                form = Form.PERSISTENT if rblock >= rows else Form.LOOPED
                blocks = Blocks(form, xblock, rblock if form is Form.LOOPED else rows, warps)
                kind = "p" if form is Form.PERSISTENT else "l"
                name = f"{kind} x{xblock} r{blocks.rblock} w{warps}"
                out.append((name, generate_triton(kernel, False, blocks=blocks)))
    return out


def rows_first(source: str) -> str:
    """``source`` with its loads that read along ``r`` and use no earlier value moved right
    after ``rindex`` is defined: they no longer wait behind a gather's dependent loads."""
    lines = source.split("\n")
    anchor = next(i for i, line in enumerate(lines) if line.strip().startswith("rindex ="))
    movable = [
        i
        for i, line in enumerate(lines)
        if i > anchor
        and re.match(r"\s+tmp\d+ = tl\.load\(", line)
        and "rindex" in line
        and not re.search(r"\(.*\btmp\d+\b", line.split("=", 1)[1])
    ]
    moved = [lines[i] for i in movable]
    kept = [line for i, line in enumerate(lines) if i not in set(movable)]
    return "\n".join(kept[: anchor + 1] + moved + kept[anchor + 1 :])


def _variants(kernel: Kernel) -> list[tuple[str, Any]]:
    default = choose_blocks(kernel, interpret=False)
    shapes = [(x, w) for x in (1, 2, 4) for w in (4, 8, 16)]
    out: list[tuple[str, Any]] = [("default", generate_triton(kernel, False))]
    for xblock, warps in shapes:
        if xblock * default.rblock > 32768 or xblock > kernel.xnumel:
            continue
        blocks = Blocks(Form.PERSISTENT, xblock, default.rblock, warps)
        source = generate_triton(kernel, False, blocks=blocks)
        out.append((f"x{xblock} w{warps}", source))
        moved = rows_first(source.source)
        if moved != source.source:
            out.append(
                (f"x{xblock} w{warps} rows first", dataclasses.replace(source, source=moved))
            )
    return out


def _outputs(kernel: Kernel, tensors: tuple[Any, ...]) -> list[torch.Tensor]:
    stored = {id(s.buffer) for s in kernel.stores}
    pairs = zip(kernel_arguments(kernel), tensors, strict=False)  # a seed may follow
    return [t for b, t in pairs if id(b) in stored]


def _seconds(launcher: TritonLauncher, tensors: tuple[Any, ...]) -> float:
    from triton.testing import do_bench

    return float(do_bench(lambda: launcher(*tensors), warmup=25, rep=100, return_mode="median"))


def _sweep(
    case: str,
    kernel: Kernel,
    tensors: tuple[Any, ...],
    copy_rate: float,
    variants: list[tuple[str, Any]] | None = None,
) -> list[str]:
    """One table row per variant of ``kernel``: microseconds and share of the copy's rate."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    expected: list[torch.Tensor] | None = None
    rows = []
    variants = variants or _variants(kernel)
    built = build_triton_kernels([v for _, v in variants], torch.device("cuda"))
    for (name, _), launcher in zip(variants, built, strict=True):
        try:
            if getattr(launcher, "precompile_error", None):
                raise RuntimeError(launcher.precompile_error)
            launcher(*tensors)
            torch.cuda.synchronize()
        except Exception as error:  # a shape Triton rejects (registers, shared memory)
            rows.append(f"| {case} | {kernel.name} | {name} | failed: {type(error).__name__} | |")
            continue
        outputs = [o.clone() for o in _outputs(kernel, tensors)]
        if expected is None:
            expected = outputs
        for got, want in zip(outputs, expected, strict=True):
            # another reduction order may move a 16-bit output by its last bit
            tolerance = 1e-5 if got.element_size() > 2 else 1.6e-2
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        seconds = _seconds(launcher, tensors) / 1e3
        share = nbytes / seconds / copy_rate
        rows.append(
            f"| {case} | {kernel.name} | {name} | {seconds * 1e6:.1f} | {100 * share:.0f}% |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="cross_entropy,softmax,layer_norm,rms_norm")
    parser.add_argument("--shape", default="16384x4096")
    parser.add_argument("--model", default="", help="sweep this suite model's reductions")
    parser.add_argument("--mode", default="train", choices=["infer", "train"])
    parser.add_argument("--top", type=int, default=8, help="--model: the slowest N kernels")
    args = parser.parse_args()
    if args.model:
        _sweep_model(args.model, args.mode, args.top)
        return
    rows, cols = (int(n) for n in args.shape.split("x"))
    device = torch.device("cuda")
    cases = make_cases(rows, cols, torch.bfloat16, device)
    source = cases[0].args[0]
    copy_s = do_bench(source.clone, warmup=25, rep=100, return_mode="median") / 1e3
    copy_rate = 2 * source.numel() * source.element_size() / copy_s
    table = ["| case | kernel | variant | us | share of copy |", "| --- | --- | --- | --- | --- |"]
    for prefix in args.cases.split(","):
        case = next(c for c in cases if c.name.startswith(prefix))
        for kernel, tensors in _recorded_calls(case):
            if choose_blocks(kernel, interpret=False).form is Form.PERSISTENT:
                table += _sweep(case.name, kernel, tensors, copy_rate)
    print(f"\ncopy: {copy_rate / 1e9:.0f} GB/s ({copy_s * 1e6:.1f} us for {args.shape} bf16)")
    print("\n".join(table))


def _sweep_model(model: str, mode: str, top: int) -> None:
    from triton.testing import do_bench

    calls = [(k, t) for k, t in _recorded_step(model, mode) if _sweepable(k)]
    probe = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")
    copy_s = do_bench(probe.clone, warmup=25, rep=100, return_mode="median") / 1e3
    copy_rate = 2 * probe.numel() * probe.element_size() / copy_s
    del probe
    timed = []
    for kernel, tensors in calls:
        launcher = build_triton(generate_triton(kernel, False))
        timed.append((_seconds(launcher, tensors), kernel, tensors))
    timed.sort(key=lambda entry: -entry[0])
    table = ["| model | kernel | variant | us | share of copy |", "| --- | --- | --- | --- | --- |"]
    best = [
        "| kernel | x < | r < | default us | best | best us |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for _, kernel, tensors in timed[:top]:
        rows = _sweep(model, kernel, tensors, copy_rate, _looped_variants(kernel))
        table += rows
        measured = [
            (float(r.split("|")[4]), r.split("|")[3].strip()) for r in rows if "failed" not in r
        ]
        if measured:
            default = next(us for us, name in measured if name == "default")
            us, name = min(measured)
            sizes = f"{kernel.xnumel} | {kernel.rnumel}"
            best.append(f"| {kernel.name} | {sizes} | {default:.1f} | {name} | {us:.1f} |")
    print(f"\ncopy: {copy_rate / 1e9:.0f} GB/s")
    print("\n".join(table))
    print()
    print("\n".join(best))


if __name__ == "__main__":
    main()
