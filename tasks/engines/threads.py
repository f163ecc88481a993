"""Intra-op torch threads for an engine's forward passes (a context manager)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run torch ops with ``n`` intra-op threads (``n <= 0``: leave torch's setting),
    restoring the previous count after. Never changes a result of the engines here."""
    before = torch.get_num_threads()
    if n <= 0 or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
