"""fxnx: PyTorch models as NetworkX graphs of their real dataflow.

>>> import fxnx, torch
>>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()), torch.zeros(1, 3))
>>> [n for n in G]
['input_1', '_0', '_1', 'output']

Every public name is listed once, in ``_API`` below, with the private module that holds it,
and loads on first use: ``import fxnx`` and everything that reads graph files work without
torch. Five public modules hold what fewer users need: :mod:`fxnx.credit` (writing and
choosing learning rules), :mod:`fxnx.errors` (the exceptions), :mod:`fxnx.contract` (the graph
contract's tables), :mod:`fxnx.plot` (figures) and :mod:`fxnx.frames` (cost tables).
"""

import importlib as _importlib

from ._display import register as _register_display
from ._version import __version__

# Public name -> the private module that holds it. The one list of fxnx's top level.
_API = {
    "convert": "._convert",
    "capture": "._capture",
    "Capture": "._capture",
    "CaptureOptions": "._capture",
    "validate": "._contract",
    "skip_connections": "._analysis",
    "SkipConnection": "._analysis",
    "census": "._analysis",
    "summary": "._analysis",
    "node_depths": "._analysis",
    "topological_order": "._analysis",
    "scope_subgraph": "._analysis",
    "read_pickle": "._files",
    "write_pickle": "._files",
    "read_json": "._files",
    "write_json": "._files",
    "write_graphml": "._files",
    "draw": "._drawing.draw",
    "to_pydot": "._drawing.dot",
    "Drawing": "._drawing.graphviz",
    "CreditRouter": "._credit",
    "route_credit": "._credit",
    "CreditResult": "._credit",
    "memory_profile": "._memory",
    "MemoryProfile": "._memory",
    "receptive_fields": "._receptive",
    "ReceptiveField": "._receptive",
    "path_length_counts": "._paths",
    "path_length_credit": "._paths",
}

# The public modules, importable as attributes of fxnx.
_MODULES = ("contract", "credit", "errors", "frames", "plot")

__all__ = ["__version__", *sorted(_API)]


def __getattr__(name: str) -> object:
    if name in _API:
        value = getattr(_importlib.import_module(_API[name], __name__), name)
    elif name in _MODULES:
        value = _importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'fxnx' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_MODULES))


_register_display()  # inside IPython, fxnx graphs show a short summary
