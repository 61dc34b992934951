"""Kiln's own work leaves the user's random streams alone.

Capturing and compiling a graph may draw random numbers (probing a matmul library, sample
tensors for a layout check); eager PyTorch would not have drawn them between the user's own
random calls. :func:`preserved_random_state` puts the global CPU generator (and CUDA's, once
initialized) back as they were after such work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
