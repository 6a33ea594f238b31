"""Reading and writing graph files.

A graph file holds a networkx graph of plain data (the graph contract,
docs/graph.md), so it loads in a Python that has networkx but no torch.

Writers check the contract first and write atomically: the file at the path
is either the old one, byte for byte, or the complete new one.

Readers treat a file as untrusted. A pickle is a program, so
:func:`read_pickle` first reads its opcodes without running them and admits
only those that build plain data and one networkx graph: no function or class
is ever called, no dict key can be a tuple (whose hashing can take
exponential time or crash Python), and what the file expands into through
shared references is bounded by its size. Every reader then checks the graph
contract. Whatever is wrong, the error is one :class:`GraphFileError` naming
the file and the problem.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import json
import math
import os
import pickle
import pickletools
import secrets
from collections.abc import Iterator
from typing import IO, Any

import networkx as nx

from .contract import MAX_DEPTH, validate
from .errors import FxnxError, FxnxTypeError, GraphContractError

__all__ = [
    "GraphFileError",
    "UnsafePickleError",
    "atomic_write",
    "read_json",
    "read_pickle",
    "write_graphml",
    "write_json",
    "write_pickle",
]

_PICKLE_PROTOCOL = 4


class GraphFileError(FxnxError, ValueError):
    """A graph file is truncated, corrupt, not an fxnx graph, or from a newer fxnx."""


class UnsafePickleError(GraphFileError):
    """A pickle asked for something graph files never contain; nothing in it was run."""


# --- writing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a file that replaces ``path`` only once the block completes without error.

    Writes go to a new temporary file beside ``path``, which is flushed,
    synced to disk and renamed over ``path`` at the end (``os.replace`` is
    atomic). If anything fails first, the temporary file is removed and
    ``path`` is untouched. The new file gets the usual permissions for a new
    file (the umask), not those of the file it replaces.

    Parameters
    ----------
    path : str or path-like
        The file to write.
    mode : {"wb", "w"}
        Binary, or text in UTF-8.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "notes.txt"
    >>> with atomic_write(path, "w") as f:
    ...     _ = f.write("kept")
    >>> try:
    ...     with atomic_write(path, "w") as f:
    ...         _ = f.write("half")
    ...         raise RuntimeError("disk full")
    ... except RuntimeError:
    ...     pass
    >>> path.read_text(), [p.name for p in path.parent.iterdir()]
    ('kept', ['notes.txt'])
    """
    if mode not in ("wb", "w"):
        raise FxnxTypeError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    target = os.fspath(path)
    head, tail = os.path.split(target)
    temp = os.path.join(head, f".{tail}.{secrets.token_hex(6)}.tmp")
    try:
        with open(temp, "x" + mode[1:], encoding=None if mode == "wb" else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _check_writable(G: Any, path: str | os.PathLike[str], writer: str) -> None:
    if not isinstance(G, nx.Graph):
        raise FxnxTypeError(f"{writer} needs a networkx graph, got {type(G).__qualname__}")
    try:
        validate(G)
    except GraphContractError as err:
        raise GraphContractError(f"{os.fspath(path)!r} was not written: {err}") from err


# What a graph is; the rest of its __dict__ is cached views (G.nodes, G.adj), derived state.
_GRAPH_STATE = ("graph", "_node", "_adj", "_pred", "_succ")


class _GraphPickler(pickle.Pickler):
    """Pickles graphs as their data alone, so files hold no view classes and never vary."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, nx.Graph):
            state = {key: vars(obj)[key] for key in _GRAPH_STATE if key in vars(obj)}
            state["__networkx_cache__"] = {}
            return copyreg.__newobj__, (nx.MultiDiGraph,), state
        return NotImplemented


def write_pickle(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Write ``G`` to ``path`` as a pickle that loads without torch.

    Raises
    ------
    FxnxTypeError
        ``G`` is not a networkx graph.
    GraphContractError
        ``G`` breaks the graph contract (an attribute that is not plain data,
        such as a tensor or a set); nothing is written.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> G = nx.MultiDiGraph(format_version=1)
    >>> G.add_node("x", op="placeholder")
    >>> write_pickle(G, pathlib.Path(tempfile.mkdtemp()) / "g.pkl")
    Traceback (most recent call last):
    ...
    fxnx.errors.GraphContractError: '.../g.pkl' was not written: G.graph lacks attribute 'fxnx_version' (always present in fxnx graphs)
    """
    _check_writable(G, path, "write_pickle")
    buffer = io.BytesIO()
    _GraphPickler(buffer, protocol=_PICKLE_PROTOCOL).dump(G)
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())


