"""The garbage collector paused during compiles (kiln/collector.py): nested pauses share one
count, the collector comes back only after the outermost one, and a program that had turned it
off itself keeps it off."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import kiln
from kiln import collector


def test_nested_pauses_restore_the_collector_once() -> None:
    assert gc.isenabled()
    with collector.gc_paused():
        assert not gc.isenabled()
        with collector.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer compile is still running
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with collector.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_capture_and_the_backend_compile_run_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.backends.kiln import KilnProgram
    from kiln.capture.driver import cache

    seen: list[tuple[str, bool]] = []
    for owner, name in ((cache, "_compile_entry"), (KilnProgram, "_compile")):
        original = getattr(owner, name)

        def spy(*args: Any, _original: Any = original, _name: str = name) -> Any:
            seen.append((_name, gc.isenabled()))
            return _original(*args)

        monkeypatch.setattr(owner, name, spy)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2

    x = torch.randn(5)
    torch.testing.assert_close(kiln.compile(f)(x), x.sin() * 2)
    assert seen == [("_compile_entry", False), ("_compile", False)]
    assert gc.isenabled()
