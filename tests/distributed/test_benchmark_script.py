"""``benchmarks/distributed.py`` (the 2-GPU script of issue 24), run here as it runs there but
on the CPU: torchrun with two gloo processes and a tiny GPT-2. Kiln's losses must be eager's,
with compiled graphs and no frame run uncompiled, and the overlap arithmetic must be right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import distributed  # noqa: E402


def run(*args: str) -> dict[str, object]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(ROOT / "benchmarks" / "distributed.py")]
    command += ["--device", "cpu", "--tiny", "--seq", "32", "--batch", "2", "--steps", "3"]
    command += ["--timed", "1", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(lines[0].removeprefix("RESULT ")))


def test_ddp_kiln_matches_eager(tmp_path: Path) -> None:
    eager = run("--compiler", "eager")
    kiln = run("--compiler", "kiln", "--bucket-cap-mb", "0.01", "--profile")
    assert kiln["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert kiln["kiln_graphs"] == 1 and kiln["kiln_fallbacks"] == [], kiln
    assert "comm_ms" in kiln
    results = tmp_path / "results.txt"
    results.write_text("".join(f"RESULT {json.dumps(r)}\n" for r in (eager, kiln)))
    table = distributed.table(str(results))
    assert table.splitlines()[-1].startswith("| ddp | kiln | whole |"), table


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["whole", "blocks"])
def test_fsdp2_kiln_matches_eager(scope: str) -> None:
    eager = run("--compiler", "eager", "--mode", "fsdp2")
    kiln = run("--compiler", "kiln", "--mode", "fsdp2", "--scope", scope)
    assert kiln["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert kiln["kiln_graphs"] >= 2, kiln


def test_hidden_communication() -> None:
    assert distributed.hidden([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == 5
    assert distributed.hidden([(0, 1), (5, 6)], [(1, 5)]) == 0
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 0, "dur": 4000},
            {"cat": "kernel", "name": "ampere_sgemm", "ts": 1000, "dur": 1000},
            {"cat": "kernel", "name": "triton_poi_fused", "ts": 3000, "dur": 2000},
        ]
    }
    line, numbers = distributed.overlap_line(trace)
    assert numbers == {"comm_ms": 4.0, "hidden_ms": 2.0, "hidden_pct": 50.0}, line