_TUPLE = "__tuple__"


def _encode(value: Any) -> Any:
    """JSON has no tuples: keep them as ``{"__tuple__": [...]}`` so they come back as tuples."""
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value:
            raise FxnxTypeError(f"a dict whose only key is {_TUPLE!r} would read back as a tuple")
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and type(obj.get(_TUPLE)) is list:
        return tuple(obj[_TUPLE])
    return obj


def write_json(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Write ``G`` as node-link JSON; tuples (shapes) read back as tuples.

    Raises
    ------
    FxnxTypeError
        ``G`` is not a networkx graph.
    GraphContractError
        ``G`` breaks the graph contract, or holds what JSON cannot write
        (NaN, an attribute named like a node-link field); nothing is written.
    """
    _check_writable(G, path, "write_json")
    clash = _node_link_clash(G)
    try:
        if clash:
            raise ValueError(clash)
        text = json.dumps(_encode(nx.node_link_data(G, edges="edges")), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise GraphContractError(
            f"G holds something JSON cannot write, so {os.fspath(path)!r} was not written: {err}"
        ) from err
    with atomic_write(path, "w") as f:
        f.write(text)


def _node_link_clash(G: nx.MultiDiGraph) -> str | None:
    for node, data in G.nodes(data=True):
        if "id" in data:
            return f"node {node!r} has an attribute named 'id', which node-link JSON uses"
    for u, v, data in G.edges(data=True):
        for name in ("source", "target", "key"):
            if name in data:
                return f"edge {u!r} -> {v!r} has an attribute named {name!r}, which node-link JSON uses"
    return None


def write_graphml(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Export ``G`` as GraphML for Gephi or Cytoscape.

    GraphML holds only scalars, so tuples, lists and dicts (shapes,
    ``node_call_info``) are written as JSON text; None values are left out.
    This is an export: read graphs back from pickle or JSON.
    """
    _check_writable(G, path, "write_graphml")
    H = nx.MultiDiGraph()
    H.graph.update(_scalars(G.graph))
    H.add_nodes_from((n, _scalars(d)) for n, d in G.nodes(data=True))
    H.add_edges_from((u, v, k, _scalars(d)) for u, v, k, d in G.edges(keys=True, data=True))
    with atomic_write(path, "wb") as f:
        nx.write_graphml(H, f)


def _scalars(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (str, int, float, bool)) else json.dumps(_encode(v))
        for k, v in data.items()
        if v is not None
    }


# --- reading pickles ----------------------------------------------------------------------------

#: A file may expand (shared references walked as a tree) into this many elements per byte,
#: plus the floor. fxnx's own files expand into under 2 per byte.
_PER_BYTE = 8
_FLOOR = 100_000


def read_pickle(path: str | os.PathLike[str]) -> nx.MultiDiGraph:
    """Read a graph written by :func:`write_pickle`, refusing anything but graph data.

    Raises
    ------
    UnsafePickleError
        The file asks for something a graph file never contains (a function,
        a class other than a networkx graph, a call); nothing in it was run.
    GraphFileError
        The file is truncated, corrupt, expands far beyond its size, is not
        an fxnx graph (see docs/graph.md), or is from a newer fxnx.

    Examples
    --------
    >>> import tempfile, pathlib, torch, fxnx
    >>> G = fxnx.convert(torch.nn.ReLU(), torch.zeros(2))
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "g.pkl"
    >>> write_pickle(G, path)
    >>> list(read_pickle(path).edges)
    [('input_1', 'relu', 0), ('relu', 'output', 0)]
    """
    name = repr(os.fspath(path))
    with open(path, "rb") as f:
        data = f.read()
    try:
        _scan(data)
        record = _GraphUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError as err:
        raise UnsafePickleError(
            f"{name} refused, {err}. Nothing in it was run: fxnx graph files hold only a "
            "networkx graph of plain data, so this file is not one (or was tampered with). "
            "If you trust its author, load it with pickle.load yourself."
        ) from None
    except Exception as err:  # pickle raises many types; none may escape as anything but this
        raise GraphFileError(
            f"{name} is not a readable fxnx graph file "
            f"(truncated or corrupt: {type(err).__name__}: {err})"
        ) from err
    if not isinstance(record, _GraphRecord):
        raise GraphFileError(f"{name} holds a {type(record).__name__}, not a graph")
    if type(record).__name__ != "MultiDiGraph":
        raise GraphFileError(f"{name} holds a networkx {type(record).__name__}, not a MultiDiGraph")
    _check_expansion(getattr(record, "state", None), _FLOOR + _PER_BYTE * len(data), name)
    G = _graph_from_state(getattr(record, "state", None), name)
    return _validated(G, name)


