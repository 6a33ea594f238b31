"""Predicting a dot layout's size and cost from the graph, before running Graphviz.

Graphviz's ``dot`` ranks nodes, then adds one virtual node per rank that an
edge crosses, orders every rank to reduce crossings and places the nodes; its
time grows with the nodes plus those virtual nodes, and a PNG's time with its
pixels. Both are predicted here from the graph alone, so that :mod:`.fit`
picks the collapse depth once and :mod:`.graphviz` runs ``dot`` once. No pydot, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import networkx as nx

from .style import (
    BOX_SIZE,
    NAME_SIZE,
    TEXT_SIZE,
    _parameter_lines,
    _title,
    cluster_title,
    edge_label,
    kind,
    legend,
)
from .view import module_path

#: Points (1/72 inch) per character of Helvetica at the style's sizes, measured: 0.617 of the
#: size for a node's bold name, 0.56 for its kind and an edge's shape label, 0.564 for a
#: module box's label.
NAME_CHAR, KIND_CHAR = NAME_SIZE * 37 / 60, TEXT_SIZE * 56 / 100  # 7.4 and 5.6 at 12 and 10
LABEL_CHAR, BOX_CHAR = TEXT_SIZE * 56 / 100, BOX_SIZE * 62 / 110  # 5.6 and 6.2 at 10 and 11


#: Points a node adds beyond its text (margins and border), and a virtual node's width.
NODE_PAD, VIRTUAL = 16.0, 10.0


#: Points between neighbours in a rank (nodesep) and from rank to rank (height plus ranksep).
NODESEP, RANK_STEP = 18.0, 56.0


#: Points each line beyond a node's name and kind adds to its height: 1.2 times its size.
LINE = TEXT_SIZE * 12 / 10


#: Points a module's box adds across: its margins on either side and its border, and left to
#: right, where its label sits across the ranks too, the label's line.
CLUSTER_PAD, CLUSTER_PAD_LR = 18.0, 32.0


#: Points of a node's height with a name and a kind (two lines), and between ranks (ranksep).
NODE_HEIGHT, RANKSEP = 29.0, 20.16


#: Points of an edge label's line, laid out left to right as a node of its own.
LABEL_LINE = TEXT_SIZE * 12 / 10


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
    rankdir: str = "TB",
    title: float = 0.0,
    box_width: Callable[[str], float] | None = None,
) -> Estimate:
    """Predict the size of ``G``'s dot layout and the work it takes.

    Ranks are those of the longest path from the inputs, with every node that
    no input feeds just above its first consumer, or on its rank for
    parameters (:func:`beside_consumers`), as drawn. ``label_width(node,
    data)`` gives a node's width in points, and ``label_height(node, data)``
    what its label adds to its height (nothing by default). With
    ``clusters``, each module's box (from the nodes' ``scope``) is a rectangle
    over the ranks it spans, as in dot: boxes whose ranks overlap sit side by
    side.

    Top to bottom (``rankdir="TB"``), an edge's shape label sits beside it
    (:func:`fxnx._drawing.style.edge_label`), widening its tail's rank. Left to right
    (``"LR"``), the labels are dot's own edge labels, which dot lays out as
    nodes of ranks between the nodes' ranks, so they never cover a node:
    each such rank is as long as its longest label, and a rank of nodes as
    long as its widest node. ``title`` is the height of the drawing's own
    label (the legend), above it, and ``box_width(path)`` the width of a
    module box's label: top to bottom, a box is at least that wide.

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
    rank = {node: r - low for node, r in rank.items()}
    ranks = max(rank.values(), default=-1) + 1
    width = {node: label_width(node, data) for node, data in G.nodes(data=True)}
    extra = {node: label_height(node, data) if label_height else 0.0
             for node, data in G.nodes(data=True)}
    if rankdir == "TB":
        return _top_to_bottom(G, rank, ranks, width, extra, clusters, title, box_width)
    return _left_to_right(G, rank, ranks, width, extra, clusters, title)


def _crossing(rank: dict[Any, int], span: int, u: Any, v: Any, counts: list[int]) -> None:
    """Count, in the difference array ``counts``, an edge's virtual node on each rank it
    crosses."""
    first = min(rank[u], rank[v]) + 1
    counts[first] += 1
    counts[first + span - 1] -= 1


def _top_to_bottom(G: nx.MultiDiGraph, rank: dict[Any, int], ranks: int,
                   width: dict[Any, float], extra: dict[Any, float], clusters: bool,
                   title: float, box_width: Callable[[str], float] | None) -> Estimate:
    """Top to bottom: a rank is as wide as its nodes, each widened by the shape labels set
    beside its out-edges, its boxes and the long edges crossing it."""
    size = dict(width)
    crossing = [0] * (ranks + 1)  # virtual nodes per rank, as a difference array
    virtual = 0
    for u, v, data in G.edges(data=True):
        label = edge_label(data)
        if label is not None:  # beside the edge, by its tail
            size[u] += len(label) * LABEL_CHAR
        span = abs(rank[v] - rank[u])
        if span > 1:
            virtual += span - 1
            _crossing(rank, span, u, v, crossing)
    right = _packed(_scopes(G, clusters), rank, size, CLUSTER_PAD, box_width)
    running, across = 0, 0.0
    for r in range(ranks):
        running += crossing[r]
        across = max(across, right.get(r, 0.0) + running * (VIRTUAL + NODESEP))
    taller: dict[int, float] = {}  # the tallest label's extra height, per rank
    for node in G:
        if extra[node] > taller.get(rank[node], 0.0):
            taller[rank[node]] = extra[node]
    along = ranks * RANK_STEP + sum(taller.values()) + title
    return Estimate(across=across, along=along, nodes=G.number_of_nodes(), virtual=virtual)


