"""The bytecode toolkit: pure code-object work, version-neutral across CPython 3.11-3.13.

``decode`` (code object -> instructions whose jumps point at instructions), ``assembler``
(back to a code object) and ``rewrite`` (resume functions, routed calls). The bottom layer of
``kiln.capture``: it imports nothing else of capture, nor torch (it runs on interpreters that
have none).
"""
