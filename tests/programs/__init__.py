"""Real programs, eager against compiled over several inputs (see ``harness.py``)."""
