"""``mode="max-autotune"`` on a GPU: each model's results against eager, its autotune lines,
the time a call takes with the heuristic's and with the tuned launch shapes, and (``--again``,
a second process on the same cache) that a warm cache measures nothing.

    python benchmarks/autotune_check.py [--cache DIR] [--again]

Seen on one H200 (PyTorch 2.11, Triton 3.6, 2026-11-27): all five equal eager (the in-place
input too); 51 candidates measured in 0.6 s; the kernels' own times moved little against the
heuristic's (softmax and layer norm kept it or a near tie, GELU 2^24 took XBLOCK 512 over 1024,
the column sum's looped kernel 27.0 us with 8 warps); the second process measured nothing.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import torch

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.config import config
from kiln.recording import recording
from kiln.runtime import autotune


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float() * 2, dim=-1).to(x.dtype)


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 1.5


def _column_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=0)


def _update(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x.add_(y.sum(dim=-1, keepdim=True))
    return x * 2


def _cases() -> list[tuple[str, Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    cuda = {"device": "cuda"}
    return [
        (
            "softmax 4096x1000 bf16",
            _softmax,
            (torch.randn(4096, 1000, dtype=torch.bfloat16, **cuda),),
        ),
        ("layer_norm 8192x4096", _layer_norm, (torch.randn(8192, 4096, **cuda),)),
        ("gelu 2^24", _gelu, (torch.randn(1 << 24, **cuda),)),
        ("column sum 4096x4096", _column_sum, (torch.randn(4096, 4096, **cuda),)),
        (
            "in-place update 1024x2000",
            _update,
            (torch.randn(1024, 2000, **cuda), torch.randn(1024, 2000, **cuda)),
        ),
    ]


def _time(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="")
    parser.add_argument("--again", action="store_true")
    arguments = parser.parse_args()
    config.cache_dir = arguments.cache or tempfile.mkdtemp(prefix="kiln-autotune-")
    measured: list[str] = []
    measure = autotune.measure

    def counted(name: str, run: Callable[[], None], device: torch.device) -> float:
        measured.append(name)
        return measure(name, run, device)

    autotune.tuning.timer = counted
    for name, fn, inputs in _cases():
        fresh = [t.clone() for t in inputs]
        expected = fn(*[t.clone() for t in inputs])
        expected_inputs = [t.clone() for t in inputs]
        fn(*expected_inputs)
        with recording(CompiledProgramRecord) as records:
            tuned_fn = kiln.compile(fn, mode="max-autotune")
            result = tuned_fn(*fresh)
        torch.testing.assert_close(result, expected, atol=2e-2, rtol=2e-2)
        for got, want in zip(fresh, expected_inputs, strict=True):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        print(f"== {name}: results equal eager's (inputs too)")
        for line in records[-1].kernel_lines():
            if "autotune" in line:
                print("  ", line)
        if fn is not _update:
            plain = kiln.compile(fn)
            heuristic = _time(lambda: plain(*inputs))  # noqa: B023
            tuned = _time(lambda: tuned_fn(*inputs))  # noqa: B023
            print(f"   call: heuristic {heuristic:.1f} us, tuned {tuned:.1f} us")
    print(f"measured candidates: {len(measured)}; spent {autotune.tuning.spent_s:.2f} s")
    if arguments.again:
        assert not measured, "a warm cache measured again"
        print("warm cache: nothing measured")


if __name__ == "__main__":
    main()
