"""The view: what of ``G`` is drawn, made on a copy, never on ``G``.

In the order :func:`view_of` applies them: the model's checks left out (assertions and the
reads that only feed them, :func:`without_checks`), modules nested deeper than a depth
collapsed into one node each (:func:`collapse`), the parameters that one node alone reads
listed on it (:func:`fold_parameters`), and skip connections marked
(:func:`fxnx.skip_connections`, on the view). No pydot, no torch.

Checks. Models check their inputs as they run (timm: ``_assert(H == self.img_size[0])``,
torch.fx: ``_assert_is_none``). Tracing records each check as a chain of nodes
(``getattr`` of ``x.shape``, ``getitem``, ``eq``, ``_assert``) that leads nowhere
the model's output depends on; so does a read whose value is dropped (the ``_`` of
``out, _ = attn(x)``). Drawings leave them out unless asked
(``checks=True``): in Swin-T they are half a figure's width.
"""

from __future__ import annotations

import os
from typing import Any

import networkx as nx

from .._analysis import cycle_error, marked, skip_connections, topological_order
from .._errors import FxnxValueError

#: Calls that test a value and return nothing the model uses (matched on any dotted part of the
#: node's target, so ``torch._assert``, ``aten._assert_async.msg`` and ``_assert_is_none`` all are).
ASSERTIONS = frozenset({
    "_assert", "_assert_async", "_assert_is_none", "_assert_scalar", "_assert_tensor_metadata",
    "_check", "_check_is_size", "sym_constrain_range", "sym_constrain_range_for_size",
})


#: Reads with no effect: one whose value nothing uses belongs to a check (the f-string of an
#: assertion's message reads ``x.ndim`` again).
READS = frozenset({"getattr", "getitem", "size", "dim", "numel"})


def _called(data: dict[str, Any]) -> set[str]:
    if data.get("op") not in ("call_function", "call_method"):
        return set()
    return set(str(data.get("target") or "").split("."))


def check_nodes(G: nx.MultiDiGraph) -> set[Any]:
    """The nodes of ``G`` that only check values: assertions, and nodes all of whose users are
    checks. A node with any use outside checks (a shape that also sizes a ``view``) is kept,
    and so is an assertion whose result is used.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "getattr"), ("getattr", "eq"), ("eq", "_assert"),
    ...                      ("x", "relu"), ("relu", "output")])
    >>> nx.set_node_attributes(G, "call_function", "op")
    >>> nx.set_node_attributes(G, {"x": "placeholder", "output": "output"}, "op")
    >>> nx.set_node_attributes(G, {"getattr": "builtins.getattr", "eq": "_operator.eq",
    ...                            "_assert": "torch._assert", "relu": "torch.relu"}, "target")
    >>> sorted(check_nodes(G))
    ['_assert', 'eq', 'getattr']
    """
    checks: set[Any] = set()
    # Users before the nodes they read: any topological order will do, so not fxnx's stable one.
    for node in reversed(list(nx.topological_sort(G))):
        data = G.nodes[node]
        if data.get("op") in ("placeholder", "output"):
            continue
        users = set(G.successors(node))
        if users:
            if users <= checks:
                checks.add(node)
        elif _called(data) & (ASSERTIONS | READS):
            checks.add(node)
    return checks


