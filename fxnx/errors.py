"""The exceptions fxnx raises on purpose.

Every one is an :class:`FxnxError`, and each also subclasses the builtin it stands for
(``ValueError``, ``TypeError``, ``RuntimeError``, ``ImportError``), so code that catches
the builtin keeps working.
"""

from ._errors import (
    CaptureError,
    ConcurrentUseError,
    FxnxError,
    FxnxTypeError,
    FxnxValueError,
    GraphContractError,
    GraphFileError,
    GraphvizNotFoundError,
    PandasNotFoundError,
    ShapePropagationError,
    UnsafePickleError,
)

__all__ = [
    "CaptureError",
    "ConcurrentUseError",
    "FxnxError",
    "FxnxTypeError",
    "FxnxValueError",
    "GraphContractError",
    "GraphFileError",
    "GraphvizNotFoundError",
    "PandasNotFoundError",
    "ShapePropagationError",
    "UnsafePickleError",
]
