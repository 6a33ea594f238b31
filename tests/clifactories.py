"""Tiny models and broken factories for the command-line tests (``clifactories:tiny``)."""

from __future__ import annotations

import sys

from torch import nn

#: An attribute that is not a factory.
NOT_CALLABLE = 5


def tiny() -> nn.Module:
    """Takes inputs of shape (N, 3)."""
    return nn.Sequential(nn.Linear(3, 2))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 2))


def tokens() -> nn.Module:
    """Takes token ids below 10."""
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))


def chain() -> nn.Module:
    """40 layers deep: too tall for a PNG at a high dpi."""
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(40)])


def returns_42() -> int:
    return 42


def raises() -> nn.Module:
    raise RuntimeError("factory exploded")


def exits() -> nn.Module:
    sys.exit(0)


def interrupted() -> nn.Module:
    raise KeyboardInterrupt


class _ExitsInForward(nn.Module):
    def forward(self, x):
        sys.exit(3)


def exits_in_forward() -> nn.Module:
    return _ExitsInForward()