def without_checks(G: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """A copy of ``G`` without its checks, or ``G`` itself when it has none; the copy's
    ``graph["checks_left_out"]`` counts the assertions left out."""
    checks = check_nodes(G)
    if not checks:
        return G
    H = G.copy()
    H.remove_nodes_from(checks)
    H.graph["checks_left_out"] = sum(bool(_called(G.nodes[n]) & ASSERTIONS) for n in checks)
    return H


#: The attribute, on a node of a drawn view, that lists the parameters it alone reads:
#: (node name, target, shape) of each. Private to drawings: never set on the user's graph.
LISTED = "_listed_parameters"


def fold_parameters(G: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """``G`` with the parameters, buffers and constants (``get_attr`` nodes) that one node alone
    reads listed on that node instead of drawn as nodes of their own (``G`` itself when there
    are none).

    The reader's :data:`LISTED` holds the name, target and shape of each, in
    ``G``'s order: timm's normalisation layers read four tensors in one call, which
    drawn side by side set the figure's width. One that several nodes read, or that
    the model returns, stays a node. (In joint and ATen graphs parameters are inputs,
    ``primals``: drawn as nodes.)

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "norm"), ("w", "norm"), ("w2", "a"), ("w2", "b")])
    >>> nx.set_node_attributes(G, {"w": "get_attr", "w2": "get_attr"}, "op")
    >>> H = fold_parameters(G)
    >>> sorted(H), [name for name, *_ in H.nodes["norm"][LISTED]]
    (['a', 'b', 'norm', 'w2', 'x'], ['w'])
    """
    folded = folded_parameters(G)
    if not folded:
        return G
    H = G.copy()
    H.remove_nodes_from(folded)
    for node, reader in folded.items():
        data = G.nodes[node]
        H.nodes[reader][LISTED] = [*H.nodes[reader].get(LISTED, ()),
                                   (node, data.get("target"), data.get("out_shape"))]
    return H


def folded_parameters(G: nx.MultiDiGraph, group: dict[Any, Any] | None = None) -> dict[Any, Any]:
    """Each ``get_attr`` node that one node alone reads, to that node: what
    :func:`fold_parameters` lists. ``group`` maps the nodes of ``G`` that a collapsed module
    takes in to that module's node in the view drawn (:func:`collapse`); a
    parameter it takes in is no node of its own, and one that a module's nodes alone read is
    listed on the module (by default every node is drawn as itself).

    Examples
    --------
    >>> G = nx.MultiDiGraph([("w", "norm"), ("w", "norm"), ("b", "output"), ("norm", "output")])
    >>> nx.set_node_attributes(G, {"w": "get_attr", "b": "get_attr", "output": "output"}, "op")
    >>> folded_parameters(G)  # read twice by one node: listed; returned: kept
    {'w': 'norm'}
    """
    group = group or {}
    folded = {}
    for node, op in G.nodes(data="op"):
        if op == "get_attr" and node not in group:
            # A module's node and a node of G drawn as itself are told apart even where they
            # share a name (the view renames the node).
            readers = {("module", group[v]) if v in group else ("node", v)
                       for v in G.successors(node)}
            if len(readers) != 1:
                continue
            ((kind, reader),) = readers
            returned = kind == "node" and G.nodes[reader].get("op") == "output"
            if not returned:
                folded[node] = reader
    return folded


#: Appended to a module's path to name the collapsed node of its backward ops.
BACKWARD_SUFFIX = " (backward)"


#: The parts and characters of a module path that a drawing uses: real models nest a dozen
#: deep in a hundred characters; a crafted graph's longer paths, a box and a depth for each
#: part, would cost time quadratic in them.
MAX_NESTING, MAX_PATH = 32, 1000


def module_path(path: str) -> str:
    """``path`` cut to its first :data:`MAX_NESTING` parts and :data:`MAX_PATH` characters.

    Examples
    --------
    >>> module_path("layer1.0.conv1"), module_path(".".join("a" * 40)).count(".") + 1
    ('layer1.0.conv1', 32)
    """
    return ".".join(path[:MAX_PATH].split(".")[:MAX_NESTING])


def _path(data: dict[str, Any]) -> str:
    """The module path a node belongs to: the module itself for call_module, else its scope."""
    return module_path(str(data["target"] if data.get("op") == "call_module"
                           else (data.get("scope") or "")))


def module_depth(G: nx.MultiDiGraph) -> int:
    return max((len(_path(d).split(".")) for _, d in G.nodes(data=True) if _path(d)), default=0)


def collapse(
    G: nx.MultiDiGraph, depth: int, *, order: list[Any] | None = None, skips: bool = True
) -> nx.MultiDiGraph:
    """Replace every module nested deeper than ``depth`` by one node for its ancestor at ``depth``.

    The collapsed node of a module is named by its path (``layer1``); a node of
    ``G`` that is drawn as itself but has that name too (a function
    ``blk`` called beside a module ``blk``) is renamed ``"blk (node)"`` in the
    view, never merged with the module. A module whose calls would close a
    cycle once merged (one module called at several places) is left expanded.
    ``order`` is ``G``'s topological order if already known; without ``skips``
    the view's skip connections are not marked (enough to predict its layout).

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "blk"), ("blk", "blk_0"), ("blk_0", "output")])
    >>> nx.set_node_attributes(G, {"x": "", "blk": "", "blk_0": "blk", "output": ""}, "scope")
    >>> list(collapse(G, 1))
    ['x', 'blk (node)', 'blk', 'output']
    """
    group = _groups(G, depth)
    order = order if order is not None else topological_order(G)
    H = _grouped(G, group, order)
    # Every module on a cycle of the view stays expanded, all at once: a cycle left after that
    # would lie among nodes of G alone, which has none, so one pass is enough.
    cyclic = {n for part in nx.strongly_connected_components(H) if len(part) > 1 for n in part}
    if cyclic:
        group = {n: key for n, key in group.items() if key not in cyclic}
        H = _grouped(G, group, order)
    if skips:
        skip_connections(H)  # the skip connections still visible once modules are collapsed
    return H


def collapsed_size(G: nx.MultiDiGraph, depth: int) -> int:
    """How many nodes ``G`` is drawn with at ``depth``, at least, without building the view:
    :func:`collapse`, then :func:`fold_parameters`.

    A module whose merged calls would close a cycle stays expanded, so the view
    may have more.

    Examples
    --------
    >>> G = nx.MultiDiGraph([("x", "a"), ("a", "b"), ("b", "output")])
    >>> nx.set_node_attributes(G, {"x": "", "a": "block", "b": "block", "output": ""}, "scope")
    >>> collapsed_size(G, 1), collapse(G, 1).number_of_nodes()
    (3, 3)
    """
    group = _groups(G, depth)
    kept = G.number_of_nodes() - len(group)
    return len(set(group.values())) + kept - len(folded_parameters(G, group))


def _groups(G: nx.MultiDiGraph, depth: int) -> dict[Any, str]:
    """The nodes that a module collapsed at ``depth`` takes in, each to that module's node (its
    path at ``depth``); the nodes drawn as themselves are not in it."""
    if depth < 1:
        raise FxnxValueError(f"depth must be 1 or more, got {depth}")
    group: dict[Any, str] = {}
    owners = {  # a parameter or buffer belongs to the module that owns it
        node: module_path(primal["name"].rpartition(".")[0])
        for node, primal in G.graph.get("primals", {}).items() if primal["kind"] != "input"
    }
    owners.update(  # a constant that tracing made (_tensor_constant0) belongs to where it is used
        (node, module_path(data["target"].rpartition(".")[0] or str(data.get("scope") or "")))
        for node, data in G.nodes(data=True) if data.get("op") == "get_attr"
    )
    for node, owner in owners.items():  # a weight tied across modules belongs to what they share
        if node in G:  # (primals name the graph's inputs, some of which no node holds)
            owners[node] = _shared_path([owner, *(_path(G.nodes[user]) for user in G.successors(node))])
    for node, data in G.nodes(data=True):
        path = owners.get(node, _path(data))
        parts = path.split(".") if path else []
        leaf_call = data.get("op") == "call_module" and len(parts) == depth
        # In a joint graph a module's backward ops form a node of their own.
        suffix = BACKWARD_SUFFIX if data.get("phase") == "backward" else ""
        if len(parts) >= depth and not leaf_call:
            group[node] = ".".join(parts[:depth]) + suffix
    return group


def _shared_path(paths: list[str]) -> str:
    """The deepest module path that every one of ``paths`` lies in ("" for the model)."""
    return ".".join(os.path.commonprefix([path.split(".") if path else [] for path in paths]))


def _names(G: nx.MultiDiGraph, group: dict[Any, str]) -> dict[Any, Any]:
    """Each node's name in the view: its module's for a node ``group`` takes in, else its own,
    renamed (``"blk (node)"``) where a collapsed module has that name."""
    taken = set(group.values())
    names: dict[Any, Any] = {}
    for node in G:
        if node in group:
            names[node] = group[node]
            continue
        name = node
        while name in taken:
            name = f"{name} (node)"
        if name != node:
            taken.add(name)
        names[node] = name
    return names


def _grouped(G: nx.MultiDiGraph, group: dict[Any, str], order: list[Any]) -> nx.MultiDiGraph:
    modules = G.graph.get("modules", {})
    names = _names(G, group)
    H = nx.MultiDiGraph(**{k: v for k, v in G.graph.items() if k != "skip_connections"})
    for node in order:
        key, data = names[node], G.nodes[node]
        if node not in group:
            H.add_node(key, **_without_roles(data))
            continue
        if key not in H:
            path = key.removesuffix(BACKWARD_SUFFIX)
            H.add_node(key, op="module", target=path, module_type=modules.get(path),
                       scope=path.rpartition(".")[0], order=data.get("order"), members=0,
                       phase="backward" if path != key else "forward")
        H.nodes[key]["members"] += 1
        for attr in ("credit_norm", "out_shape"):  # the value at the module's output
            if data.get(attr) is not None:
                H.nodes[key][attr] = data[attr]
    bundles: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for u, v, data in G.edges(data=True):
        if names[u] != names[v]:
            bundles.setdefault((names[u], names[v]), []).append(data)
    for (gu, gv), edges in bundles.items():
        # One edge per pair of nodes; several distinct tensors become one edge that counts them.
        distinct = {str(d.get("shape")) for d in edges}
        data = _without_roles(edges[0])
        if len(distinct) > 1:
            data.update(shape=None, tensors=len(distinct))
        H.add_edge(gu, gv, **data)
    return H


def _without_roles(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in ("branch_role", "branch_merge")}


def acyclic(G: nx.MultiDiGraph) -> None:
    """Refuse a graph with a cycle at once, naming its nodes, rather than deep in a layout."""
    if not nx.is_directed_acyclic_graph(G):
        raise cycle_error(G)


def view_of(G: nx.MultiDiGraph, depth: int | None, *, fold: bool = True) -> nx.MultiDiGraph:
    """What is drawn of ``G`` at ``depth``, its skip connections marked: the collapsed view,
    or else a copy marked afresh. With ``fold``, the parameters
    that one node alone reads are listed on it (:func:`fold_parameters`);
    coloured by a value, each keeps a node in its own colour."""
    # marked afresh on a copy: marks written before G was edited would be stale, and drawing
    # never writes into the caller's graph
    view = collapse(G, depth) if depth is not None else marked(G)
    return listed(view, fold)


def listed(view: nx.MultiDiGraph, fold: bool) -> nx.MultiDiGraph:
    """``view`` with, if ``fold``, the parameters that one node alone reads listed on it."""
    return fold_parameters(view) if fold else view