def _validated(G: nx.MultiDiGraph, name: str) -> nx.MultiDiGraph:
    try:
        validate(G)
    except GraphContractError as err:
        raise GraphFileError(f"{name} is not a valid fxnx graph: {err}") from err
    return G


class _GraphRecord:
    """Stands in for a networkx graph class while unpickling: it keeps the state and runs nothing."""

    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> _GraphRecord:
        if args or kwargs:
            raise UnsafePickleError("a graph is created with arguments, which fxnx files never do")
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise UnsafePickleError("the file calls a class (REDUCE), which fxnx files never do")

    def __setstate__(self, state: Any) -> None:
        if hasattr(self, "state"):
            raise UnsafePickleError("a graph's state is set twice, which fxnx files never do")
        self.state = state


_GRAPH_CLASSES = {
    ("networkx.classes.multidigraph", "MultiDiGraph"),
    ("networkx.classes.digraph", "DiGraph"),
    ("networkx.classes.graph", "Graph"),
    ("networkx.classes.multigraph", "MultiGraph"),
}


class _GraphUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GRAPH_CLASSES:
            return type(name, (_GraphRecord,), {})
        raise UnsafePickleError(f"it asks for {module}.{name}")


# Opcodes fxnx's writer emits (protocol 4), by how their argument is laid out.
_NO_ARG = frozenset(b"(.})]t\x85\x86\x87aesuN\x88\x89\x94\x93\x81b")
_FIXED = {ord("K"): 1, ord("h"): 1, ord("\x80"): 1, ord("M"): 2, ord("J"): 4, ord("j"): 4,
          ord("\x95"): 8, ord("G"): 8}
_COUNTED = {0x8C: 1, 0x8A: 1, ord("X"): 4, 0x8B: 4, 0x8D: 8}
_SCALAR_KINDS = frozenset("six")  # str, int, other scalar: what may be a dict key


