"""Kiln's benchmark harness: ``kiln bench``, the model suites and the microbenchmarks.

The pipeline of one ``kiln bench`` run::

    command.py   options -> checked Options (bad input: one line, exit 2)
    runner.py    per model x mode: eager, then each compiler cold and warm, one process each
    worker.py    in that process: build, compile + first call, check against eager, time
    table.py     rows -> environment header + Markdown table (or JSON)

Models and suites are in ``models.py`` (``reference``: TARGETS.md's four models;
``cpu``: small ones); clocks and memory meters in ``timing.py``; the correctness measure in
``compare.py``. The microbenchmarks -- fused memory-bound kernels (``kernels.py``) and the
per-call overhead of a cache hit plus GPT-2's capture time (``overhead.py``) -- run from
``benchmarks/kernels.py`` and ``benchmarks/overhead.py``; results live in
``benchmarks/RESULTS.md``.
"""