def _left_to_right(G: nx.MultiDiGraph, rank: dict[Any, int], ranks: int,
                   width: dict[Any, float], extra: dict[Any, float], clusters: bool,
                   title: float) -> Estimate:
    """Left to right: nodes stack down a rank by their heights. An edge's label is a node of
    dot's own on a rank between two ranks of nodes (dot doubles the ranks of a graph with edge
    labels), midway along the edge: such a rank is as long as its longest label, and as tall
    as its labels and the long edges crossing it."""
    size = {node: NODE_HEIGHT + extra[node] for node in G}
    crossing = [0] * (ranks + 1)  # virtual nodes per rank of nodes, as a difference array
    passing = [0] * (ranks + 1)  # edges per rank between (r to r + 1), as a difference array
    longest_label, labels = [0.0] * ranks, [0] * ranks
    virtual = 0
    for u, v, data in G.edges(data=True):
        span = abs(rank[v] - rank[u])
        if span == 0:
            continue
        low = min(rank[u], rank[v])
        passing[low] += 1
        passing[low + span] -= 1
        label = edge_label(data)
        if label is not None:
            middle = low + (span - 1) // 2
            longest_label[middle] = max(longest_label[middle], len(label) * LABEL_CHAR)
            labels[middle] += 1
        if span > 1:
            virtual += span - 1
            _crossing(rank, span, u, v, crossing)
    labelled = any(labels)
    right = _packed(_scopes(G, clusters), rank, size, CLUSTER_PAD_LR)
    running, between, across = 0, 0, 0.0
    for r in range(ranks):
        running += crossing[r]
        between += passing[r]
        across = max(across, right.get(r, 0.0) + running * (VIRTUAL + NODESEP))
        if labelled:  # the rank of labels after it: labels, and virtual nodes for the rest
            across = max(across, labels[r] * (LABEL_LINE + NODESEP)
                         + (between - labels[r]) * (VIRTUAL + NODESEP))
    if labelled:  # doubled, an edge over s ranks of nodes has 2s - 1 nodes of dot's own
        virtual = sum(2 * abs(rank[v] - rank[u]) - 1 for u, v in G.edges() if rank[u] != rank[v])
    widest: dict[int, float] = {}  # the widest node, per rank
    for node in G:
        widest[rank[node]] = max(widest.get(rank[node], 0.0), width[node])
    steps = (ranks - 1) * (2 if labelled else 1)  # dot doubles the ranks of a labelled graph
    along = sum(widest.values()) + sum(longest_label) + steps * RANKSEP
    return Estimate(across=across + title, along=along, nodes=G.number_of_nodes(),
                    virtual=virtual)


def _scopes(G: nx.MultiDiGraph, clusters: bool) -> dict[Any, str]:
    """Each node's module box, or none for any without ``clusters``."""
    return {node: module_path(str(data.get("scope") or "")) if clusters else ""
            for node, data in G.nodes(data=True)}


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


def _packed(scope: dict[Any, str], rank: dict[Any, int], width: dict[Any, float],
            pad: float = 0.0, box_width: Callable[[str], float] | None = None) -> dict[int, float]:
    """The right edge, per rank, of the top level once every module box is packed.

    Within a box, its nodes and inner boxes are taken in order of their first
    rank, each put just right of whatever already occupies any of its ranks
    (a skyline); a box is then a rectangle as wide as its widest rank plus
    its margins (``pad``), or as its label (``box_width``) if wider, over all
    its ranks.
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
        inside = max(skyline.values())
        if box_width is not None:
            inside = max(inside, box_width(path))
        items[parent].append((lo, hi, inside + pad))
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


def label_height(node: Any, data: dict[str, Any], boxed: bool = True) -> float:
    """What a node's listed parameters add to its height in points, for
    :func:`estimate`."""

    return LINE * len(_parameter_lines(data, boxed))


def label_width(node: Any, data: dict[str, Any], boxed: bool = True) -> float:
    """A node's width in points, from its label text, for :func:`estimate`."""

    small = max(map(len, [kind(data), *_parameter_lines(data, boxed)]))
    return max(len(_title(node, data, boxed)) * NAME_CHAR, small * KIND_CHAR) + NODE_PAD


def cluster_width(scope: str, module_type: Any) -> float:
    """The width in points of a module box's label, for :func:`estimate`: a box
    is at least as wide as it, whatever it holds."""

    return len(cluster_title(scope, module_type)) * BOX_CHAR


#: Points the legend takes above a drawing: its margins, and each row of its table.
LEGEND_PAD, LEGEND_ROW = 6.0, 14.0


def estimate_view(view: nx.MultiDiGraph, clusters: bool, rankdir: str = "TB") -> Estimate:
    """:func:`estimate` with the sizes of the labels drawn, and of the legend."""
    rows = legend(view, None).get("label", "").count("<TR>")
    modules = view.graph.get("modules", {})
    return estimate(view, partial(label_width, boxed=clusters), clusters=clusters,
                    label_height=partial(label_height, boxed=clusters), rankdir=rankdir,
                    title=LEGEND_PAD + LEGEND_ROW * rows if rows else 0.0,
                    box_width=lambda path: cluster_width(path, modules.get(path)))
