"""The exception hierarchy.

Every error fxnx raises on purpose is an :class:`FxnxError`. Each subclass also
subclasses the builtin that fits, so ``except TypeError`` keeps working for
callers that do not know fxnx.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

__all__ = [
    "CaptureError",
    "ConcurrentUseError",
    "FxnxError",
    "FxnxTypeError",
    "FxnxValueError",
    "GraphContractError",
    "GraphFileError",
    "ShapePropagationError",
    "UnsafePickleError",
]


class FxnxError(Exception):
    """Base class of every error fxnx raises on purpose."""


class FxnxTypeError(FxnxError, TypeError):
    """An argument of the wrong type: the message names it and what was expected."""


class FxnxValueError(FxnxError, ValueError):
    """An argument of the right type but an unusable value."""


class GraphContractError(FxnxValueError):
    """A graph breaks the graph contract (docs/graph.md).

    The message names the graph, node or edge attribute, what was expected and
    what it holds.
    """


class CaptureError(FxnxError, RuntimeError):
    """The model could not be turned into an fx graph (tracing failed).

    The message names the source line that stopped tracing and what to do about it.
    """


class ConcurrentUseError(FxnxError, RuntimeError):
    """Another thread ran the model while fxnx captured it, so the capture may hold its calls."""


class GraphFileError(FxnxError, ValueError):
    """A graph file is truncated, corrupt, not an fxnx graph, or from a newer fxnx."""


class UnsafePickleError(GraphFileError):
    """A pickle asked for something graph files never contain; nothing in it was run."""


class ShapePropagationError(FxnxError, ValueError):
    """Running the example inputs through the traced graph failed at one node.

    The message names the node, its target and the shapes it received.
    """


class GraphvizNotFoundError(FxnxError, ImportError):
    """Graphviz's ``dot`` program, needed for PNG, SVG and PDF, is not installed."""


class PandasNotFoundError(FxnxError, ImportError):
    """pandas, needed by :func:`~fxnx.frames.to_frames`, is not installed."""


def first_line(err: BaseException, limit: int = 400) -> str:
    """The first line of an exception's message, at most ``limit`` characters.

    torch's tracing errors can run to megabytes (whole graphs); one line is what
    a summary of several failures needs.

    Examples
    --------
    >>> first_line(ValueError("bad shape\\nlong details"))
    'bad shape'
    """
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else "(no message)"


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, pointing at the caller's own line rather than at fxnx's internals or torch's
    (``router(x)`` runs fxnx inside ``nn.Module.__call__``)."""
    level = 2  # warn_user's caller; then up to the first frame outside fxnx and torch
    caller: types.FrameType | None = sys._getframe(1)
    while caller is not None and (
        os.path.abspath(caller.f_code.co_filename).startswith(_PACKAGE)
        or str(caller.f_globals.get("__name__", "")).startswith("torch.")
    ):
        caller, level = caller.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


# Each exception's public home is fxnx.errors: tracebacks and reprs name it there.
for _error in (FxnxError, FxnxTypeError, FxnxValueError, GraphContractError, CaptureError,
               ConcurrentUseError, GraphFileError, UnsafePickleError, ShapePropagationError,
               GraphvizNotFoundError, PandasNotFoundError):
    _error.__module__ = "fxnx.errors"