def _scan(data: bytes) -> None:
    """Read the opcodes without running them; refuse any fxnx's writer never emits.

    Tracks what kind of value each stack slot holds (str, int, tuple, ...) so
    that only scalars become dict keys: hashing a deeply nested or
    reference-bombed tuple takes exponential time or overflows the C stack.
    """
    if data[:1] != b"\x80" or data[1:2] > b"\x04":
        raise GraphFileError("it does not start like a pickle of protocol 2 to 4")
    stack: list[str] = []
    marks: list[int] = []
    memo: list[str] = []
    push, remember = stack.append, memo.append
    i, end = 0, len(data)
    while i < end:
        op = data[i]
        i += 1
        # The opcodes graph files are made of, most frequent first (memo references, memoised
        # strings, small ints, dicts): each handled in one step, the rest by kind below.
        if op == 0x6A and i + 4 <= end:  # LONG_BINGET
            index = int.from_bytes(data[i : i + 4], "little")
            if index >= len(memo):
                raise GraphFileError(f"byte {i - 1}: memo entry {index} does not exist")
            push(memo[index])
            i += 4
        elif op == 0x94 and stack:  # MEMOIZE
            remember(stack[-1])
        elif op == 0x4B and i < end:  # BININT1
            push("i")
            i += 1
        elif op == 0x8C and i < end:  # SHORT_BINUNICODE
            i += 1 + data[i]
            if i > end:
                break
            push("s")
        elif op == 0x7D:  # EMPTY_DICT
            push("d")
        elif op in _NO_ARG:
            if op == 0x94:  # MEMOIZE
                memo.append(stack[-1])
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x73:  # SETITEM
                del stack[-1]
                key = stack.pop()
                if key not in _SCALAR_KINDS or stack[-1] != "d":
                    raise UnsafePickleError(f"byte {i - 1}: SETITEM with a {key!r} key or on a non-dict")
            elif op in (0x75, 0x65, 0x74):  # SETITEMS, APPENDS, TUPLE: the items above the mark
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                if op == 0x74:
                    stack.append("t")
                elif op == 0x75 and (len(items) % 2 or stack[-1] != "d"
                                     or not _SCALAR_KINDS.issuperset(items[::2])):
                    raise UnsafePickleError(f"byte {i - 1}: SETITEMS with a non-scalar key or on a non-dict")
                elif op == 0x65 and stack[-1] != "l":
                    raise UnsafePickleError(f"byte {i - 1}: APPENDS on a non-list")
            elif op in (0x7D, 0x5D, 0x29):  # EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE
                stack.append({0x7D: "d", 0x5D: "l", 0x29: "t"}[op])
            elif op in (0x85, 0x86, 0x87):  # TUPLE1-3
                del stack[len(stack) - (op - 0x84) :]
                stack.append("t")
            elif op == 0x61:  # APPEND
                stack.pop()
                if stack[-1] != "l":
                    raise UnsafePickleError(f"byte {i - 1}: APPEND on a non-list")
            elif op == 0x93:  # STACK_GLOBAL: find_class decides on the names
                del stack[-2:]
                stack.append("c")
            elif op == 0x81:  # NEWOBJ
                args, cls = stack.pop(), stack.pop()
                if cls != "c" or args != "t":
                    raise UnsafePickleError(f"byte {i - 1}: NEWOBJ on something other than a graph class")
                stack.append("g")
            elif op == 0x62:  # BUILD
                stack.pop()
                if stack[-1] != "g":
                    raise UnsafePickleError(f"byte {i - 1}: BUILD on something other than a graph")
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise GraphFileError(f"byte {i - 1}: STOP with {len(stack)} values on the stack")
                return
            else:  # NONE, NEWTRUE, NEWFALSE
                stack.append("x")
        elif op in _FIXED:
            size = _FIXED[op]
            if i + size > end:
                break
            if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                index = int.from_bytes(data[i : i + size], "little")
                if index >= len(memo):
                    raise GraphFileError(f"byte {i - 1}: memo entry {index} does not exist")
                stack.append(memo[index])
            elif op != 0x80 and op != 0x95:  # not PROTO, FRAME
                stack.append("x" if op == 0x47 else "i")
            i += size
        elif op in _COUNTED:
            size = _COUNTED[op]
            count = int.from_bytes(data[i : i + size], "little", signed=op == 0x8B)
            i += size + count
            if count < 0 or i > end:
                break
            stack.append("i" if op in (0x8A, 0x8B) else "s")
        else:
            raise UnsafePickleError(f"byte {i - 1}: opcode {_opcode_name(op)}, which fxnx files never contain")
    raise GraphFileError("the file ends before its STOP opcode: it is truncated")


def _opcode_name(op: int) -> str:
    return next((o.name for o in pickletools.opcodes if ord(o.code) == op), f"0x{op:02x}")


def _check_expansion(obj: Any, limit: int, name: str) -> None:
    """Walk ``obj`` as a tree (shared references walked each time), refusing a huge or deep one."""
    count = 0
    stack = [(obj, 0)] if type(obj) in _CONTAINERS else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH + 8:
            raise GraphFileError(f"{name} nests values more than {MAX_DEPTH + 8} deep")
        values = item.values() if type(item) is dict else item
        count += len(values) + 1
        if count > limit:
            raise GraphFileError(
                f"{name} expands into more than {limit:,} values through shared references "
                f"(for a file of {(limit - _FLOOR) // _PER_BYTE:,} bytes): refused as a "
                "decompression bomb"
            )
        stack.extend((v, depth + 1) for v in values if type(v) in _CONTAINERS)


_CONTAINERS = (dict, list, tuple)


