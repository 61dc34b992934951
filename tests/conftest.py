"""Shared test configuration: the ``--update-golden`` flag that regenerates golden files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests capture from scratch (they count captures) and must not fill the user's artifact cache;
# tests/capture/test_artifact_cache.py turns it on with a temporary cache directory. Set before
# Kiln is imported, and inherited by the processes tests start.
os.environ["KILN_ARTIFACT_CACHE"] = "0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite golden files from current output"
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """``golden(path, text)``: compare ``text`` with the file, or rewrite it with the flag."""
    update = request.config.getoption("--update-golden")

    def check(path: Path, text: str) -> None:
        if update or not path.exists():
            path.write_text(text)
            if not update:
                pytest.fail(f"golden file {path.name} was missing and has been written")
        assert text == path.read_text(), (
            f"{path.name} differs from the golden file (rerun with --update-golden if intended)"
        )

    return check


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Random inputs are fresh per test but reproducible: the seed comes from the test's id,
    so a failure seen in CI reruns identically here (``KILN_TEST_SEED`` shifts every seed)."""
    import os
    import zlib

    import torch

    base = int(os.environ.get("KILN_TEST_SEED", "0"))
    torch.manual_seed(base + zlib.crc32(request.node.nodeid.encode()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The size of the codebase, printed after every run (CI shows it; the budget is checked
    by ``test_architecture.py``)."""
    from test_architecture import LINE_BUDGET, kiln_code_lines

    count = kiln_code_lines()
    terminalreporter.write_line(f"kiln/: {count} code lines (budget {LINE_BUDGET})")
