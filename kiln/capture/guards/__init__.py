"""Where capture's values come from and what must stay true for a cache entry to be reused.

``sources`` (the access path of each value read from outside the frame), ``guards`` (checks on
those paths, compiled into one guard function) and ``native_guards`` (the same checks built as
a C extension). The bottom layer beside ``bytecode``: it imports nothing else of capture.
"""
