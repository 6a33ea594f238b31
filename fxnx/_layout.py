"""Predicting a dot layout's size and cost from the graph, before running Graphviz.

Graphviz's ``dot`` ranks nodes, then adds one virtual node per rank that an
edge crosses, orders every rank to reduce crossings and places the nodes; its
time grows with the nodes plus those virtual nodes, and a PNG's time with its
pixels. Both are predicted here from the graph alone, so that :func:`fxnx.draw`
picks the collapse depth once and runs ``dot`` once. No pydot, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import networkx as nx

from ._collapse import module_path
from ._style import LABEL_CHARS

__all__ = ["Estimate", "area_floor", "beside_consumers", "bounded_options", "estimate"]

#: Points (1/72 inch) per character of a node's bold 12-point name, and of its 10-point kind.
NAME_CHAR, KIND_CHAR = 7.4, 5.6
#: Points per character of an edge's 10-point shape label, placed beside the edge.
LABEL_CHAR = 5.6
#: Points a node adds beyond its text (margins and border), and a virtual node's width.
NODE_PAD, VIRTUAL = 16.0, 10.0
#: Points between neighbours in a rank (nodesep) and from rank to rank (height plus ranksep).
NODESEP, RANK_STEP = 18.0, 56.0
#: Points each line beyond a node's name and kind adds to its height (10-point text).
LINE = 12.0
#: Points a module's box adds across: its margins on either side and its border.
CLUSTER_PAD = 18.0
#: Past this many nodes plus virtual nodes, dot's network simplex and crossing reduction are
#: held to a few passes (see bounded_options): the layout then takes seconds, not minutes.
BOUNDED_WORK = 6000


@dataclass(frozen=True)
class Estimate:
    """A layout's predicted size in points (width across ranks, length along them) and work."""

    across: float
    along: float
    nodes: int
    virtual: int

    @property
    def work(self) -> int:
        """Nodes plus virtual nodes: what dot's placement and ordering passes run over."""
        return self.nodes + self.virtual

    def pixels(self, dpi: int) -> tuple[float, float]:
        """The predicted PNG size, (across, along), at ``dpi``."""
        return self.across * dpi / 72, self.along * dpi / 72


def estimate(
    G: nx.MultiDiGraph,
    label_width: Callable[[Any, dict[str, Any]], float],
    *,
    clusters: bool = True,
    label_height: Callable[[Any, dict[str, Any]], float] | None = None,
) -> Estimate:
    """Predict the size of ``G``'s dot layout and the work it takes.

    Ranks are those of the longest path from the inputs, with every node that
    no input feeds just above its first consumer, or on its rank for
    parameters (:func:`beside_consumers`), as drawn. ``label_width(node,
    data)`` gives a node's width in points, and ``label_height(node, data)``
    what its label adds to its rank's height (nothing by default). With
    ``clusters``, each module's box (from the nodes' ``scope``) is a rectangle
    over the ranks it spans, as in dot: boxes whose ranks overlap sit side by
    side.

    Examples
    --------
    >>> import networkx as nx
    >>> G = nx.MultiDiGraph([("a", "b"), ("b", "c"), ("a", "c")])
    >>> e = estimate(G, lambda node, data: 50.0)
    >>> e.nodes, e.virtual
    (3, 1)
    """
    order = list(nx.topological_sort(G))
    rank: dict[Any, int] = {}
    for node in order:
        rank[node] = max((rank[u] + 1 for u in G.predecessors(node)), default=0)
    unfed = _unfed(G)
    for node in reversed(order):  # parameters beside their consumer, what is made of them above
        if node in unfed:
            rank[node] = min(rank[v] for v in G.successors(node)) - (G.in_degree(node) > 0)
    low = min(rank.values(), default=0)
    ranks = max(rank.values(), default=0) - low + 1
    width = {node: label_width(node, data) for node, data in G.nodes(data=True)}
    crossing = [0] * (ranks + 1)  # virtual nodes per rank, as a difference array
    virtual = 0
    for u, v, shape in G.edges(data="shape"):
        if isinstance(shape, (tuple, list)):  # the shape label sits beside the edge, by its tail
            width[u] += (min(3 * len(shape), LABEL_CHARS) + 2) * LABEL_CHAR  # (a long one is cut)
        span = abs(rank[v] - rank[u])
        if span > 1:
            virtual += span - 1
            first = min(rank[u], rank[v]) - low + 1
            crossing[first] += 1
            crossing[first + span - 1] -= 1
    scopes = {node: module_path(str(data.get("scope") or "")) if clusters else ""
              for node, data in G.nodes(data=True)}
    right = _packed(scopes, {n: r - low for n, r in rank.items()}, width)
    running, across = 0, 0.0
    for r in range(ranks):
        running += crossing[r]
        across = max(across, right.get(r, 0.0) + running * (VIRTUAL + NODESEP))
    taller: dict[int, float] = {}  # the tallest label's extra height, per rank
    for node, data in G.nodes(data=True) if label_height else ():
        extra = label_height(node, data)
        if extra > taller.get(rank[node], 0.0):
            taller[rank[node]] = extra
    along = ranks * RANK_STEP + sum(taller.values())
    return Estimate(across=across, along=along, nodes=G.number_of_nodes(),
                    virtual=virtual)


