"""The graph contract: what every attribute of an fxnx graph is, as data, and a check.

:data:`GRAPH_ATTRIBUTES`, :data:`NODE_ATTRIBUTES` and :data:`EDGE_ATTRIBUTES`
list each attribute :func:`fxnx.convert` writes and those later steps add
(:func:`fxnx.skip_connections`, :func:`fxnx.route_credit`), with its type and
meaning. :func:`validate` walks these tables; ``docs/graph.md`` mirrors them
(a test keeps the two equal). Attributes not in the tables are the user's own:
any name, any plain data.

This module needs networkx only: graph files are read without torch.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import networkx as nx

from ._errors import FxnxError, GraphContractError

__all__ = [
    "Attribute",
    "EDGE_ATTRIBUTES",
    "FORMAT_VERSION",
    "GRAPH_ATTRIBUTES",
    "NODE_ATTRIBUTES",
    "validate",
]

#: The version of this contract. A reader refuses a newer one: an attribute may have changed meaning.
#: 2 added ``capture_options``; graphs of version 1 are still read (they lack it). 3 gives every
#: node and edge ``branch_role``/``branch_merge`` after skip_connections (None off every branch)
#: and writes ``opaque_modules`` and ``skip_connections`` only when not empty. 4 gives each
#: ``skip_connections`` record its ``kind`` and adds the ``branch`` role (parallel branches).
FORMAT_VERSION = 4

#: How deeply an attribute's value may nest (lists in dicts in tuples ...).
MAX_DEPTH = 32

_INT64 = 2**63


@dataclass(frozen=True)
class Attribute:
    """One attribute of the contract.

    ``kind`` names its type (a key of ``KINDS``, whose text the docs show);
    ``present`` says when a graph has it (a key of ``PRESENCE``).
    """

    name: str
    kind: str
    present: str
    meaning: str


# --- types: each check returns None, or what is wrong ------------------------------------------


#: Short reprs for error messages: a stranger's file may hold huge values.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60



def _class_name(cls: type) -> str:
    """A class as graphs and messages name it, the one spelling: ``torch.nn.modules.conv.Conv2d``,
    a builtin bare (``int``)."""
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


#: :func:`_class_name`, cached: it is asked for each module around each node.
class_name = cast(Callable[[type], str], lru_cache(maxsize=4096)(_class_name))

def _got(value: Any) -> str:
    if type(value) is int and value.bit_length() > 200:  # too long to print, or to convert
        return f"int of {value.bit_length():,} bits"
    return f"{type(value).__name__} {_SHORT.repr(value)}"


def _enum(*allowed: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if type(value) is str and value in allowed else _got(value)

    check.allowed = allowed  # type: ignore[attr-defined]
    return check


def _or_none(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def or_none(value: Any) -> str | None:
        return None if value is None else check(value)

    or_none.allowed = (*check.allowed, None)  # type: ignore[attr-defined]
    return or_none


def _scalar(*types: type) -> Callable[[Any], str | None]:
    return lambda value: None if type(value) in types else _got(value)


def _count(value: Any) -> str | None:
    return None if type(value) is int and 0 <= value < _INT64 else _got(value)


def _count_or_none(value: Any) -> str | None:
    return None if value is None else _count(value)


def _arg(value: Any) -> str | None:
    return None if type(value) is str else _count(value)


def _nested(leaf: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """A leaf, or a list or str-keyed dict of nested values (a multi-output node's shapes)."""

    def check(value: Any) -> str | None:
        stack = [(value, "", 0)]
        while stack:
            item, path, depth = stack.pop()
            if depth > MAX_DEPTH:
                return f"nesting deeper than {MAX_DEPTH} at {path}"
            if type(item) is list:
                stack.extend(reversed([(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item)]))
            elif type(item) is dict:
                for key, v in item.items():
                    if type(key) is not str:
                        return f"dict key {_got(key)} at {path or 'top'}"
                    stack.append((v, f"{path}[{key!r}]", depth + 1))
            elif leaf(item) is not None:
                return _got(item) + (f" at {path}" if path else "")
        return None

    return check


def _shape_leaf(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not tuple:
        return _got(value)
    for d in value:
        if type(d) is not str and _count(d) is not None:
            return _got(value)
    return None


def _str_or_none(value: Any) -> str | None:
    return None if value is None or type(value) is str else _got(value)


def _counts(value: Any) -> str | None:
    """A tuple of int >= 0 (one per spatial dimension)."""
    if type(value) is not tuple or any(_count(v) for v in value):
        return _got(value)
    return None


def _kernel(value: Any) -> str | None:
    if value is None:
        return None
    return _record(
        {"kernel_size": lambda v: None if v is None else _counts(v), "stride": _counts,
         "padding": lambda v: None if type(v) is str else _counts(v), "dilation": _counts,
         "groups": _count_or_none, "transposed": _scalar(bool)},
        value,
    )


def _records(optional: frozenset[str] = frozenset(),
             **fields: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """A list of dicts with exactly these keys, those named in ``optional`` allowed to be missing."""

    def check(value: Any) -> str | None:
        if type(value) is not list:
            return _got(value)
        for i, item in enumerate(value):
            problem = _record(fields, item, optional)
            if problem:
                return f"{problem} at [{i}]"
        return None

    return check


def _record(fields: dict[str, Callable[[Any], str | None]], item: Any,
            optional: frozenset[str] = frozenset()) -> str | None:
    if type(item) is not dict or not set(fields) - optional <= set(item) <= set(fields):
        return _got(item)
    for key, check in fields.items():
        problem = check(item[key]) if key in item else None
        if problem:
            return f"{problem} at [{key!r}]"
    return None


def _mapping(value_check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """A dict with str keys and values that pass ``value_check``."""

    def check(value: Any) -> str | None:
        if type(value) is not dict:
            return _got(value)
        for key, item in value.items():
            if type(key) is not str:
                return f"dict key {_got(key)}"
            problem = value_check(item)
            if problem:
                return f"{problem} at [{key!r}]"
        return None

    return check


def _str_list(value: Any) -> str | None:
    if type(value) is not list:
        return _got(value)
    for i, item in enumerate(value):
        if type(item) is not str:
            return f"{_got(item)} at [{i}]"
    return None


def _plain(value: Any) -> str | None:
    """Plain data: str, int, float, bool, None, and tuples, lists and str-keyed dicts of them."""
    stack = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if depth >= MAX_DEPTH:
            return f"nesting deeper than {MAX_DEPTH} at {path or 'top'}"
        if kind is list or kind is tuple:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(item) if type(v) not in _SCALARS)
        elif kind is dict:
            for key, v in item.items():
                if type(key) is not str:
                    return f"dict key {_got(key)} at {path or 'top'}: keys must be str"
                if type(v) not in _SCALARS:
                    stack.append((v, f"{path}[{key!r}]", depth + 1))
        else:
            where = f" at {path}" if path else ""
            return f"{type(item).__module__}.{type(item).__qualname__}{where} is not plain data"
    return None


_SCALARS = frozenset({str, int, float, bool, type(None)})

#: Type name (as docs/graph.md shows it) to its check.
KINDS: dict[str, Callable[[Any], str | None]] = {
    "int": _scalar(int),
    "int >= 0": _count,
    "int >= 0 or None": _count_or_none,
    "str": _scalar(str),
    "str or None": _str_or_none,
    "bool": _scalar(bool),
    "float or None": lambda v: None if v is None or type(v) is float else _got(v),
    "op": _enum("placeholder", "get_attr", "call_function", "call_method", "call_module", "output"),
    "phase": _enum("forward", "backward"),
    "level": _enum("module", "aten", "joint"),
    "branch role or None": _or_none(_enum("fork", "merge", "skip", "residual", "branch")),
    "int >= 0 or str": _arg,
    "shape": _nested(_shape_leaf),
    "dtype": _nested(_str_or_none),
    "plain dict": lambda v: _got(v) if type(v) is not dict else _plain(v),
    "dict str -> str": _mapping(_scalar(str)),
    "dict str -> str or None": _mapping(_str_or_none),
    "list of str": _str_list,
    "inputs": _records(name=_scalar(str), shape=_nested(_shape_leaf), dtype=_nested(_str_or_none)),
    "primals": _mapping(lambda v: _record({"kind": _enum("parameter", "buffer", "input"),
                                           "name": _scalar(str)}, v)),
    "capture options": lambda v: _record(
        {"routes": _str_list, "route": _str_or_none, "leaf_modules": _str_list,
         "concrete_args": lambda c: _got(c) if type(c) is not dict else _plain(c),
         "level": _enum("module", "aten", "joint"), "leaf_on_failure": _scalar(bool),
         "opaque": _str_list},
        v,
    ),
    # kind from format 4 on: a format 3 file's records have none
    "skip connections": _records(frozenset({"kind"}), merge=_scalar(str), fork=_scalar(str),
                                 skip=_str_list, residual=_str_list,
                                 kind=_enum("identity", "projection", "parallel")),
    "kernel or None": _kernel,
    "tied parameters": _mapping(lambda v: _record({"same_as": _scalar(str), "numel": _count,
                                                  "trainable": _scalar(bool)}, v)),
}

#: When an attribute is present, in the words docs/graph.md uses.
PRESENCE = {
    "always": "always",
    "format_2": "from format_version 2 on",
    "make_fx": "when capture is make_fx",
    "fixed_kwargs": "when fxnx set keyword inputs",
    "costs": "when G.graph has flops",
    "skip_connections": "after skip_connections",
    "skips_found": "when skip_connections found any",
    "opaque": "when a submodule was kept whole",
    "route_credit": "after route_credit",
    "module": "when the model is an nn.Module",
    "tied": "when the model reaches a parameter under several names",
    "writes_input": "when the module it calls writes into its input in place",
    "returns_input": "when the module it calls returns its input itself",
}

GRAPH_ATTRIBUTES = (
    Attribute("format_version", "int >= 0", "always",
              "version of this contract; a reader refuses versions newer than its own"),
    Attribute("fxnx_version", "str", "always", "the fxnx that made the graph"),
    Attribute("torch_version", "str", "always", "the torch that captured the model"),
    Attribute("model", "str", "always", "qualified class name of the model"),
    Attribute("capture", "str", "always",
              "route that captured the graph: symbolic_trace, graph_module, export, "
              "draft_export or make_fx"),
    Attribute("capture_options", "capture options", "format_2",
              "every option that made the graph, so it can be captured again exactly: "
              "{routes: tried in order, route: the one that won, leaf_modules: paths, "
              "class:<qualified name> and torch.nn, concrete_args, level, leaf_on_failure, "
              "opaque: submodules kept whole because tracing failed}"),
    Attribute("capture_failures", "dict str -> str", "always",
              "route to why it failed, for the routes tried before capture"),
    Attribute("level", "level", "always", "module, aten or joint"),
    Attribute("shape_source", "str or None", "always",
              "ShapeProp, FakeTensor, meta or make_fx; None without example inputs"),
    Attribute("inputs", "inputs", "always",
              "one {name, shape, dtype} per placeholder, in order"),
    Attribute("modules", "dict str -> str", "always",
              "module path to qualified class name; \"\" is the model"),
    Attribute("training", "bool", "module",
              "the model's mode (model.training) when it was captured: a route that runs the "
              "model's Python (symbolic_trace, export) keeps the branches of that mode"),
    Attribute("num_params", "int >= 0", "always", "parameters of the model"),
    Attribute("trainable_params", "int >= 0", "costs",
              "parameters of the model that train (requires_grad); the rest are frozen"),
    Attribute("tied_parameters", "tied parameters", "tied",
              "each name of a parameter the model reaches under several names (tied weights), "
              "but the first, to {same_as: the first name, numel, trainable}: a module that "
              "holds it under both counts it once"),
    Attribute("flops", "int >= 0 or None", "costs",
              "FLOPs of all nodes, forward and (joint graphs) backward, as FlopCounterMode "
              "counts them; None without shapes or if any node's is None"),
    Attribute("macs", "int >= 0 or None", "costs",
              "multiply-adds of all nodes; None where flops is, or a node's is"),
    Attribute("opaque_modules", "list of str", "opaque",
              "submodules kept whole because tracing failed in them (leaf_on_failure)"),
    Attribute("fixed_kwargs", "plain dict", "fixed_kwargs",
              "keyword inputs fxnx set because forward has them and the caller did not pass "
              "them: use_cache=False (a cache is generation state, not dataflow)"),
    Attribute("primals", "primals", "make_fx",
              "primals_* placeholder to {kind: parameter, buffer or input, name}"),
    Attribute("tangents", "dict str -> str", "make_fx",
              "tangents_* placeholder to the output it is the gradient of (output[0])"),
    Attribute("gradients", "dict str -> str or None", "make_fx",
              "parameter or input name to the node computing its gradient (joint level)"),
    Attribute("specialised", "bool", "make_fx",
              "whether a tensor's value decided control flow: the graph holds for this input only"),
    Attribute("skip_connections", "skip connections", "skips_found",
              "one {merge, fork, skip, residual, kind} per fork and merge skip_connections "
              "returned, node names; kind is identity, projection or parallel (from format 4)"),
    Attribute("credit_rule", "str", "route_credit", "the rule route_credit used"),
)

NODE_ATTRIBUTES = (
    Attribute("op", "op", "always",
              "fx opcode: placeholder, get_attr, call_function, call_method, call_module, output"),
    Attribute("target", "str", "always",
              "what is called: operator.add, a module path, a method name, an ATen overload"),
    Attribute("module_type", "str or None", "always",
              "qualified class name of a call_module node's module"),
    Attribute("scope", "str", "always", "path of the module whose forward made the call"),
    Attribute("order", "int >= 0", "always", "position in fx order"),
    Attribute("out_shape", "shape", "always",
              "output shape; a list or dict of shapes for several outputs; None if unknown"),
    Attribute("out_dtype", "dtype", "always", "output dtype such as torch.float32, nested like out_shape"),
    Attribute("out_type", "str or None", "always", "qualified type name of the output value"),
    Attribute("num_params", "int >= 0", "always", "parameters the node owns"),
    Attribute("trainable_params", "int >= 0", "costs",
              "those of the node's parameters that train (requires_grad)"),
    Attribute("flops", "int >= 0 or None", "costs",
              "FLOPs of the node's call as FlopCounterMode counts them (matrix products, "
              "convolutions, attention; 0 for the rest); None without shapes or where it "
              "cannot run on meta tensors"),
    Attribute("macs", "int >= 0 or None", "costs",
              "multiply-adds: flops / 2, as torch's formulas count two FLOPs per "
              "multiply-add; None where flops is, or for an operator registered by a user"),
    Attribute("kernel", "kernel or None", "costs",
              "window of a convolution or pooling node: {kernel_size, stride, padding, "
              "dilation, groups, transposed}; None on other nodes"),
    Attribute("node_call_info", "plain dict", "always",
              "the call's arguments bound to the callee's parameter names, defaults filled in"),
    Attribute("phase", "phase", "always", "forward or backward (joint graphs)"),
    Attribute("opaque", "bool", "always", "a submodule kept whole because tracing failed in it"),
    Attribute("writes_input", "bool", "writes_input",
              "True: the module a call_module node calls writes into its input in place "
              "(nn.ReLU(inplace=True)) and returns it"),
    Attribute("returns_input", "bool", "returns_input",
              "True: the module a call_module node calls returns its input itself, no new "
              "tensor (a dropout layer in eval mode)"),
    Attribute("branch_role", "branch role or None", "skip_connections",
              "fork, merge, skip or residual: the node's part in the innermost skip connection; "
              "branch on the branches of a parallel one"),
    Attribute("branch_merge", "str or None", "skip_connections",
              "the merge node of that skip connection; None off every branch"),
    Attribute("credit_norm", "float or None", "route_credit",
              "Euclidean norm of the credit at the node; None where it has none"),
)

EDGE_ATTRIBUTES = (
    Attribute("arg", "int >= 0 or str", "always",
              "where the source appears in the call: a position, a name, or a path (tensors[1])"),
    Attribute("shape", "shape", "always", "shape of the value carried"),
    Attribute("dtype", "dtype", "always", "dtype of the value carried"),
    Attribute("nbytes", "int >= 0 or None", "always", "bytes of the value carried, if known"),
    Attribute("branch_role", "branch role or None", "skip_connections",
              "skip or residual: the edge's branch in the innermost skip connection; branch "
              "on the branches of a parallel one"),
    Attribute("branch_merge", "str or None", "skip_connections",
              "the merge node of that skip connection; None off every branch"),
)


# --- validate -----------------------------------------------------------------------------------


def validate(G: Any) -> None:
    """Check that ``G`` is a graph as :func:`fxnx.convert` makes it; raise if not.

    Checks that ``G`` is a ``networkx.MultiDiGraph`` with at least one node and
    no cycle, that ``format_version`` is one this fxnx knows, that every
    attribute in the contract tables present on the graph, its nodes and edges
    has its type (and that those the graph always has are there), and that
    everything else is plain data: str, int, float, bool, None, and tuples,
    lists and str-keyed dicts of them, nested at most 32 deep.

    Raises
    ------
    GraphContractError
        Saying which graph, node or edge attribute is wrong, what was expected
        and what it holds.

    Examples
    --------
    >>> G = nx.MultiDiGraph(format_version=FORMAT_VERSION + 1)
    >>> validate(G)
    Traceback (most recent call last):
    ...
    fxnx.errors.GraphContractError: G.graph['format_version'] is 5, newer than the 4 this fxnx knows: upgrade fxnx (pip install -U fxnx)
    """
    if not isinstance(G, nx.MultiDiGraph):
        raise GraphContractError(f"G must be a networkx.MultiDiGraph, got {_got(G)}")
    if type(G.graph) is not dict:
        raise GraphContractError(f"G.graph must be a dict of graph attributes, got {_got(G.graph)}")
    _check_version(G.graph.get("format_version", None), "format_version" in G.graph)
    required = {"always"}
    if G.graph.get("capture") == "make_fx":
        required.add("make_fx")
    if G.graph["format_version"] >= 2:
        required.add("format_2")
    if "flops" in G.graph:
        required.add("costs")
    _check_attributes(G.graph, _GRAPH, required, "G.graph")
    if not G:
        raise GraphContractError("G has no nodes: an fxnx graph has at least its output node")
    for node, data in G.nodes(data=True):
        if type(node) is not str:
            raise GraphContractError(f"node {_got(node)}: node names must be str")
        # cast: mypy cannot infer a lambda with defaults
        _check_attributes(data, _NODE, required, cast("Callable[[], str]", lambda node=node: f"node {_SHORT.repr(node)}"))
    for u, v, key, data in G.edges(keys=True, data=True):
        if type(key) is not int:
            raise GraphContractError(
                f"edge {_SHORT.repr(u)} -> {_SHORT.repr(v)} key {_got(key)}: edge keys must be int"
            )
        _check_attributes(
            data, _EDGE, required,
            cast("Callable[[], str]", lambda u=u, v=v, key=key: f"edge {_SHORT.repr(u)} -> {_SHORT.repr(v)} (key {key})"),
        )
    if not nx.is_directed_acyclic_graph(G):
        cycle = [u for u, *_ in nx.find_cycle(G)]
        raise GraphContractError(
            f"G has a cycle ({' -> '.join(map(repr, [*cycle, cycle[0]]))}): dataflow graphs are acyclic"
        )


def _check_version(version: Any, present: bool) -> None:
    if not present:
        raise GraphContractError("G.graph has no 'format_version': not an fxnx graph")
    if type(version) is not int or version < 1:
        raise GraphContractError(
            f"G.graph['format_version'] must be an int from 1 to {FORMAT_VERSION} (the versions "
            "this fxnx knows), "
            f"got {_got(version)}"
        )
    if version > FORMAT_VERSION:
        raise GraphContractError(
            f"G.graph['format_version'] is {version}, newer than the {FORMAT_VERSION} this fxnx "
            "knows: upgrade fxnx (pip install -U fxnx)"
        )


_Table = dict[str, tuple[Callable[[Any], str | None], str, str]]


def _table(attributes: tuple[Attribute, ...]) -> _Table:
    return {a.name: (KINDS[a.kind], a.kind, a.present) for a in attributes}


_GRAPH, _NODE, _EDGE = map(_table, (GRAPH_ATTRIBUTES, NODE_ATTRIBUTES, EDGE_ATTRIBUTES))


def _check_attributes(
    data: dict[str, Any], table: _Table, required: set[str], where: str | Callable[[], str]
) -> None:
    """Check one attribute dict; ``where`` names it in errors (a callable: spelt out only then).

    ``required``: the presence conditions (keys of :data:`PRESENCE`) that hold for this graph.
    """
    for name, (_, _, present) in table.items():
        if name not in data and present in required:
            raise GraphContractError(
                f"{_spelt(where)} lacks attribute {name!r} ({PRESENCE[present]} present in fxnx graphs)"
            )
    for name, value in data.items():
        spec = table.get(name)
        if spec is None:
            if type(name) is not str:
                raise GraphContractError(f"{_spelt(where)}: attribute names must be str, got {_got(name)}")
            problem = None if type(value) in _SCALARS else _plain(value)
            if problem:
                raise GraphContractError(f"{_spelt(where)} attribute {name!r}: {problem}")
            continue
        check, kind, _ = spec
        problem = check(value)
        if problem:
            raise GraphContractError(
                f"{_spelt(where)} attribute {name!r} must be {_describe(kind)}, got {problem}"
                + _read_elsewhere(value, kind)
            )


#: How fxnx's JSON files keep a tuple, which JSON lacks (``fxnx._files``).
TUPLE_KEY = "__tuple__"


def _read_elsewhere(value: Any, kind: str) -> str:
    """Where a value shows the graph was read by another reader than fxnx's: networkx's own
    ``node_link_graph`` leaves fxnx's JSON tuples encoded, GraphML keeps structures as text."""
    if _holds_tuple_key(value):
        return (
            f". It holds fxnx's JSON form of a tuple ({{{TUPLE_KEY!r}: [...]}}): the file was read "
            "by networkx's own node_link_graph, not fxnx's reader. Read it with fxnx.read_json"
        )
    if isinstance(value, str) and "str" not in kind and value[:1] in "[{(":
        return (
            ". It is text where structured data belongs, as GraphML stores it: fxnx writes "
            "GraphML for other tools, and reads graphs back from its JSON and pickle files "
            "(fxnx.read_json, fxnx.read_pickle)"
        )
    return ""


def _holds_tuple_key(value: Any, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if isinstance(value, dict):
        return TUPLE_KEY in value or any(_holds_tuple_key(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tuple_key(v, depth + 1) for v in value)
    return False


def _spelt(where: str | Callable[[], str]) -> str:
    return where if isinstance(where, str) else where()


def _describe(kind: str) -> str:
    allowed = getattr(KINDS[kind], "allowed", None)
    if allowed:
        return "one of " + ", ".join(map(repr, allowed))
    return {
        "shape": "a shape (None, a tuple of int >= 0 or str, or a list or str-keyed dict of shapes)",
        "dtype": "a dtype (None, a str, or a list or str-keyed dict of dtypes)",
        "plain dict": "a dict of plain data",
        "inputs": "a list of {name, shape, dtype} dicts",
        "primals": "a dict of {kind, name} dicts",
        "tied parameters": "a dict of {same_as, numel, trainable} dicts",
        "skip connections": "a list of {merge, fork, skip, residual, kind} dicts",
        "kernel or None": "None or a {kernel_size, stride, padding, dilation, groups, "
                          "transposed} dict",
    }.get(kind, "an " + kind if kind[0] in "aeio" else "a " + kind)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def explained(analysis: Callable[Concatenate[Any, _P], _R]) -> Callable[Concatenate[Any, _P], _R]:
    """``analysis(G, ...)``, where it fails on a graph that breaks the contract (a graph read
    back by networkx alone from JSON or GraphML holds lists or strings where fxnx keeps
    tuples), raising :func:`validate`'s error, which names the attribute, instead of the
    Python error deep inside. Errors of fxnx's own, and failures on a valid graph, pass."""

    @functools.wraps(analysis)
    def checked(G: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return analysis(G, *args, **kwargs)
        except FxnxError:
            raise
        except (TypeError, KeyError, AttributeError, IndexError, ValueError, RecursionError) as err:
            try:
                validate(G)
            except GraphContractError as broken:
                raise GraphContractError(
                    f"{analysis.__name__} cannot read G, which is not a graph as fxnx.convert "
                    f"makes it: {broken}. A graph written and read back by networkx alone "
                    "(node_link_data, GraphML) loses its tuples: keep it with fxnx's own writers "
                    "and readers (fxnx.write_json and fxnx.read_json, or the pickle pair)"
                ) from err
            raise

    return checked
