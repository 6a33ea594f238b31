"""Collapsing modules: every module nested deeper than a depth becomes one node.

Used by :mod:`fxnx.render` to draw large models; no pydot, no torch.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from ._fold import folded_parameters
from .analysis import skip_connections, topological_order
from .errors import FxnxValueError

__all__ = ["BACKWARD_SUFFIX", "MAX_NESTING", "collapse", "collapsed_size", "module_depth",
           "module_path"]

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
    :func:`collapse`, then :func:`fxnx._fold.fold_parameters`.

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
    for node, data in G.nodes(data=True):
        path = owners.get(node, _path(data))
        parts = path.split(".") if path else []
        leaf_call = data.get("op") == "call_module" and len(parts) == depth
        # In a joint graph a module's backward ops form a node of their own.
        suffix = BACKWARD_SUFFIX if data.get("phase") == "backward" else ""
        if len(parts) >= depth and not leaf_call:
            group[node] = ".".join(parts[:depth]) + suffix
    return group


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
