"""``kiln explain SCRIPT.py [args]``: runs the script, then reports graphs, breaks, recompiles,
kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.cli import main

SCRIPT = """\
import sys
import torch
import kiln


@kiln.compile
def step(x):
    y = torch.relu(x) * 2
    print("halfway")
    return y.sum()


for n in (4, 4, 5):
    step(torch.randn(n))
print("args", sys.argv[1:])
"""


def test_explain_reports_graphs_breaks_and_recompiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train_step.py"
    script.write_text(SCRIPT)
    assert main(["explain", str(script), "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.count("halfway") == 3
    assert "args ['--steps', '3']" in out
    assert f"kiln explain: 2 compiled function(s) ran in {script}" in err
    assert "== step ==" in err
    assert "2 graph(s), 2 graph break(s)" in err
    assert "  graph 0: step, 3 nodes" in err  # relu (le, where), then mul
    assert f'IO in step at {script}:9: print("halfway")' in err
    assert "recompiles (1):" in err
    assert "compiled program(s), forward and backward graphs):" in err
    assert "k0_sum (x<1, r<4): sum  [train_step.py:10]" in err  # each kernel with its user line
    # the recompile at 5 made the length symbolic: one program for a range of lengths
    assert "k0_sum (x<1, r<s0): sum  [train_step.py:10]" in err
    assert "compiled for any sizes where" in err


def test_explain_script_errors_and_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failing = tmp_path / "failing.py"
    failing.write_text("raise ValueError('bad data')\n")
    assert main(["explain", str(failing)]) == 1
    err = capsys.readouterr().err
    assert "ValueError: bad data" in err
    assert "no kiln.compile'd function compiled" in err
    exiting = tmp_path / "exiting.py"
    exiting.write_text("import sys\nsys.exit(3)\n")
    assert main(["explain", str(exiting)]) == 3
