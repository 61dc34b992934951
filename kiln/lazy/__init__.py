"""``kiln.lazy``: lazy tensors, for programs bytecode capture cannot take (the Lazy Tensor
design: record ops, compile at a step boundary).

Tensors moved with :func:`to_lazy` record every torch call into a Kiln graph instead of running
it; :func:`mark_step` compiles the graph recorded since the last step (once per structure: a
training loop's steps share one compiled graph) and runs it. Reading a value (``.item()``,
``print``, ``bool`` in an ``if``, :func:`to_eager`) first runs the work that value depends on
(a graph of its own, cached the same way; the step stays pending). ``backward()`` and an
optimizer's update are recorded too::

    model = kiln.lazy.to_lazy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        loss = F.mse_loss(model(kiln.lazy.to_lazy(x)), kiln.lazy.to_lazy(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        kiln.lazy.mark_step()
    kiln.lazy.counters   # LazyCounters(compiles=1, cache_hits=9, steps=10, syncs=0, ...)
    print(kiln.lazy.explain())  # the last step's graph, its hash, compiled or cache hit

Known limits: work a value read ran runs again in the step (its graph computes only the
step's results); views are materialized as their own data at a step (they no longer alias
their base across steps); ``backward()`` must come before the ``mark_step`` of its loss;
Python numbers are constants of a step's graph, so one that changes every step (Adam's bias
corrections, a learning-rate schedule) makes every step compile (``KILN_LOG=lazy`` logs
each compile).
"""

from kiln.lazy.step import LazyCounters, StepReport, counters
from kiln.lazy.step import cache as _cache
from kiln.lazy.tensor import LazyTensor, mark_step, to_eager, to_lazy


def explain() -> StepReport | None:
    """The last step run: its graph, structural hash, and whether it was a cache hit."""
    return _cache.last


def reset() -> None:
    """Run the pending step (no value is lost), then forget compiled steps and zero the
    counters."""
    mark_step()
    _cache.compiled.clear()
    _cache.last = None
    counters.reset()


__all__ = [
    "LazyCounters",
    "LazyTensor",
    "StepReport",
    "counters",
    "explain",
    "mark_step",
    "reset",
    "to_eager",
    "to_lazy",
]
