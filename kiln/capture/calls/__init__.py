"""What a call does during capture: inline, run natively, model, or break the graph.

``dispatch`` (``call_function``, the policy), with ``builtins`` and ``higher_order`` (models of
Python builtins and of torch functions taking user functions), ``modules`` (``nn.Module``
calls), ``autograd_function`` (``Function.apply``). Imports ``core``, ``guards`` and
``bytecode``; never ``handlers`` or ``driver``.
"""
