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
import errno
import io
import json
import math
import os
import pickle
import re
import reprlib
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Any

import networkx as nx

from . import _safepickle
from ._contract import TUPLE_KEY, validate
from ._errors import FxnxTypeError, GraphContractError, GraphFileError

__all__ = [
    "atomic_write",
    "read_json",
    "read_pickle",
    "write_graphml",
    "write_json",
    "write_pickle",
]

_PICKLE_PROTOCOL = 4


# --- writing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a file that replaces ``path`` only once the block completes without error.

    Writes go to a new temporary file beside ``path``, which is flushed,
    synced to disk and renamed over ``path`` at the end (``os.replace`` is
    atomic). If anything fails first, the temporary file is removed and
    ``path`` is untouched. The new file keeps the permissions of the file it
    replaces, or gets the usual ones for a new file (the umask). A symbolic
    link at ``path`` is replaced by the file, not written through. An
    ``OSError`` about the temporary file or about no file (a full disk) is
    raised as the same error about ``path``.

    A signal that ends the process without raising an exception (SIGTERM's
    default action, SIGKILL) skips the clean-up and can leave a
    ``.fxnx-*.tmp`` file beside ``path``; ``path`` itself is still intact.
    The ``fxnx`` command turns SIGTERM into an exception for this reason; a
    program of your own can do the same with
    ``signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))``.

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
    try:
        # A short name of its own beside the target: as long a name as the target may have works.
        fd, temp = _new_beside(target)
    except OSError as err:
        raise _about(target, err) from err
    try:
        with open(fd, mode, encoding=None if mode == "wb" else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        try:  # a file replaced keeps its permissions; a new one has the OS's (above)
            replaced = stat.S_IMODE(os.stat(target).st_mode)
        except OSError:
            replaced = None
        if replaced is not None:
            os.chmod(temp, replaced)
        os.replace(temp, target)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(err, OSError) and err.errno is not None and err.filename in (None, temp):
            raise _about(target, err) from err
        raise


def _about(target: str, err: OSError) -> OSError:
    """``err`` as an error about ``target``, which the user named, not the temporary file."""
    return OSError(err.errno, err.strerror, target)  # the subclass for errno: PermissionError, ...


def _new_beside(target: str) -> tuple[int, str]:
    """A new temporary file beside ``target``, opened for writing, and its name. It is created
    as any new file is, mode 0o666 less the process's umask, which the OS applies: a file
    that replaces nothing needs no permissions of fxnx's choosing."""
    folder = os.path.dirname(target) or "."
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):  # a name of its own: O_EXCL refuses one that exists, links included
        temp = os.path.join(folder, f".fxnx-{secrets.token_hex(6)}.tmp")
        with contextlib.suppress(FileExistsError):
            return os.open(temp, flags, 0o666), temp
    raise FileExistsError(errno.EEXIST, "no free temporary file name", temp)


def _check_writable(G: Any, path: str | os.PathLike[str], writer: str) -> None:
    if not isinstance(G, nx.Graph):
        raise FxnxTypeError(f"{writer} needs a networkx graph, got {type(G).__qualname__}")
    try:
        validate(G)
    except GraphContractError as err:
        raise GraphContractError(f"{os.fspath(path)!r} was not written: {err}") from err
    problem = _not_text(G)
    if problem:
        raise GraphContractError(f"{os.fspath(path)!r} was not written: {problem}")


