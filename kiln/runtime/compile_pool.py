"""Persistent Triton compile workers: processes running ``triton_worker.py --serve``.

Triton's frontend is Python and holds the GIL, so threads compile one kernel at a time;
processes compile in parallel. A process costs its start-up (Python, Triton, and its first
compile initializing LLVM), so the pool starts once, when the first CUDA graph begins
compiling (:func:`start`), and that start overlaps scheduling; it then serves every later
compilation of the process. Each worker handles one job at a time: a dispatcher thread per
worker takes the next job from a shared queue, sends it as one JSON line, reads one line back,
then runs the job's ``then`` callback (the parent loads the kernel while the other workers
compile). A worker that fails to start or dies leaves its dispatcher running the callbacks
alone, which compile in the parent as before.

Measured on the H100 (cold caches, ``benchmarks/compile_stages.py``, one machine): ResNet-50
inference's first call 5.15 s on 8 threads against 2.99 s with 16 warmed-up workers, GPT-2's
3.97 against 2.67 s; 8 or 4 workers, or no warm-up compile, fell in between.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from kiln.config import config, logger

MAX_WORKERS = 16
WORKER = Path(__file__).with_name("triton_worker.py")

_log = logger("kernels")
_lock = threading.Lock()
_pool: Pool | None = None

Job = dict[str, Any]


class Pool:
    """``size`` worker processes and one dispatcher thread each."""

    def __init__(self, size: int, target: dict[str, Any] | None = None) -> None:
        self.jobs: queue.Queue[tuple[Job, Callable[[str], str], concurrent.futures.Future[str]]]
        self.jobs = queue.Queue()
        self.processes: list[subprocess.Popen[str]] = []
        self.answers: list[dict[str, Any]] = []  # the workers' timings, for the log
        self.pid = os.getpid()
        # Spawned from a thread: each fork and exec of a process holding torch and a CUDA
        # context takes a while, and the caller goes on capturing meanwhile.
        self._spawner = threading.Thread(
            target=self._spawn, args=(size, target), name="kiln-compile-spawner", daemon=True
        )
        self._spawner.start()

    def _spawn(self, size: int, target: dict[str, Any] | None) -> None:
        spawned = str(time.time())
        for index in range(size):
            try:
                process = subprocess.Popen(
                    [sys.executable, str(WORKER), "--serve", spawned, json.dumps(target)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    bufsize=1,
                )
            except OSError as error:
                _log.info("compile worker %d did not start: %s", index, error)
                continue
            self.processes.append(process)
            name = f"kiln-compile-{index}"
            threading.Thread(target=self._dispatch, args=(process,), name=name, daemon=True).start()
        if not self.processes:  # nothing serves the queue: the jobs compile here
            threading.Thread(target=self._dispatch, args=(None,), daemon=True).start()

    def submit(self, job: Job, then: Callable[[str], str]) -> concurrent.futures.Future[str]:
        """Compile ``job`` in a worker, then call ``then(error or "")`` on the dispatcher
        thread; the future holds what ``then`` returns."""
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.jobs.put((job, then, future))
        return future

    def _dispatch(self, process: subprocess.Popen[str] | None) -> None:
        alive = process is not None
        while True:
            job, then, future = self.jobs.get()
            error = "the compile worker exited"
            if alive and process is not None:
                answer, alive = _ask(process, job)
                error = str(answer.get("error", ""))
                if "seconds" in answer:  # the worker's own answer
                    self.answers.append(answer)
            try:
                future.set_result(then(error))
            except Exception as failure:  # the caller logs it
                future.set_exception(failure)

    def close(self) -> None:
        if self.pid != os.getpid():  # a forked child's copy: the workers are the parent's
            return
        self._spawner.join(timeout=30)
        for process in self.processes:
            if process.stdin is not None:
                with contextlib.suppress(OSError):  # a worker that died
                    process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()


def _ask(process: subprocess.Popen[str], job: Job) -> tuple[dict[str, Any], bool]:
    """Send ``job`` to ``process``; (its answer, whether the process still serves)."""
    stdin: IO[str] | None = process.stdin
    stdout: IO[str] | None = process.stdout
    try:
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(job) + "\n")
        stdin.flush()
        line = stdout.readline()
    except (OSError, ValueError) as error:
        return {"error": f"the compile worker failed: {error}"}, False
    if not line:
        return {"error": "the compile worker exited"}, False
    return dict(json.loads(line)), True


def timings(pool: Pool, since: int = 0) -> str:
    """The workers' start-up and compile times of the answers from ``since`` on, for the
    ``kernels`` log."""
    answers = pool.answers[since:]
    if not answers:
        return "no answers"
    ready = [a.get("ready", 0.0) for a in answers]
    seconds = sorted(a.get("seconds", 0.0) for a in answers)
    return (
        f"workers ready {min(ready):.2f}-{max(ready):.2f} s after their start; "
        f"{len(seconds)} jobs, median {seconds[len(seconds) // 2]:.2f} s, max {seconds[-1]:.2f} s"
    )


def size() -> int:
    """``KILN_COMPILE_WORKERS`` when it is a count, else one per core up to ``MAX_WORKERS``."""
    if config.compile_workers.isdigit():
        return max(1, int(config.compile_workers))
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def start(target: dict[str, Any] | None = None) -> Pool:
    """The process's pool, started on the first call (non-blocking: workers import Triton
    and, given the GPU ``target``, warm up its compiler while the caller goes on)."""
    global _pool
    with _lock:
        # A forked child (a data-loader worker) inherits the parent's pipes: it starts its own
        # pool rather than interleave messages with the parent's.
        if _pool is None or _pool.pid != os.getpid():
            _pool = Pool(size(), target)
            atexit.register(_pool.close)
        return _pool
