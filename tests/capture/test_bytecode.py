"""kiln.capture's bytecode layer: decode/assemble round trips, resume functions, call routing.

The checks live in ``bytecode_versions.py`` so that interpreters without torch or pytest can
run them too: here they run in-process on the CI interpreter, and the same file is run as a
script on every other supported CPython found on this machine.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "bytecode_versions.py"


def _load_checks() -> list[Callable[[], str]]:
    spec = importlib.util.spec_from_file_location("kiln_bytecode_versions", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CHECKS)


CHECKS = _load_checks()


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])
def test_bytecode_layer(check: Callable[[], str]) -> None:
    check()


def _interpreter(version: str) -> str | None:
    """A working ``python<version>``: on PATH, or in a pyenv install (its shims may refuse)."""
    candidates = [f"python{version}"]
    root = os.path.expanduser("~/.pyenv/versions")
    candidates += sorted(glob.glob(f"{root}/{version}.*/bin/python{version}"), reverse=True)
    for candidate in candidates:
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0 and probe.stdout.strip() == str(
            tuple(map(int, version.split(".")))
        ):
            return candidate
    return None


OTHER_VERSIONS = [
    v for v in ("3.11", "3.12", "3.13") if v != f"{sys.version_info[0]}.{sys.version_info[1]}"
]


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_bytecode_layer_on_other_interpreters(version: str) -> None:
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no working python{version} on this machine")
    run = subprocess.run(
        [python, str(SCRIPT)], capture_output=True, text=True, timeout=600, cwd=HERE.parents[1]
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert f"{version}: {len(CHECKS)}/{len(CHECKS)} checks passed" in run.stdout
