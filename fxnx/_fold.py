"""Listing parameters on the op that reads them: the parameters, buffers and constants that one
node alone reads are written on it rather than drawn beside it.

Used by :mod:`fxnx.render` on what it draws; no pydot, no torch.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

__all__ = ["LISTED", "fold_parameters", "folded_parameters"]

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
    takes in to that module's node in the view drawn (:func:`fxnx._collapse.collapse`); a
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