def _graph_from_state(state: Any, name: str) -> nx.MultiDiGraph:
    """A fresh graph built from a pickled graph's state, checking its structure on the way."""

    def broken(what: str) -> GraphFileError:
        return GraphFileError(f"{name} is not a valid fxnx graph: {what}")

    expected = {"graph", "_node", "_adj", "_pred", "_succ", "__networkx_cache__"}
    if type(state) is not dict or set(state) != expected:
        keys = sorted(state) if type(state) is dict else type(state).__name__
        raise broken(f"the graph's state holds {keys}, not {sorted(expected)}")
    nodes, succ, pred = state["_node"], state["_succ"], state["_pred"]
    if state["_adj"] is not succ or any(type(t) is not dict for t in (nodes, succ, pred)):
        raise broken("its node and adjacency tables are not dicts")
    if set(succ) != set(nodes) or set(pred) != set(nodes):
        raise broken("its adjacency tables name other nodes than its node table")
    G = nx.MultiDiGraph()
    G.graph = state["graph"]
    for node, attrs in nodes.items():
        if type(node) is not str:
            raise broken(f"node {node!r} is named by a {type(node).__name__}, not a str")
        if type(attrs) is not dict:
            raise broken(f"node {node!r} has {type(attrs).__name__} attributes, not a dict")
    G.add_nodes_from(nodes.items())
    edges = []
    for u, nbrs in succ.items():
        if type(nbrs) is not dict or not set(nbrs) <= nodes.keys():
            raise broken(f"node {u!r} has a broken adjacency entry")
        for v, keydict in nbrs.items():
            if type(keydict) is not dict:
                raise broken(f"edge {u!r} -> {v!r} has a broken key table")
            for key, attrs in keydict.items():
                if type(key) is not int or type(attrs) is not dict:
                    raise broken(f"edge {u!r} -> {v!r} has key {key!r} or attributes of the wrong type")
                edges.append((u, v, key, attrs))
    G.add_edges_from(edges)
    # The file's in-edge order, which edits made over time; the out-edge order is that of G.edges.
    for v, preds in pred.items():
        if type(preds) is not dict or preds.keys() != G._pred[v].keys():
            raise broken(f"the in-edges of {v!r} disagree with the out-edges")
        for u, keydict in preds.items():
            if type(keydict) is not dict or keydict.keys() != G._succ[u][v].keys():
                raise broken(f"the in-edges of {v!r} disagree with the out-edges")
        G._pred[v] = {u: G._succ[u][v] for u in preds}
    return G


# --- reading JSON -------------------------------------------------------------------------------


def read_json(path: str | os.PathLike[str]) -> nx.MultiDiGraph:
    """Read a graph written by :func:`write_json`.

    Raises
    ------
    GraphFileError
        The file is not UTF-8 JSON, not a node-link graph (duplicate node ids,
        edges to missing nodes), not an fxnx graph (see docs/graph.md), or is
        from a newer fxnx.
    """
    name = repr(os.fspath(path))
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(
            raw.decode("utf-8"), object_hook=_decode, parse_constant=_no_constant, parse_float=_finite
        )
    except RecursionError as err:
        raise GraphFileError(f"{name} nests JSON values too deeply to be an fxnx graph") from err
    except ValueError as err:  # invalid UTF-8 or JSON, NaN, an integer too long to convert
        raise GraphFileError(
            f"{name} is not a readable fxnx JSON graph (truncated or corrupt: {err})"
        ) from err
    return _validated(_graph_from_node_link(data, name), name)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number fxnx graphs hold")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _graph_from_node_link(data: Any, name: str) -> nx.MultiDiGraph:
    def broken(what: str) -> GraphFileError:
        return GraphFileError(f"{name} is not a node-link fxnx graph: {what}")

    fields = {"directed", "multigraph", "graph", "nodes", "edges"}
    if type(data) is not dict or not fields <= set(data):
        got = sorted(data) if type(data) is dict else f"a JSON {type(data).__name__}"
        raise broken(f"expected an object with {sorted(fields)}, got {got}")
    if data["directed"] is not True or data["multigraph"] is not True:
        raise broken("it is not a directed multigraph")
    if type(data["nodes"]) is not list or type(data["edges"]) is not list:
        raise broken("'nodes' and 'edges' must be lists")
    G = nx.MultiDiGraph()
    G.graph = data["graph"]
    for i, node in enumerate(data["nodes"]):
        if type(node) is not dict or type(node.get("id")) is not str:
            raise broken(f"nodes[{i}] is not an object with a str 'id'")
        if node["id"] in G:
            raise broken(f"node id {node['id']!r} appears twice")
        G.add_node(node["id"])
        G.nodes[node["id"]].update((k, v) for k, v in node.items() if k != "id")
    for i, edge in enumerate(data["edges"]):
        if type(edge) is not dict or not {"source", "target", "key"} <= set(edge):
            raise broken(f"edges[{i}] is not an object with 'source', 'target' and 'key'")
        u, v, key = edge["source"], edge["target"], edge["key"]
        if type(u) is not str or type(v) is not str or u not in G or v not in G or type(key) is not int:
            raise broken(f"edges[{i}] joins {u!r} to {v!r} (key {key!r}): not two nodes of the file")
        if G.has_edge(u, v, key):
            raise broken(f"edges[{i}] repeats edge {u!r} -> {v!r} key {key}")
        G.add_edge(u, v, key)
        G.edges[u, v, key].update((k, w) for k, w in edge.items() if k not in ("source", "target", "key"))
    return G
