"""fxnx: PyTorch models as NetworkX graphs of their real dataflow.

>>> import fxnx, torch
>>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()), torch.zeros(1, 3))
>>> [n for n in G]
['input_1', '_0', '_1', 'output']

The names that need torch (``convert``, ``capture``, …) load on first use, so
``import fxnx`` and everything that reads graph files work without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import FORMAT_VERSION, __version__
from .analysis import (
    MERGE_TARGETS,
    SkipConnection,
    census,
    format_summary,
    skip_connections,
    summary,
    topological_order,
)
from .errors import (
    CaptureError,
    FxnxError,
    FxnxTypeError,
    FxnxValueError,
    ShapePropagationError,
)
from .io import GraphFileError, UnsafePickleError, read_pickle, write_pickle

if TYPE_CHECKING:
    from .dataflow import convert, graph_from_capture
    from .tracing import Capture, capture

__all__ = [
    "Capture",
    "CaptureError",
    "FORMAT_VERSION",
    "FxnxError",
    "FxnxTypeError",
    "FxnxValueError",
    "GraphFileError",
    "MERGE_TARGETS",
    "ShapePropagationError",
    "SkipConnection",
    "UnsafePickleError",
    "__version__",
    "capture",
    "census",
    "convert",
    "format_summary",
    "graph_from_capture",
    "read_pickle",
    "skip_connections",
    "summary",
    "topological_order",
    "write_pickle",
]

# Public names that import torch, and the module each lives in.
_LAZY = {
    "convert": "dataflow",
    "graph_from_capture": "dataflow",
    "Capture": "tracing",
    "capture": "tracing",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxnx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
