"""What a call does during capture: inline, run natively, model, or break the graph.

Bottom to top: ``registry`` (the ``MODELS`` table and the ``call_function`` hook), ``native``
(what runs natively), ``inline`` (child frames, construction), ``iterate``, ``attributes``,
``modules`` (``nn.Module`` calls), ``autograd_function`` (``Function.apply``), ``routing``
(compiled callees at a break), ``dispatch`` (``call_function``: the policy), and the models
``builtins``, ``higher_order`` and ``operators`` (a user class's Python dunders inlined)
above it. Imports ``core`` and ``guards``; never
``handlers`` or ``driver``.
"""

# The models of builtins and higher-order torch functions register themselves in
# ``registry.MODELS`` (and ``dispatch`` installs ``registry.call_function``) when imported:
# importing any part of the calls layer makes the whole layer ready.
from kiln.capture.calls import builtins, higher_order, operators

__all__ = ["builtins", "higher_order", "operators"]
