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
    node_depths,
    scope_subgraph,
    short_name,
    skip_connections,
    summary,
    topological_order,
)
from .contract import (
    EDGE_ATTRIBUTES,
    GRAPH_ATTRIBUTES,
    NODE_ATTRIBUTES,
    Attribute,
    validate,
)
from .errors import (
    CaptureError,
    ConcurrentUseError,
    FxnxError,
    FxnxTypeError,
    FxnxValueError,
    GraphContractError,
    GraphFileError,
    ShapePropagationError,
    UnsafePickleError,
)
from .frames import PandasNotFoundError, cost_summary, cost_table, module_costs, to_frames
from .io import (
    atomic_write,
    read_json,
    read_pickle,
    write_graphml,
    write_json,
    write_pickle,
)
from .memory import MemoryProfile, memory_profile
from .paths import path_length_counts, path_length_credit
from .plot import plot_alignment, plot_census, plot_credit_by_depth
from .receptive import ReceptiveField, receptive_fields
from .render import Drawing, GraphvizNotFoundError, draw, to_pydot

if TYPE_CHECKING:
    from .capturing import FIXED_KWARGS, TRACING_LOCK, Capture, CaptureOptions, capture
    from .conversion import convert, graph_from_capture
    from .credit import (
        PRESETS,
        CreditResult,
        CreditRouter,
        DirectFeedbackAlignment,
        Exact,
        FeedbackAlignment,
        KolenPollack,
        NodeCall,
        Preset,
        RoutingState,
        Rule,
        SignSymmetry,
        WeightMirror,
        credit_alignment,
        credit_norm,
        method,
        route_credit,
    )

__all__ = [
    "Attribute",
    "Capture",
    "CaptureError",
    "CaptureOptions",
    "ConcurrentUseError",
    "CreditResult",
    "CreditRouter",
    "DirectFeedbackAlignment",
    "Drawing",
    "EDGE_ATTRIBUTES",
    "Exact",
    "FIXED_KWARGS",
    "FORMAT_VERSION",
    "FeedbackAlignment",
    "FxnxError",
    "FxnxTypeError",
    "FxnxValueError",
    "GRAPH_ATTRIBUTES",
    "GraphContractError",
    "GraphFileError",
    "GraphvizNotFoundError",
    "KolenPollack",
    "MERGE_TARGETS",
    "MemoryProfile",
    "NODE_ATTRIBUTES",
    "NodeCall",
    "PRESETS",
    "PandasNotFoundError",
    "Preset",
    "ReceptiveField",
    "RoutingState",
    "Rule",
    "ShapePropagationError",
    "SignSymmetry",
    "SkipConnection",
    "TRACING_LOCK",
    "UnsafePickleError",
    "WeightMirror",
    "__version__",
    "atomic_write",
    "capture",
    "census",
    "convert",
    "cost_summary",
    "cost_table",
    "credit_alignment",
    "credit_norm",
    "draw",
    "format_summary",
    "graph_from_capture",
    "memory_profile",
    "method",
    "module_costs",
    "node_depths",
    "path_length_counts",
    "path_length_credit",
    "plot_alignment",
    "plot_census",
    "plot_credit_by_depth",
    "read_json",
    "read_pickle",
    "receptive_fields",
    "route_credit",
    "scope_subgraph",
    "short_name",
    "skip_connections",
    "summary",
    "to_frames",
    "to_pydot",
    "topological_order",
    "validate",
    "write_graphml",
    "write_json",
    "write_pickle",
]

# Public names that import torch, and the module each lives in.
_LAZY = {
    "CreditResult": "credit",
    "CreditRouter": "credit",
    "DirectFeedbackAlignment": "credit",
    "Exact": "credit",
    "FeedbackAlignment": "credit",
    "KolenPollack": "credit",
    "NodeCall": "credit",
    "PRESETS": "credit",
    "Preset": "credit",
    "RoutingState": "credit",
    "Rule": "credit",
    "SignSymmetry": "credit",
    "WeightMirror": "credit",
    "credit_alignment": "credit",
    "credit_norm": "credit",
    "method": "credit",
    "route_credit": "credit",
    "convert": "conversion",
    "graph_from_capture": "conversion",
    "Capture": "capturing",
    "CaptureOptions": "capturing",
    "FIXED_KWARGS": "capturing",
    "TRACING_LOCK": "capturing",
    "capture": "capturing",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxnx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
