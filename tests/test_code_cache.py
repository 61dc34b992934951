"""Compiled code on disk (kiln/code_cache.py): a source compiles once per machine; a damaged
file is compiled over, never loaded; the cache is off with the artifact cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kiln
from kiln import code_cache
from kiln.config import config

SOURCE = "def twice(x):\n    return 2 * x\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(config, "artifact_cache", True)
    return tmp_path / "artifacts"


def _twice(code: object) -> object:
    scope: dict = {}
    exec(code, scope)
    return scope["twice"](21)


def test_a_source_compiles_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = code_cache.compiled(SOURCE, "<kiln test>")
    assert _twice(first) == 42 and len(list(cache.glob("c-*.kart"))) == 1

    def unexpected(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(code_cache, "compile", unexpected, raising=False)
    again = code_cache.compiled(SOURCE, "<kiln test>")
    assert _twice(again) == 42 and again.co_filename == "<kiln test>"
    other = code_cache.compiled(SOURCE, "<kiln other>")  # renamed, nested functions too
    nested = [c for c in other.co_consts if hasattr(c, "co_filename")]
    assert other.co_filename == "<kiln other>" and nested
    assert all(c.co_filename == "<kiln other>" for c in nested)


def test_a_damaged_file_is_compiled_over(cache: Path) -> None:
    code_cache.compiled(SOURCE, "<kiln test>")
    (path,) = cache.glob("c-*.kart")
    data = bytearray(path.read_bytes())
    for position in (3, len(data) // 2, len(data) - 1):  # magic, checksum, code
        damaged = bytearray(data)
        damaged[position] ^= 0xFF
        path.write_bytes(bytes(damaged))
        with pytest.warns(UserWarning, match="is damaged; rebuilding it"):
            assert _twice(code_cache.compiled(SOURCE, "<kiln test>")) == 42
        assert path.read_bytes() == bytes(data)  # written again whole
    path.write_bytes(data[:10])  # truncated
    with pytest.warns(UserWarning, match="is damaged"):
        assert _twice(code_cache.compiled(SOURCE, "<kiln test>")) == 42


def test_off_with_the_artifact_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "artifact_cache", False)
    assert _twice(code_cache.compiled(SOURCE, "<kiln test>")) == 42
    assert not cache.exists()


def test_compiled_functions_reuse_their_code(cache: Path) -> None:
    """Guards, heads and host programs of a compile are on disk; a second compile of the same
    function (a new process would) reads them and still computes the right thing."""
    kiln.reset()
    x = torch.randn(5, 3)
    kiln.compile(lambda t: torch.relu(t) * 3)(x)
    stored = {path.name for path in cache.glob("c-*.kart")}
    assert len(stored) >= 3  # guard, head, host program
    kiln.reset()
    y = torch.randn(5, 3)
    torch.testing.assert_close(kiln.compile(lambda t: torch.relu(t) * 3)(y), torch.relu(y) * 3)
    assert {path.name for path in cache.glob("c-*.kart")} == stored
    kiln.reset()
