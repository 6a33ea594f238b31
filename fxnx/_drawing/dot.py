"""The DOT assembly: a view of ``G``, styled, as a ``pydot.Dot``; the only module that imports
pydot (inside its functions).

Nodes and edges are added in ``G``'s order, so the same graph gives the same DOT text in any
process; every string from the graph reaches DOT through :mod:`.style`.
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from .._analysis import topological_order
from .._contract import explained
from .._errors import FxnxTypeError, FxnxValueError
from .estimate import beside_consumers
from .style import (
    BOX_SIZE,
    FONT,
    NAME_SIZE,
    PLAIN,
    TEXT_SIZE,
    Scale,
    cluster_label,
    edge_style,
    legend,
    node_id,
    node_style,
)
from .view import acyclic, module_path, view_of, without_checks


@explained
def to_pydot(
    G: nx.MultiDiGraph,
    *,
    depth: int | None = None,
    color_by: str | None = None,
    clusters: bool = True,
    rankdir: str = "TB",
    checks: bool = False,
) -> Any:
    """A ``pydot.Dot`` drawing of ``G``: skip branches marked, shapes on edges.

    Node ids are the node names (a collapsed module's id is its path), so
    ``P.get_node("layer1_0_conv1")`` finds a node and SVG output names each
    node's element after it; each node's tooltip gives its op, target and
    output shape. The parameters and buffers that one node alone reads are
    listed on it, in italics, rather than drawn as nodes (coloured by
    ``color_by``, each keeps a node in its own colour). A string longer than
    80 characters (200 on a tooltip's line) is cut short with an ellipsis, and
    a node id that long ends in a hash of the whole name: the DOT text grows
    with the nodes and edges drawn, not with what their strings hold.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert`. Drawn whole, ``G``'s skip
        connections are found (and annotated on it) unless it already carries
        them; a collapsed view gets its own.
    depth : int, optional
        Collapse every module nested deeper than ``depth`` into one node
        (``depth=1`` shows ResNet's four stages as four nodes).
    color_by : str, optional
        A numeric node attribute (such as ``"credit_norm"`` from credit
        routing) to colour nodes by, with a colour bar in the legend; a log
        scale when the values are positive and span more than two decades.
    clusters : bool
        Draw module boundaries (from each node's ``scope``) as boxes, nested at
        most 32 deep.
    rankdir : {"TB", "LR"}
        Top to bottom, or left to right. Top to bottom, an edge's shape is set
        beside it (``xlabel``); left to right, where the edges between ranks are
        short, it is the edge's own label, which dot makes room for, so that no
        shape covers a node.
    checks : bool
        Draw the model's checks: assertions (``torch._assert``), the reads
        that only feed them (``x.shape``, ``eq``), and reads nothing uses (the
        ``_`` of ``out, _ = attn(x)``). Left out by default, assertions counted
        in the legend: the output depends on none of them.

    Returns
    -------
    pydot.Dot

    Examples
    --------
    >>> import torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> P = to_pydot(G)
    >>> print(P.to_string().splitlines()[0])
    digraph fxnx {
    >>> [n.get_name() for n in P.get_node("_0")]
    ['_0']
    """
    check_options({"rankdir": rankdir})
    acyclic(G)
    view = view_of(G if checks else without_checks(G), depth, fold=color_by is None)
    return pydot_of(view, color_by=color_by, clusters=clusters, rankdir=rankdir)


def check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - {"color_by", "clusters", "rankdir", "checks"})
    if unknown:
        raise FxnxTypeError(
            f"draw() got unknown option {unknown[0]!r}: use depth, color_by, clusters, rankdir "
            "or checks"
        )
    if options.get("rankdir", "TB") not in ("TB", "LR"):
        raise FxnxValueError(f"rankdir must be 'TB' or 'LR', got {options['rankdir']!r}")


def pydot_of(view: nx.MultiDiGraph, *, color_by: str | None, clusters: bool, rankdir: str,
           graph_attrs: dict[str, str] | None = None) -> Any:
    import pydot

    dot = pydot.Dot(
        "fxnx", graph_type="digraph", rankdir=rankdir, fontname=FONT, nodesep="0.25",
        ranksep="0.28", newrank="true", **(graph_attrs or {}),
    )
    dot.set_node_defaults(fontname=FONT, fontsize=str(NAME_SIZE), shape="box", style="rounded,filled",
                          margin="0.08,0.04", height="0.3")
    dot.set_edge_defaults(fontname=FONT, fontsize=str(TEXT_SIZE), color=PLAIN, fontcolor="#3C4043",
                          arrowsize="0.6")
    scale = Scale(view, color_by) if color_by else None
    parents = _clusters(dot, view) if clusters else {}
    primals = view.graph.get("primals", {})
    order = topological_order(view)
    for node in order:
        data = view.nodes[node]
        # Declared at the top, so that P.get_node(name) finds it; named in its module's box.
        # Any values: a str could fill pydot's obj_dict parameter, so mypy refuses **dict[str, str]
        attrs: dict[str, Any] = node_style(node, data, scale, primals.get(node), boxed=clusters)
        dot.add_node(pydot.Node(node_id(node), **attrs))
        cluster = parents.get(module_path(str(data.get("scope") or "")))
        if cluster is not None:
            cluster.add_node(pydot.Node(node_id(node)))
    beside = beside_consumers(view)  # parameters sit beside their consumer, in its box
    # Edges in the nodes' order, whatever order they were added in (a subgraph's can follow a
    # set's): the same graph gives the same DOT text, and dot the same picture, in any process.
    index = {node: i for i, node in enumerate(order)}
    for u, v, data in sorted(view.edges(data=True), key=lambda e: (index[e[0]], index[e[1]])):
        edge_attrs: dict[str, Any] = edge_style(data, beside=u in beside, rankdir=rankdir)
        dot.add_edge(pydot.Edge(node_id(u), node_id(v), **edge_attrs))
    for key, value in legend(view, scale).items():  # the graph's label: clusters set their own
        dot.set(key, value)
    return dot


def _clusters(dot: Any, G: nx.MultiDiGraph) -> dict[str, Any]:
    """A nested pydot cluster for every scope that holds nodes; scope path to cluster."""
    import pydot

    modules = G.graph.get("modules", {})
    scopes = sorted({module_path(str(d.get("scope") or "")) for _, d in G.nodes(data=True)} - {""})
    needed: set[str] = set()
    for scope in scopes:  # every ancestor of a used scope needs a box too
        parts = scope.split(".")
        needed.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    needed.discard("")  # the top level, not a box (".x" would make one, holding itself)
    clusters: dict[str, Any] = {}
    for i, scope in enumerate(sorted(needed, key=lambda s: (s.count("."), s))):
        cluster = pydot.Cluster(
            f"c{i}", label=cluster_label(scope, modules.get(scope)), style="rounded,dashed",
            color="#9AA0A6", fontname=FONT, fontsize=str(BOX_SIZE), fontcolor="#5F6368", labeljust="l",
        )
        clusters[scope] = cluster
        parent = scope.rpartition(".")[0]
        (clusters.get(parent) or dot).add_subgraph(cluster)
    return clusters
