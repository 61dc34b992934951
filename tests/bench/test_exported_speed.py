"""``benchmarks/exported_speed.py`` times its runners fairly: each right after each of the
others as often, in a child whose malloc keeps the memory a runner frees (glibc gave the heap's
top back to the OS after every eager step of bert_tiny, and the next runner, most often
``kiln.compile``, faulted 4 MB in again: 2 ms of its 5 ms)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import exported_speed  # noqa: E402

# Frees 100 MB of small blocks (the heap's top: more than glibc's largest automatic trim
# threshold, 64 MB), allocates and touches them again: prints the minor page faults of the
# second round (~25,000 when glibc trimmed the heap in between).
FAULTS = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def step():
    blocks = [libc.malloc(64 << 10) for _ in range(1600)]
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in reversed(blocks):
        libc.free(block)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_each_runner_follows_each_other_as_often() -> None:
    order = exported_speed.balanced_order(["eager", "compiled", "loaded"], rounds=4)
    assert Counter(order) == {"eager": 8, "compiled": 8, "loaded": 8}
    pairs = Counter(zip(order, order[1:] + order[:1], strict=True))
    assert len(pairs) == 6 and set(pairs.values()) == {4}, pairs


def test_child_env_keeps_other_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    env = exported_speed.child_env("/tmp/run")
    assert env["KILN_CACHE_DIR"] == os.path.join("/tmp/run", "cache")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + exported_speed.MALLOC_TUNABLES


def faults(env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not Path("/lib/x86_64-linux-gnu/libc.so.6").exists(), reason="not glibc")
def test_child_malloc_keeps_freed_memory_mapped() -> None:
    default = dict(os.environ)
    default.pop("GLIBC_TUNABLES", None)
    assert faults(default) > 20_000  # what the benchmark's runners paid after eager's step
    assert faults(exported_speed.child_env("/tmp/run")) < 1_000
