"""A logger's call below its level does nothing in eager, and costs no graph break compiled
(``kiln/capture/calls/dispatch.py`` ``_log_disabled``); when the level changes, the call
logs as in eager."""

from __future__ import annotations

import io
import logging

import torch

import kiln

log = logging.getLogger("kiln.tests.user_code")
_stream = io.StringIO()
log.addHandler(logging.StreamHandler(_stream))
log.propagate = False


class _Counting(logging.Logger):
    calls = 0

    def debug(self, msg, *args, **kwargs):  # type: ignore[no-untyped-def]
        _Counting.calls += 1  # (its own method: runs even below the level)
        super().debug(msg, *args, **kwargs)


counting = _Counting("kiln.tests.counting")


def _logs(x: torch.Tensor) -> torch.Tensor:
    log.debug("input %s", tuple(x.shape))
    y = torch.relu(x) * 2
    log.log(5, "below debug")
    log.info("output ready")
    return y + 1


def test_a_call_below_the_level_costs_no_break_and_logging_follows_the_level() -> None:
    kiln.reset()
    log.setLevel(logging.WARNING)
    _stream.seek(0)
    _stream.truncate()
    compiled = kiln.compile(_logs)
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(compiled(x), _logs(x))
    assert _stream.getvalue() == ""
    report = kiln.explain(_logs, torch.randn(4))
    assert report.graph_count == 1 and not report.breaks, str(report)

    log.setLevel(logging.DEBUG)  # (logging empties the loggers' caches: the guard fails)
    try:
        x = torch.randn(4)
        torch.testing.assert_close(compiled(x), torch.relu(x) * 2 + 1)
        assert _stream.getvalue() == "input (4,)\noutput ready\n"
        assert kiln.explain(_logs, torch.randn(4)).breaks  # (now it logs: as eager, a break)
    finally:
        log.setLevel(logging.WARNING)


def _counts(x: torch.Tensor) -> torch.Tensor:
    counting.debug("never shown")
    return x * 3


def test_a_loggers_own_method_still_runs() -> None:
    kiln.reset()
    counting.setLevel(logging.WARNING)
    _Counting.calls = 0
    compiled = kiln.compile(_counts)
    for _ in range(3):
        x = torch.randn(2)
        torch.testing.assert_close(compiled(x), x * 3)
    assert _Counting.calls == 3
