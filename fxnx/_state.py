"""Running a model without leaving a trace on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["preserved"]


@contextlib.contextmanager
def preserved(model: Any) -> Iterator[None]:
    """Restore buffers (BatchNorm running stats, ``num_batches_tracked``) and the CPU random
    state when the block ends, so running the model inside it changes nothing the user sees.

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
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, old in zip(buffers, saved, strict=True):
                    buf.copy_(old)
