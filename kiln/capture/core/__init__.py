"""The symbolic interpreter's state: frames, the session of one capture, breaks, iteration.

``frame`` (the instruction loop and the opcode registry ``HANDLERS``), ``session`` (graph,
guards, sources and side effects of one capture), ``breaks`` (graph-break reasons and
records), ``iteration`` (symbolic iterators, the items of containers) and ``contexts`` (the
torch context managers capture enters natively). Imports ``guards`` only; the layers above
fill ``HANDLERS``.
"""
