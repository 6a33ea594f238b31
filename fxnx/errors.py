"""The exception hierarchy.

Every error fxnx raises on purpose is an :class:`FxnxError`. Each subclass also
subclasses the builtin that fits, so ``except TypeError`` keeps working for
callers that do not know fxnx.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "FxnxError",
    "FxnxTypeError",
    "FxnxValueError",
    "ShapePropagationError",
]


class FxnxError(Exception):
    """Base class of every error fxnx raises on purpose."""


class FxnxTypeError(FxnxError, TypeError):
    """An argument of the wrong type: the message names it and what was expected."""


class FxnxValueError(FxnxError, ValueError):
    """An argument of the right type but an unusable value."""


class CaptureError(FxnxError, RuntimeError):
    """The model could not be turned into an fx graph (tracing failed).

    The message names the source line that stopped tracing and what to do about it.
    """


class ShapePropagationError(FxnxError, ValueError):
    """Running the example inputs through the traced graph failed at one node.

    The message names the node, its target and the shapes it received.
    """
