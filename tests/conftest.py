"""Shared test configuration: the ``--update-golden`` flag that regenerates golden files."""

from __future__ import annotations

from pathlib import Path

import pytest


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
