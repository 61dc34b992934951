"""The C++ kernels' lane loops vectorize: GCC leaves a loop scalar for reasons that change no
result (a branch its redundancy elimination made, a select of bytes on a block's flag), and
each cost a max pool 10-40x its time on the CPU. GCC's own report is the check."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

import kiln
from kiln.config import config
from kiln.runtime import cpp_build


def _lane_loops_left_scalar(source: Path) -> list[str]:
    """The lane loops (``for (int32_t xl``) of ``source`` GCC did not vectorize (but the
    one-line loops copying a block's flags, which GCC turns into ``memset`` instead)."""
    flags = [f for f in (*cpp_build.FLAG_PLANS[0], *cpp_build.COMMON_FLAGS) if f != "-shared"]
    flags = [f for f in flags if not f.startswith("-Wl,")]
    command = [cpp_build.COMPILER, *flags, "-c", "-o", "/dev/null", "-fopt-info-vec-optimized"]
    report = subprocess.run([*command, str(source)], capture_output=True, text=True, check=True)
    vectorized = {
        int(n) for n in re.findall(rf"{re.escape(source.name)}:(\d+):\d+: optimized", report.stderr)
    }
    lines = source.read_text().splitlines()
    scalar = []
    for start, text in enumerate(lines, start=1):
        if not text.lstrip().startswith("for (int32_t xl") or text.rstrip().endswith("}"):
            continue
        indent = text[: len(text) - len(text.lstrip())]
        end = next(n for n in range(start, len(lines) + 1) if lines[n - 1] == indent + "}")
        if not any(start <= line <= end for line in vectorized):  # (GCC names any line of it)
            scalar.append(f"{source.name}:{start}: {text.strip()}")
    return scalar


@pytest.mark.parametrize("size", [20, 56])
def test_max_pool_forward_and_backward_lane_loops_vectorize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A ResNet stem's ReLU and max pool over channels-last activations: every kernel's loop
    over the 64 channels vectorizes (before: the forward's, by a branch GCC's PRE made; the
    backward's, by a select of bytes on a row's padding flag, and at small sizes by the
    widening of its 32-bit addresses)."""
    monkeypatch.setattr(config, "debug_dir", str(tmp_path))
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    x = torch.randn(2, 64, size, size).to(memory_format=torch.channels_last).requires_grad_()
    out = kiln.compile(model)(x)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    want = model(x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(got, torch.autograd.grad(want, x, grad)[0])
    sources = sorted(tmp_path.rglob("*.cpp"))
    assert sources
    scalar = [loop for source in sources for loop in _lane_loops_left_scalar(source)]
    backward = [loop for loop in scalar if "_where_pad" in loop]
    assert scalar == backward, scalar  # the forward's loops vectorize
    if backward:
        # The backward by window positions (pooling.py:_max_pool_by_offsets) makes 18 masked
        # loads a lane, and GCC 12's data-ref analysis fails on them; it still ran ResNet-18's
        # CPU step faster than the vectorized separable backward (benchmarks/RESULTS.md).
        pytest.xfail(f"GCC leaves the max pool backward scalar: {backward}")
