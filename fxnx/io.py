"""Reading and writing graph files.

A graph file holds only networkx graph classes and builtins, so it loads in a
Python that has networkx but no torch. :func:`read_pickle` refuses anything
else: a pickle is a program, and a graph file from someone else must not be
able to run code on your machine.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
from typing import Any

import networkx as nx

from ._version import FORMAT_VERSION
from .errors import FxnxError, FxnxTypeError, FxnxValueError

__all__ = [
    "GraphFileError",
    "UnsafePickleError",
    "read_json",
    "read_pickle",
    "write_graphml",
    "write_json",
    "write_pickle",
]

_PICKLE_PROTOCOL = 4


class GraphFileError(FxnxError, ValueError):
    """A graph file is truncated, corrupt, or from a newer fxnx."""


class UnsafePickleError(GraphFileError):
    """A pickle asked for a class that graph files never contain; nothing was run."""


_ALLOWED = {
    ("builtins", name)
    for name in ("dict", "list", "tuple", "set", "frozenset", "str", "int", "float", "bool",
                 "complex", "bytes", "slice")
} | {
    ("networkx.classes.multidigraph", "MultiDiGraph"),
    ("networkx.classes.digraph", "DiGraph"),
    ("networkx.classes.graph", "Graph"),
    ("networkx.classes.multigraph", "MultiGraph"),
}

# What a graph is; the rest of its __dict__ is cached views (G.nodes, G.adj), derived state.
_GRAPH_STATE = ("graph", "_node", "_adj", "_pred", "_succ")


class _GraphPickler(pickle.Pickler):
    """Pickles graphs as their data alone, so files hold no view classes and never vary."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, nx.Graph):
            state = {key: vars(obj)[key] for key in _GRAPH_STATE if key in vars(obj)}
            state["__networkx_cache__"] = {}
            return copyreg.__newobj__, (type(obj),), state
        return NotImplemented


class _GraphUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refused to load {module}.{name}: fxnx graph files hold only networkx graphs and "
            "builtins, so this file is not one (or was tampered with). Nothing in it was run. "
            "If you trust its author, load it with pickle.load yourself."
        )


def write_pickle(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Write ``G`` to ``path`` as a pickle that loads without torch.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> G = nx.MultiDiGraph([("x", "y")], format_version=1)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "g.pkl"
    >>> write_pickle(G, path)
    >>> list(read_pickle(path).edges)
    [('x', 'y', 0)]
    """
    if not isinstance(G, nx.Graph):
        raise FxnxTypeError(f"write_pickle needs a networkx graph, got {type(G).__qualname__}")
    buffer = io.BytesIO()
    _GraphPickler(buffer, protocol=_PICKLE_PROTOCOL).dump(G)
    data = buffer.getvalue()
    # Refuse to write what read_pickle would refuse to read (a torch object in an attribute).
    try:
        _GraphUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as err:
        raise FxnxValueError(
            f"G holds an object that is not plain data, so {os.fspath(path)!r} was not written: "
            f"{err.args[0].split(':')[0]}. Graph attributes must be str, int, float, bool, None, "
            "tuple, list or dict."
        ) from None
    with open(path, "wb") as f:
        f.write(data)


def read_pickle(path: str | os.PathLike[str]) -> nx.MultiDiGraph:
    """Read a graph written by :func:`write_pickle`, refusing anything but graph data.

    Raises
    ------
    UnsafePickleError
        The file asks for a class a graph file never contains.
    GraphFileError
        The file is truncated, not a pickle, or from a newer format.
    """
    with open(path, "rb") as f:
        try:
            G = _GraphUnpickler(f).load()
        except UnsafePickleError:
            raise
        except Exception as err:
            raise GraphFileError(
                f"{os.fspath(path)!r} is not a readable fxnx graph file "
                f"(truncated or corrupt: {type(err).__name__}: {err})"
            ) from err
    if not isinstance(G, nx.Graph):
        raise GraphFileError(f"{os.fspath(path)!r} holds a {type(G).__name__}, not a graph")
    _check_version(G, path)
    return G


def _check_version(G: nx.Graph, path: str | os.PathLike[str]) -> None:
    version = G.graph.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise GraphFileError(
            f"{os.fspath(path)!r} has format_version {version}, newer than the {FORMAT_VERSION} "
            "this fxnx reads: upgrade fxnx (pip install -U fxnx)"
        )


_TUPLE = "__tuple__"


def _encode(value: Any) -> Any:
    """JSON has no tuples: keep them as ``{"__tuple__": [...]}`` so they come back as tuples."""
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(obj: dict[str, Any]) -> Any:
    return tuple(obj[_TUPLE]) if len(obj) == 1 and _TUPLE in obj else obj


def write_json(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Write ``G`` as node-link JSON; tuples (shapes) read back as tuples.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> G = nx.MultiDiGraph(format_version=1)
    >>> G.add_edge("x", "y", shape=(1, 3))
    0
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "g.json"
    >>> write_json(G, path)
    >>> read_json(path).edges["x", "y", 0]["shape"]
    (1, 3)
    """
    if not isinstance(G, nx.Graph):
        raise FxnxTypeError(f"write_json needs a networkx graph, got {type(G).__qualname__}")
    data = nx.node_link_data(G, edges="edges")
    try:
        text = json.dumps(_encode(data), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise FxnxValueError(
            f"G holds something JSON cannot write, so {os.fspath(path)!r} was not written: {err}"
        ) from err
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_json(path: str | os.PathLike[str]) -> nx.MultiDiGraph:
    """Read a graph written by :func:`write_json`.

    Raises
    ------
    GraphFileError
        The file is not JSON, not a node-link graph, or from a newer format.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f, object_hook=_decode)
            G = nx.node_link_graph(data, edges="edges")
        except (json.JSONDecodeError, KeyError, TypeError, nx.NetworkXError) as err:
            raise GraphFileError(
                f"{os.fspath(path)!r} is not a readable fxnx JSON graph "
                f"(truncated or corrupt: {type(err).__name__}: {err})"
            ) from err
    _check_version(G, path)
    return G


def write_graphml(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Export ``G`` as GraphML for Gephi or Cytoscape.

    GraphML holds only scalars, so tuples, lists and dicts (shapes,
    ``node_call_info``) are written as JSON text; None values are left out.
    This is an export: read graphs back from pickle or JSON.
    """
    H = nx.MultiDiGraph()
    H.graph.update(_scalars(G.graph))
    H.add_nodes_from((n, _scalars(d)) for n, d in G.nodes(data=True))
    H.add_edges_from((u, v, k, _scalars(d)) for u, v, k, d in G.edges(keys=True, data=True))
    nx.write_graphml(H, path)


def _scalars(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (str, int, float, bool)) else json.dumps(_encode(v))
        for k, v in data.items()
        if v is not None
    }
