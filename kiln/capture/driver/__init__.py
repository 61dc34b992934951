"""One capture end to end and what runs at call time: ``convert`` (capture a frame into a
cache entry), ``reconstruct`` and ``resume`` (the generated head code and resume functions),
``cache`` (compiled wrappers and the per-code cache) and ``explain``.

The top layer of ``kiln.capture``: it may import every layer below; nothing below imports it.
(Named ``driver`` rather than ``runtime`` so that it does not clash with ``kiln.runtime``.)
"""