def area_floor(widths: Iterable[float]) -> float:
    """The least area, in square points, :func:`estimate` can predict for nodes this wide.

    Each node takes at least its width and the gap to its neighbour across (a rank
    is as wide as its nodes together), and a rank's height along. So a graph whose
    nodes need more than an area allows cannot fit it, whatever its shape, and need
    not be estimated; ``NODE_PAD`` for each node bounds a graph known only by its
    node count.

    Examples
    --------
    >>> area_floor([NODE_PAD] * 10) / 72**2  # square inches
    3.6728395061728394
    """
    return sum(width + NODESEP for width in widths) * RANK_STEP


def beside_consumers(G: nx.MultiDiGraph) -> set[Any]:
    """The nodes drawn on their consumer's rank: sources that no input feeds.

    Parameters, buffers and constants (``get_attr``) have no rank of their own
    on the path from the inputs. Drawn a rank above their consumer, a
    module's parameters would share a rank with the module before it, and dot
    would set the two modules' boxes side by side: blocks in sequence would
    drift across the page. Their edges get ``minlen=0`` instead, so each sits
    beside its consumer, inside its consumer's box. What is computed from
    parameters alone keeps its ranks above its consumer (laid flat, a chain of
    such ops would widen one rank). A graph without inputs has none.

    Examples
    --------
    >>> import networkx as nx
    >>> G = nx.MultiDiGraph([("x", "norm"), ("weight", "t"), ("t", "norm"), ("norm", "out")])
    >>> G.nodes["x"]["op"] = "placeholder"
    >>> sorted(beside_consumers(G))
    ['weight']
    """
    return {node for node in _unfed(G) if G.in_degree(node) == 0}


def _unfed(G: nx.MultiDiGraph) -> set[Any]:
    """The nodes with consumers that no input feeds; none in a graph without inputs."""
    inputs = [node for node, op in G.nodes(data="op") if op == "placeholder"]
    if not inputs:
        return set()
    fed = set(inputs).union(*(nx.descendants(G, node) for node in inputs))
    return {node for node in G if node not in fed and G.out_degree(node) > 0}


def _packed(scope: dict[Any, str], rank: dict[Any, int], width: dict[Any, float]) -> dict[int, float]:
    """The right edge, per rank, of the top level once every module box is packed.

    Within a box, its nodes and inner boxes are taken in order of their first
    rank, each put just right of whatever already occupies any of its ranks
    (a skyline); a box is then a rectangle as wide as its widest rank plus
    its margins, over all its ranks.
    """
    items: dict[str, list[tuple[int, int, float]]] = {}
    for node, path in scope.items():
        items.setdefault(path, []).append((rank[node], rank[node], width[node] + NODESEP))
        while path:  # every enclosing box exists, even one that holds no node itself
            path = path.rpartition(".")[0]
            if path in items:  # and so do those enclosing it
                break
            items[path] = []
    for path in sorted(items, key=lambda p: -p.count(".") if p else 1):
        skyline: dict[int, float] = {}
        for lo, hi, w in sorted(items[path]):
            x = max(skyline.get(r, 0.0) for r in range(lo, hi + 1))
            for r in range(lo, hi + 1):
                skyline[r] = x + w
        if not path:
            return skyline
        if not skyline:
            continue
        lo, hi = min(skyline), max(skyline)
        parent = path.rpartition(".")[0] if "." in path else ""
        items[parent].append((lo, hi, max(skyline.values()) + CLUSTER_PAD))
    return {}


def bounded_options(e: Estimate) -> dict[str, str]:
    """Graphviz graph attributes that keep a layout of ``e.work`` to seconds.

    Below :data:`BOUNDED_WORK` nothing is changed. Above it, crossing reduction
    (``mclimit``) and the network simplex passes that rank and place nodes
    (``nslimit``, ``nslimit1``) are cut short: edges cross more, but DenseNet-121
    at full detail takes seconds instead of many minutes.

    Examples
    --------
    >>> bounded_options(Estimate(across=1, along=1, nodes=100, virtual=0))
    {}
    >>> sorted(bounded_options(Estimate(across=1, along=1, nodes=100, virtual=10_000)))
    ['mclimit', 'nslimit', 'nslimit1', 'searchsize']
    """
    if e.work <= BOUNDED_WORK:
        return {}
    return {"mclimit": "0.1", "nslimit": "2", "nslimit1": "2", "searchsize": "10"}
