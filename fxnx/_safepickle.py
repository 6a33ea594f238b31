"""Loading a pickle that may come from anyone, admitting only what fxnx's writer emits.

A pickle is a program. :func:`load` first reads the opcodes without running
them and admits only those that build plain data and one networkx graph: no
function or class is ever called, and no dict key can be a tuple (whose
hashing can take exponential time or crash Python). It then lets the C
unpickler build the data, with the graph class replaced by an inert record,
bounds what shared references expand it into (values and characters, as a
tree), and rebuilds the graph through networkx's API from the checked tables.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

import networkx as nx

from ._contract import MAX_DEPTH
from ._errors import GraphFileError, UnsafePickleError

__all__ = ["load"]


def load(data: bytes, name: str) -> nx.MultiDiGraph:
    """The graph pickled in ``data`` (``name`` says which file, in errors).

    Raises
    ------
    UnsafePickleError
        The data asks for something graph files never contain; nothing ran.
    GraphFileError
        Truncated, corrupt, expanding far beyond its size, or not a graph.
    """
    if data[:2] == b"\x80\x05":
        raise GraphFileError(
            f"{name} is a pickle of protocol 5, which fxnx's writer never uses: a file "
            "pickle.dump wrote, not fxnx.write_pickle. Nothing in it was run; if you trust its "
            "author, load it with pickle.load yourself"
        )
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
            f"(truncated or corrupt: {type(err).__name__}: {str(err)[:200]})"
        ) from err
    if not isinstance(record, _GraphRecord):
        raise GraphFileError(f"{name} holds a {type(record).__name__}, not a graph")
    if type(record).__name__ != "MultiDiGraph":
        raise GraphFileError(f"{name} holds a networkx {type(record).__name__}, not a MultiDiGraph")
    state = getattr(record, "state", None)
    _check_expansion(state, len(data), name)
    return _graph_from_state(state, name)


#: A file may expand (shared references walked as a tree) into this many values per byte, plus
#: the floor; fxnx's own files expand into under 2 per byte.
_PER_BYTE = 8
_FLOOR = 100_000
#: And into this many characters of strings per byte, plus the floor: a shared string counts
#: each time it is reached, as printing or writing the graph would spell it out.
_CHARS_PER_BYTE = 64
_CHARS_FLOOR = 1_000_000



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
            stack.append(memo[index])
            i += 4
        elif op == 0x94 and stack:  # MEMOIZE
            memo.append(stack[-1])
        elif op == 0x4B and i < end:  # BININT1
            stack.append("i")
            i += 1
        elif op == 0x8C and i < end:  # SHORT_BINUNICODE
            i += 1 + data[i]
            if i > end:
                break
            stack.append("s")
        elif op == 0x7D:  # EMPTY_DICT
            stack.append("d")
        elif op in _NO_ARG:
            if op == 0x94:  # MEMOIZE with nothing to remember (the fast path takes the rest)
                raise GraphFileError(f"byte {i - 1}: MEMOIZE on an empty stack")
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
            elif op in (0x5D, 0x29):  # EMPTY_LIST, EMPTY_TUPLE (EMPTY_DICT: the fast path)
                stack.append("l" if op == 0x5D else "t")
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


def _check_expansion(obj: Any, size: int, name: str) -> None:
    """Walk ``obj`` as a tree (shared references walked each time), refusing a huge or deep one."""
    limit, chars_limit = _FLOOR + _PER_BYTE * size, _CHARS_FLOOR + _CHARS_PER_BYTE * size
    count = chars = 0
    stack = [(obj, 0)] if type(obj) in _CONTAINERS else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH + 8:
            raise GraphFileError(f"{name} nests values more than {MAX_DEPTH + 8} deep")
        values = list(item.items()) if type(item) is dict else item
        count += len(values) + 1
        for value in values:
            if type(value) is tuple and type(item) is dict:  # a (key, value) pair
                key, value = value
                chars += len(key) if type(key) is str else 0
            if type(value) is str:
                chars += len(value)
            elif type(value) in _CONTAINERS:
                stack.append((value, depth + 1))
        if count > limit or chars > chars_limit:
            what = f"{limit:,} values" if count > limit else f"{chars_limit:,} characters"
            raise GraphFileError(
                f"{name} expands into more than {what} through shared references "
                f"(for a file of {size:,} bytes): refused as a decompression bomb"
            )


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