#: A lone surrogate: a str can hold one, but it is not text (UTF-8 cannot encode it, nor print
#: it), so graph files hold none: every graph read can be written, printed and drawn.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: What XML 1.0 cannot hold (https://www.w3.org/TR/xml/#charsets): most controls, surrogates,
#: U+FFFE and U+FFFF.
_NOT_XML = re.compile(r"[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


_SHORT = reprlib.Repr()  # names in messages: a node may be named with a megabyte
_SHORT.maxstring = 60


def _texts(G: nx.MultiDiGraph, nested: bool) -> Iterator[tuple[str, str]]:
    """Every str in ``G`` with where it is: node names, attribute names and values, and with
    ``nested`` the strings inside lists, tuples and dicts. ``G`` has passed :func:`validate`."""
    short = _SHORT.repr

    def attributes(owner: str, data: dict[str, Any]) -> Iterator[tuple[str, str]]:
        for key, value in data.items():
            yield f"{owner}: the attribute name {short(key)}", key
            where = f"{owner} attribute {short(key)}"
            stack = [value]
            while stack:
                value = stack.pop()
                if type(value) is str:
                    yield where, value
                elif nested and isinstance(value, (list, tuple)):
                    stack.extend(value)
                elif nested and isinstance(value, dict):
                    stack.extend(value.keys())
                    stack.extend(value.values())

    yield from attributes("G.graph", G.graph)
    for node, data in G.nodes(data=True):
        yield f"the node name {short(node)}", node
        yield from attributes(f"node {short(node)}", data)
    for u, v, key, data in G.edges(keys=True, data=True):
        yield from attributes(f"edge {short(u)} -> {short(v)} (key {key})", data)


def _not_text(G: nx.MultiDiGraph) -> str | None:
    """Where ``G`` holds a lone surrogate, which no file can encode as text; None if nowhere."""
    for where, text in _texts(G, nested=True):
        found = None if text.isascii() else _SURROGATE.search(text)
        if found:
            return f"{where} holds U+{ord(found.group()):04X}, a lone surrogate: not text"
    return None


# What a graph is; the rest of its __dict__ is cached views (G.nodes, G.adj), derived state.
_GRAPH_STATE = ("graph", "_node", "_adj", "_pred", "_succ")


class _GraphPickler(pickle.Pickler):
    """Pickles graphs as their data alone, so files hold no view classes and never vary."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, nx.Graph):
            state = {key: vars(obj)[key] for key in _GRAPH_STATE if key in vars(obj)}
            state["__networkx_cache__"] = {}
            return copyreg.__newobj__, (nx.MultiDiGraph,), state  # type: ignore[attr-defined]  # typeshed lacks it
        return NotImplemented


def write_pickle(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Write ``G`` to ``path`` as a pickle that loads without torch.

    Raises
    ------
    FxnxTypeError
        ``G`` is not a networkx graph.
    GraphContractError
        ``G`` breaks the graph contract (an attribute that is not plain data,
        such as a tensor or a set) or holds a lone surrogate, which is not
        text; nothing is written.

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


def _encode(value: Any) -> Any:
    """JSON has no tuples: keep them as ``{"__tuple__": [...]}`` so they come back as tuples."""
    if isinstance(value, tuple):
        return {TUPLE_KEY: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and TUPLE_KEY in value:
            raise FxnxTypeError(f"a dict whose only key is {TUPLE_KEY!r} would read back as a tuple")
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and type(obj.get(TUPLE_KEY)) is list:
        return tuple(obj[TUPLE_KEY])
    return obj


def write_json(G: nx.MultiDiGraph, path: str | os.PathLike[str]) -> None:
    """Write ``G`` as node-link JSON; tuples (shapes) read back as tuples.

    Raises
    ------
    FxnxTypeError
        ``G`` is not a networkx graph.
    GraphContractError
        ``G`` breaks the graph contract, or holds what JSON cannot write
        (NaN, an attribute named like a node-link field, a lone surrogate);
        nothing is written.
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
    """Export ``G`` as GraphML for Gephi, Cytoscape, igraph or yEd.

    GraphML declares each attribute once, with one type (``<key attr.name=...
    attr.type=...>``), and holds scalars only, so attributes are written as:

    * **Shapes** (``out_shape`` on nodes, ``shape`` on edges) as their sizes
      joined by ``x``: ``"1x64x56x56"``, ``""`` for a 0-d tensor, a symbolic
      size by its name (``"u0x3"``), with the rank beside it as a long
      (``out_rank``, ``rank``). Several outputs are joined by ``"; "``
      (``"2x3; 4"``, ``"?"`` for one not a tensor; a dict as
      ``"logits: 2x10; hidden: 2x8"``), without a rank. A shape that this
      cannot spell unambiguously (a name holding ``x``, ``;`` or ``:``) is
      written as JSON text, as below.
    * **Dtypes** (``out_dtype``, ``dtype``) as their names, several joined the
      same way: ``"torch.float32; torch.int64"``.
    * **Other lists, tuples and dicts** (``node_call_info``, ``inputs``) as
      JSON text.
    * **Scalars** as themselves, one type per attribute: ``boolean``,
      ``long``, ``double`` where ints and floats mix, ``string`` where
      anything else mixes (each value then as its JSON text: ``3``, ``true``).
    * **None** is left out.

    This is an export for other tools: read graphs back from pickle or JSON.

    Raises
    ------
    FxnxTypeError
        ``G`` is not a networkx graph.
    GraphContractError
        ``G`` breaks the graph contract, or a node name, attribute name or
        string attribute holds a character XML cannot hold (a control
        character such as U+0000 or U+001B, U+FFFE); nothing is written.

    Examples
    --------
    >>> import tempfile, pathlib, torch, fxnx
    >>> G = fxnx.convert(torch.nn.Linear(3, 2), torch.zeros(4, 3))
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "g.graphml"
    >>> write_graphml(G, path)
    >>> H = nx.read_graphml(path)
    >>> H.nodes["linear"]["out_shape"], H.nodes["linear"]["out_rank"], H.nodes["linear"]["out_dtype"]
    ('4x2', 2, 'torch.float32')
    """
    _check_writable(G, path, "write_graphml")
    for where, text in _texts(G, nested=False):  # JSON text escapes what it holds
        _refuse_not_xml(where, text, path)
    H = nx.MultiDiGraph()
    H.graph.update(_one_type_each([_scalars(G.graph)])[0])
    nodes = _one_type_each([_scalars(d) for _, d in G.nodes(data=True)])
    edges = _one_type_each([_scalars(d) for *_, d in G.edges(keys=True, data=True)])
    H.add_nodes_from(zip(G.nodes, nodes, strict=True))
    H.add_edges_from((u, v, k, d) for (u, v, k), d in zip(G.edges(keys=True), edges, strict=True))
    for where, text in _texts(H, nested=False):  # shapes and dtypes spelt out by _scalars
        _refuse_not_xml(where, text, path)
    with atomic_write(path, "wb") as f:
        nx.write_graphml(H, f)


def _refuse_not_xml(where: str, text: str, path: str | os.PathLike[str]) -> None:
    found = _NOT_XML.search(text)
    if found:
        raise GraphContractError(
            f"G holds text GraphML cannot write, so {os.fspath(path)!r} was not written: "
            f"{where} holds U+{ord(found.group()):04X}, a character XML cannot hold"
        )


#: Attributes spelt as shapes (with the name of the rank written beside) or dtypes in GraphML.
_SHAPES = {"out_shape": "out_rank", "shape": "rank"}
_DTYPES = frozenset({"out_dtype", "dtype"})
#: What one part of a ``"; "``-joined shape or dtype text may not hold.
_SEPARATOR = re.compile(r";|:|^\?$")


def _scalars(data: dict[str, Any]) -> dict[str, Any]:
    """One element's attributes as GraphML scalars: see :func:`write_graphml`."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, (str, int, float, bool)):
            out[key] = value
            continue
        leaf = _size_text if key in _SHAPES else _dtype_text if key in _DTYPES else None
        text = _joined(value, leaf) if leaf is not None else None
        out[key] = text if text is not None else json.dumps(value)
        if key in _SHAPES and text is not None and isinstance(value, tuple):
            out[_SHAPES[key]] = len(value)
    return out


def _size_text(shape: Any) -> str | None:
    """``"1x64x56x56"`` for a shape; None for anything else, or a size ``x`` cannot join."""
    if not isinstance(shape, tuple):
        return None
    sizes = [str(d) for d in shape]
    return None if any("x" in d or _SEPARATOR.search(d) for d in sizes) else "x".join(sizes)


def _dtype_text(dtype: Any) -> str | None:
    return dtype if isinstance(dtype, str) and not _SEPARATOR.search(dtype) else None


def _joined(value: Any, leaf: Any) -> str | None:
    """One shape or dtype as ``leaf`` spells it, or a flat list or dict of them joined by
    ``"; "`` (``"?"`` for an item that is None, ``"key: ..."`` in a dict); None where that
    text would be ambiguous (nested, empty, a key holding a separator)."""
    if not isinstance(value, (list, dict)):
        return leaf(value)
    items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
    parts = []
    for key, item in items:
        text = "?" if item is None else leaf(item)
        if text is None or (key is not None and _SEPARATOR.search(key)):
            return None
        parts.append(text if key is None else f"{key}: {text}")
    return "; ".join(parts) if parts else None


def _one_type_each(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with each attribute of one Python type across all of them, for one GraphML key:
    bool, int, float (ints with floats), or str (anything else mixed, non-str values as JSON)."""
    types: dict[str, set[type]] = {}
    for row in rows:
        for key, value in row.items():
            types.setdefault(key, set()).add(type(value))
    cast: dict[str, Any] = {}
    for key, seen in types.items():
        if seen == {int, float}:
            cast[key] = float
        elif len(seen) > 1 or any(_too_long(row.get(key)) for row in rows):
            cast[key] = lambda v: v if type(v) is str else json.dumps(v)
    return [{k: cast[k](v) if k in cast else v for k, v in row.items()} for row in rows]


def _too_long(value: Any) -> bool:
    """An int GraphML's long (64 bits) cannot hold."""
    return type(value) is int and not -(2**63) <= value < 2**63


# --- reading pickles ----------------------------------------------------------------------------

#: The largest graph file the readers open (a joint-level DenseNet-201 is a few MB).
MAX_FILE_BYTES = 1 << 30


def read_pickle(path: str | os.PathLike[str]) -> nx.MultiDiGraph:
    """Read a graph written by :func:`write_pickle`, refusing anything but graph data.

    Raises
    ------
    UnsafePickleError
        The file asks for something a graph file never contains (a function,
        a class other than a networkx graph, a call); nothing in it was run.
    GraphFileError
        The file is truncated, corrupt, expands far beyond its size, is not
        an fxnx graph (see docs/graph.md), or is from a newer fxnx; or it is
        not a regular file (a FIFO or a device, which are never read) or is
        larger than :data:`MAX_FILE_BYTES`.

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
    return _validated(_safepickle.load(_read_bytes(path, name), name), name)


def _read_bytes(path: str | os.PathLike[str], name: str) -> bytes:
    """The file's bytes, read without waiting and at most :data:`MAX_FILE_BYTES` of them.

    Anything but a regular file (a FIFO, a device) is refused before it is opened, and again
    after (O_NONBLOCK: a FIFO swapped in meanwhile does not wait for a writer). A folder is
    the OSError that opening it would raise, as a missing file is.
    """
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
    if not stat.S_ISREG(mode):
        raise GraphFileError(f"{name} is not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with open(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise GraphFileError(f"{name} is not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise GraphFileError(
                f"{name} is {info.st_size:,} bytes, more than the {MAX_FILE_BYTES:,} a graph file "
                "may have"
            )
        data = f.read(info.st_size)
        if f.read(1):
            raise GraphFileError(f"{name} grew while it was read: read it once it is complete")
    return data


def _validated(G: nx.MultiDiGraph, name: str) -> nx.MultiDiGraph:
    try:
        validate(G)
    except GraphContractError as err:
        raise GraphFileError(f"{name} is not a valid fxnx graph: {err}") from err
    except Exception as err:  # anything validating a stranger's data trips on is the file's fault
        raise GraphFileError(
            f"{name} is not a valid fxnx graph ({type(err).__name__}: {str(err)[:200]})"
        ) from err
    problem = _not_text(G)
    if problem:
        raise GraphFileError(f"{name} is not a valid fxnx graph: {problem}")
    return G


# --- reading JSON -------------------------------------------------------------------------------


def read_json(path: str | os.PathLike[str]) -> nx.MultiDiGraph:
    """Read a graph written by :func:`write_json`.

    Raises
    ------
    GraphFileError
        The file is not UTF-8 JSON, not a node-link graph (duplicate node ids,
        edges to missing nodes), not an fxnx graph (see docs/graph.md), holds
        a string that is not text (a lone surrogate such as ``"\\ud800"``), or
        is from a newer fxnx; or it is not a regular file or is larger than
        :data:`MAX_FILE_BYTES`, as for :func:`read_pickle`.
    """
    name = repr(os.fspath(path))
    raw = _read_bytes(path, name)
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
    ids: set[str] = set()
    for i, node in enumerate(data["nodes"]):
        if type(node) is not dict or type(node.get("id")) is not str:
            raise broken(f"nodes[{i}] is not an object with a str 'id'")
        if node["id"] in ids:
            raise broken(f"node id {node['id']!r} appears twice")
        ids.add(node["id"])
    edges: set[tuple[str, str, int]] = set()
    for i, edge in enumerate(data["edges"]):
        if type(edge) is not dict or not {"source", "target", "key"} <= set(edge):
            raise broken(f"edges[{i}] is not an object with 'source', 'target' and 'key'")
        u, v, key = edge["source"], edge["target"], edge["key"]
        if type(u) is not str or type(v) is not str or u not in ids or v not in ids or type(key) is not int:
            raise broken(f"edges[{i}] joins {u!r} to {v!r} (key {key!r}): not two nodes of the file")
        if (u, v, key) in edges:
            raise broken(f"edges[{i}] repeats edge {u!r} -> {v!r} key {key}")
        edges.add((u, v, key))
    # Checked above for what networkx would merge or add without a word (a repeated node or
    # edge, an edge to no node); the graph itself is networkx's own reading of node-link data.
    G = nx.node_link_graph(data, directed=True, multigraph=True, edges="edges")
    G.graph = data["graph"]
    return G
