"""Running a model without leaving a trace on it."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["preserved", "random_state_kept"]


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Give back torch's CPU random state and Python's ``random`` state when the block ends
    (a forward that draws numbers, ``torch.rand(1)`` or ``random.random()``, draws them)."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(state)


@contextlib.contextmanager
def preserved(model: Any) -> Iterator[None]:
    """Restore buffers (BatchNorm running stats, ``num_batches_tracked``), torch's CPU random
    state and Python's ``random`` state when the block ends, so running the model inside it
    changes nothing the user sees; buffers nothing wrote are not touched at all.

    Examples
    --------
    >>> bn = nn.BatchNorm1d(2).train()
    >>> with preserved(bn):
    ...     _ = bn(torch.randn(4, 2) + 5)
    >>> bn.running_mean.tolist(), int(bn.num_batches_tracked)
    ([0.0, 0.0], 0)
    """
    buffers = list(model.buffers()) if isinstance(model, nn.Module) else []
    saved = [b.detach().clone() for b in buffers]
    with random_state_kept():
        try:
            yield
        finally:
            with torch.no_grad():
                # Only buffers whose values changed, and past autograd's version counter (as
                # BatchNorm's own update of its statistics is): a counted write would break a
                # backward of the user's that saved the buffer, though it gets back the very
                # values that backward saved.
                for buf, old in zip(buffers, saved, strict=True):
                    if not buf.is_meta and not torch.equal(buf, old):
                        buf.data.copy_(old)
