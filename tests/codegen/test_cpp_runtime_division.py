"""``kiln_div``: the C++ kernels' division of an index by a size known only at run time (a
multiply and a shift, ``codegen/cpp_math.py``), against Python's floor division at the edges
where such schemes fail: divisors near powers of two, the largest int32 index."""

from __future__ import annotations

import ctypes
import random
import subprocess
from pathlib import Path

import pytest

from kiln.codegen import cpp_math
from kiln.runtime import cpp_build

pytestmark = pytest.mark.skipif(
    not cpp_build.cpp_compiler_available(), reason="no C++ compiler on PATH"
)

CHECK = r"""
extern "C" int64_t first_wrong(int64_t d, const int32_t* xs, int64_t count) {
  const kiln_divisor divisor = kiln_divisor_of(d);
  for (int64_t i = 0; i < count; ++i) {
    if (kiln_div(xs[i], divisor) != (int32_t)(xs[i] / d)) return i;
  }
  return -1;
}
"""


def test_runtime_division_is_floor_division(tmp_path: Path) -> None:
    source = tmp_path / "division.cpp"
    source.write_text(cpp_math.PRELUDE + CHECK)
    library = tmp_path / "division.so"
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    first_wrong = ctypes.CDLL(str(library)).first_wrong
    first_wrong.restype = ctypes.c_int64
    rng = random.Random(0)
    divisors = [*range(1, 300), *(2**k + o for k in range(1, 31) for o in (-1, 0, 1))]
    divisors += [rng.randrange(1, 2**31) for _ in range(300)]
    top = 2**31 - 1
    xs = [*range(0, 5000), *range(top - 5000, top + 1), *(rng.randrange(top) for _ in range(5000))]
    values = (ctypes.c_int32 * len(xs))(*xs)
    for d in divisors:
        wrong = first_wrong(ctypes.c_int64(d), values, ctypes.c_int64(len(xs)))
        assert wrong == -1, f"{xs[wrong]} // {d}"
