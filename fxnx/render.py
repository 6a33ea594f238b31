"""Drawing graphs with Graphviz, through pydot, to files or inline in notebooks.

The only module that imports pydot (inside its functions). DOT attributes are
built in :mod:`fxnx._style` from a constant palette, every string from the
graph escaped; the graph's own attributes never go into DOT as they are.
``draw(G, "x.dot")`` needs no Graphviz; PNG, SVG and PDF need its ``dot``
program, run once per drawing: the collapse depth of a PNG is chosen before,
from the layout's predicted size and cost (:mod:`fxnx._layout`), and the DOT
text carries every attribute dot is given. ``draw(G)`` returns a
:class:`Drawing`, which a notebook shows inline; inside IPython, fxnx graphs
show a short summary (:func:`_register_display`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, overload

import networkx as nx

from ._checks import without_checks
from ._collapse import collapse, collapsed_size, module_depth, module_path
from ._fold import fold_parameters, folded_parameters
from ._layout import NODE_PAD, Estimate, area_floor, beside_consumers, bounded_options, estimate
from ._style import (
    FONT,
    PLAIN,
    Scale,
    clip,
    cluster_label,
    cluster_width,
    edge_style,
    label_height,
    label_width,
    legend,
    node_id,
    node_style,
    text,
)
from .analysis import cycle_error, scope_subgraph, skip_connections, summary, topological_order
from .errors import FxnxError, FxnxTypeError, FxnxValueError
from .io import atomic_write

__all__ = ["Drawing", "GraphvizNotFoundError", "draw", "to_pydot"]

#: Graphviz cannot write a PNG wider or taller than this many pixels.
MAX_PIXELS = 32767
#: A PNG drawn without ``depth`` is collapsed until dot's work (nodes plus virtual nodes) and
#: the layout's estimated area (square inches at 100%) are below these. 185 square inches is a
#: page of a paper (7 by 9.5 inches) at 60%, where 12-point labels print at 7 points: past it a
#: PNG is no figure to print, and slow to write, for Graphviz's PNG encoder takes most of its
#: time (it grows with the pixels, not the nodes). ResNet-18 in full is estimated at 105 and 540
#: (drawn: 6 by 52 inches), so it is drawn by block (3 by 13); ResNet-50 in full, 300 and 1,400,
#: by bottleneck block too; DenseNet-121 in full, 27,000 and 30,000.
PNG_WORK, PNG_AREA = 2000, 185.0
#: The ``dpi`` accepted: Graphviz's 96 by default, 300 to 600 for print.
MAX_DPI = 1200
#: The file suffixes draw writes: images through Graphviz, or DOT text.
FORMATS = ("png", "svg", "pdf", "dot", "gv")
#: The formats drawn within a PNG's bounds when no ``depth`` is given: a PNG, the DOT text
#: that makes it, and a drawing shown inline (``None``). SVG and PDF keep every node.
BOUNDED = ("png", "dot", "gv", None)
#: How to install Graphviz, for the errors that need it.
INSTALL = ("Install it with: apt-get install graphviz (Debian/Ubuntu), brew install graphviz "
           "(macOS) or conda install graphviz.")
#: Points the legend takes above a drawing: its margins, and each row of its table.
LEGEND_PAD, LEGEND_ROW = 6.0, 14.0
#: The most top-level modules whose PNGs an error looks at, to name those that fit one.
MOST_PARTS = 32
#: Seconds one dot run may take before draw() gives up and names a depth that will work.
DOT_TIMEOUT = 120.0


class GraphvizNotFoundError(FxnxError, ImportError):
    """Graphviz's ``dot`` program, needed for PNG, SVG and PDF, is not installed."""


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
    _check({"rankdir": rankdir})
    _acyclic(G)
    view = _view(G if checks else without_checks(G), depth, fold=color_by is None)
    return _pydot(view, color_by=color_by, clusters=clusters, rankdir=rankdir)


def _acyclic(G: nx.MultiDiGraph) -> None:
    """Refuse a graph with a cycle at once, naming its nodes, rather than deep in a layout."""
    if not nx.is_directed_acyclic_graph(G):
        raise cycle_error(G)


def _view(G: nx.MultiDiGraph, depth: int | None, *, fold: bool = True) -> nx.MultiDiGraph:
    """What is drawn of ``G`` at ``depth``, its skip connections marked: the collapsed view,
    ``G`` itself where it carries the marks already, or else a marked copy. With ``fold``, the parameters
    that one node alone reads are listed on it (:func:`fxnx._fold.fold_parameters`);
    coloured by a value, each keeps a node in its own colour."""
    if depth is not None:
        view = collapse(G, depth)
    elif all("branch_role" in data for _, data in G.nodes(data=True)):  # marked already
        view = G
    else:  # marked on a copy: drawing never writes into the caller's graph
        view = G.copy()
        skip_connections(view)
    return _listed(view, fold)


def _listed(view: nx.MultiDiGraph, fold: bool) -> nx.MultiDiGraph:
    """``view`` with, if ``fold``, the parameters that one node alone reads listed on it."""
    return fold_parameters(view) if fold else view


def _check(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - {"color_by", "clusters", "rankdir", "checks"})
    if unknown:
        raise FxnxTypeError(
            f"draw() got unknown option {unknown[0]!r}: use depth, color_by, clusters, rankdir "
            "or checks"
        )
    if options.get("rankdir", "TB") not in ("TB", "LR"):
        raise FxnxValueError(f"rankdir must be 'TB' or 'LR', got {options['rankdir']!r}")


def _pydot(view: nx.MultiDiGraph, *, color_by: str | None, clusters: bool, rankdir: str,
           graph_attrs: dict[str, str] | None = None) -> Any:
    import pydot

    dot = pydot.Dot(
        "fxnx", graph_type="digraph", rankdir=rankdir, fontname=FONT, nodesep="0.25",
        ranksep="0.3", newrank="true", **(graph_attrs or {}),
    )
    dot.set_node_defaults(fontname=FONT, fontsize="12", shape="box", style="rounded,filled",
                          margin="0.08,0.04", height="0.3")
    dot.set_edge_defaults(fontname=FONT, fontsize="10", color=PLAIN, fontcolor="#3C4043",
                          arrowsize="0.6")
    scale = Scale(view, color_by) if color_by else None
    parents = _clusters(dot, view) if clusters else {}
    primals = view.graph.get("primals", {})
    order = topological_order(view)
    for node in order:
        data = view.nodes[node]
        # Declared at the top, so that P.get_node(name) finds it; named in its module's box.
        dot.add_node(pydot.Node(node_id(node), **node_style(node, data, scale, primals.get(node),
                                                            boxed=clusters)))
        cluster = parents.get(module_path(str(data.get("scope") or "")))
        if cluster is not None:
            cluster.add_node(pydot.Node(node_id(node)))
    beside = beside_consumers(view)  # parameters sit beside their consumer, in its box
    # Edges in the nodes' order, whatever order they were added in (a subgraph's can follow a
    # set's): the same graph gives the same DOT text, and dot the same picture, in any process.
    index = {node: i for i, node in enumerate(order)}
    for u, v, data in sorted(view.edges(data=True), key=lambda e: (index[e[0]], index[e[1]])):
        dot.add_edge(pydot.Edge(node_id(u), node_id(v),
                                **edge_style(data, beside=u in beside, rankdir=rankdir)))
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
            color="#9AA0A6", fontname=FONT, fontsize="11", fontcolor="#5F6368", labeljust="l",
        )
        clusters[scope] = cluster
        parent = scope.rpartition(".")[0]
        (clusters.get(parent) or dot).add_subgraph(cluster)
    return clusters


class Drawing:
    """A drawing of a graph, made by :func:`draw` without a path: shown inline in notebooks.

    It holds the DOT text that Graphviz's ``dot`` lays out (:attr:`dot`), with
    every attribute :func:`draw` gives dot, and renders it on first use, once
    per format: :attr:`svg` and :attr:`png`; :meth:`save` writes a file. In a
    notebook it shows as SVG; without Graphviz, or where the layout fails,
    it shows what went wrong and how to install Graphviz instead of raising.

    Attributes
    ----------
    dot : str
        The DOT text: ``dot -Tpng`` on it makes :attr:`png`.
    depth : int or None
        The depth modules are collapsed below; None when every node is drawn.
    dpi : int
        The resolution of :attr:`png`.

    Examples
    --------
    >>> import torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> d = fxnx.draw(G)
    >>> d.dot.startswith("digraph fxnx"), d.depth
    (True, None)
    """

    def __init__(self, dot: str, *, name: str, nodes: int, depth: int | None, dpi: int,
                 advice: Callable[[], str], work: tuple[int, int]) -> None:
        self.dot = dot
        self.depth = depth
        self.dpi = dpi
        self._name, self._nodes = name, nodes
        self._advice = advice  # what to do when the layout is too slow: names a depth
        self._work = work  # nodes and virtual nodes, for that error
        self._rendered: dict[str, bytes | FxnxError] = {}

    def __repr__(self) -> str:
        detail = "every node" if self.depth is None else f"modules below depth {self.depth} collapsed"
        return f"<fxnx.Drawing of {self._name}: {self._nodes} nodes, {detail}>"

    @property
    def svg(self) -> str:
        """The drawing as SVG text, rendered by Graphviz's ``dot`` on first use.

        Raises
        ------
        GraphvizNotFoundError
            Graphviz's ``dot`` is not installed.
        FxnxValueError
            Graphviz failed or did not finish the layout within two minutes.
        """
        return self._render("svg", "the drawing's SVG").decode()

    @property
    def png(self) -> bytes:
        """The drawing as PNG bytes at :attr:`dpi`, rendered by Graphviz's ``dot`` on first use.

        Raises
        ------
        GraphvizNotFoundError
            Graphviz's ``dot`` is not installed.
        FxnxValueError
            Graphviz failed, did not finish within two minutes, or would have
            scaled the PNG down.
        """
        return self._render("png", "the drawing's PNG")

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the drawing to ``path``: PNG, SVG or PDF by its suffix, or DOT text for
        ``.dot``/``.gv``, as :func:`draw` does; the same picture as shown (at :attr:`depth`).

        The file is written whole or not at all: a failed run leaves ``path``
        as it was.

        Returns
        -------
        pathlib.Path
            ``path``.

        Raises
        ------
        GraphvizNotFoundError
            Graphviz's ``dot`` is needed (PNG, SVG, PDF) but not installed.
        FxnxValueError
            An unknown suffix, or a layout that Graphviz did not finish.
        """
        path = Path(path)
        fmt = _format(path)
        data = self.dot.encode() if fmt in ("dot", "gv") else self._render(fmt, path.name)
        with atomic_write(path) as f:
            f.write(data)
        return path

    def _render(self, fmt: str, name: str) -> bytes:
        """The drawing in ``fmt`` by one dot run, kept, as is an error (raised again)."""
        if fmt not in self._rendered:
            try:
                self._rendered[fmt] = self._run(fmt, name)
            except FxnxError as err:
                self._rendered[fmt] = err
        done = self._rendered[fmt]
        if isinstance(done, FxnxError):
            raise done
        return done

    def _run(self, fmt: str, name: str) -> bytes:
        _need_dot(name)
        try:
            data, notes = _run_dot(self.dot, fmt, name)
        except subprocess.TimeoutExpired as err:
            nodes, virtual = self._work
            raise FxnxValueError(
                f"Graphviz's dot did not lay out {name} within {DOT_TIMEOUT:.0f} s "
                f"({nodes} nodes, {virtual} virtual nodes for long edges): {self._advice()}"
            ) from err
        if "too large" in notes:  # dot would scale the PNG down into a blur: not what was asked
            raise FxnxValueError(
                f"{name} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG at "
                f"depth={self.depth} and dpi={self.dpi}: {self._advice()}, or write .svg or .pdf"
            )
        return data

    def _repr_svg_(self) -> str | None:
        """The SVG a notebook shows; None where it cannot be made (see :meth:`_repr_mimebundle_`)."""
        try:
            return self.svg
        except FxnxError:
            return None

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """What a notebook shows: SVG (PNG if only that is asked for) and this repr; without
        Graphviz, or where the layout fails, the repr and what to do, so the notebook goes on."""
        svg = "image/svg+xml"
        png = ((include is not None and "image/png" in include and svg not in include)
               or (exclude is not None and svg in exclude))
        fmt, mime = ("png", "image/png") if png else ("svg", svg)
        try:
            data = self._render(fmt, f"the drawing's {fmt.upper()}")
        except FxnxError as err:
            return {"text/plain": f"{self!r}\n{err}"}
        return {mime: data if png else data.decode(), "text/plain": repr(self)}


@overload
def draw(G: nx.MultiDiGraph, path: None = None, *, dpi: int = 96, **options: Any) -> Drawing: ...


@overload
def draw(G: nx.MultiDiGraph, path: str | os.PathLike[str], *, dpi: int = 96,
         **options: Any) -> Path: ...


def draw(G: nx.MultiDiGraph, path: str | os.PathLike[str] | None = None, *, dpi: int = 96,
         **options: Any) -> Path | Drawing:
    """Draw ``G`` to ``path``: PNG, SVG or PDF by its suffix, or DOT text for ``.dot``/``.gv``;
    without ``path``, a :class:`Drawing` that a notebook shows inline.

    Graphviz's ``dot`` runs once. Without ``depth``, a PNG is collapsed to the
    deepest module level whose layout is predicted (from node, edge and rank
    counts, before running Graphviz) to be readable and quick: at most
    2,000 nodes plus virtual nodes, 185 square inches (a page of a paper at 60%;
    ResNet-18 and ResNet-50 are drawn by block), and Graphviz's 32,767-pixel
    limit; a warning says so. A graph too large for that even with modules
    collapsed below depth 1 (a detector's post-processing, outside every
    module) is refused with an error that says to write SVG or PDF, or to draw
    a part with :func:`fxnx.scope_subgraph`. A drawing without ``path`` and
    ``.dot`` text are drawn as the PNG is, and the DOT text carries every
    attribute dot is given, ``dpi`` and the layout's limits included, so that
    ``dot -Tpng g.dot`` makes the same PNG in the same time (a ``.dot`` too
    large for a PNG at depth 1 is still written, with a warning).
    The model's checks (assertions) are left out unless ``checks=True``.
    SVG and PDF keep every node; past
    6,000 nodes plus virtual nodes, dot's crossing reduction and placement
    passes are limited so the layout takes seconds (edges cross more;
    DenseNet-121 in full takes about 15 s), and a run past two minutes
    stops with an error that names a smaller depth, or says that none helps.
    ``dpi`` is Graphviz's default 96; ask
    for 200 or more for print. Options are those of :func:`to_pydot`. The
    file is written whole or not at all: a failed run leaves ``path`` as it was.
    Drawing never writes into ``G``.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert`.
    path : str or path-like, optional
        The file to write; without it, the drawing is returned.
    dpi : int
        Pixels per inch of a PNG.
    **options
        ``depth``, ``color_by``, ``clusters``, ``rankdir`` and ``checks``, as for
        :func:`to_pydot`.

    Returns
    -------
    pathlib.Path or Drawing
        ``path``, or without it the :class:`Drawing`.

    Raises
    ------
    GraphvizNotFoundError
        Graphviz's ``dot`` is needed (PNG, SVG, PDF) but not installed.
    FxnxValueError
        An unknown suffix, a ``dpi`` that is not a whole number from 1 to
        1200, a PNG too large at the ``depth`` asked for (the error names a
        depth or dpi that fits) or at any depth, or a layout that Graphviz did
        not finish.

    Examples
    --------
    >>> import tempfile, torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> draw(G, tempfile.mkdtemp() + "/g.dot").read_text().startswith("digraph fxnx")
    True
    """
    fmt = None if path is None else _format(Path(path))
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 1 <= dpi <= MAX_DPI:
        raise FxnxValueError(
            f"dpi must be a whole number from 1 to {MAX_DPI} (96 for screens, 300 for print), "
            f"got {dpi!r}"
        )
    options = dict(options)
    depth = options.pop("depth", None)
    _check(options)
    _acyclic(G)
    if path is not None and fmt not in ("dot", "gv"):
        _need_dot(Path(path).name)
    drawing = _drawing(G, fmt, depth, dpi, options)
    return drawing if path is None else drawing.save(path)


def _format(path: Path) -> str:
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise FxnxValueError(
            f"cannot draw to {path.name!r}: give a .png, .svg, .pdf or .dot file name"
        )
    return fmt


def _need_dot(name: str) -> None:
    if shutil.which("dot") is None:
        raise GraphvizNotFoundError(
            f"drawing {name} needs Graphviz's dot program, which is not installed. {INSTALL} "
            "Without it, draw to a .dot file instead."
        )


def _drawing(G: nx.MultiDiGraph, fmt: str | None, depth: int | None, dpi: int,
             options: dict[str, Any]) -> Drawing:
    """What :func:`draw` draws of ``G`` for ``fmt`` (None: inline): the view at the depth asked
    for or chosen, checked against a PNG's bounds where ``fmt`` has them, as DOT text."""
    clusters, rankdir = options.get("clusters", True), options.get("rankdir", "TB")
    G = G if options.get("checks", False) else without_checks(G)
    fold = options.get("color_by") is None
    if depth is None and fmt in BOUNDED:
        depth, view, guess = _png_depth(G, dpi, clusters, fold, rankdir)
        if not _fits_png(guess, dpi):
            if _readable(guess):  # only the resolution makes it too large
                why = (f"{_named(G)} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG "
                       f"at depth={depth} and dpi={dpi}: "
                       f"{_fitting(G, depth, dpi, guess, clusters, fold, rankdir)}")
            else:
                why = _no_png(G, depth, dpi, guess, clusters, fold, rankdir)
            if fmt in ("png", None):
                raise FxnxValueError(why)
            warnings.warn(f"{why} Wrote the DOT text at depth={depth}.",
                          stacklevel=3)
        elif depth is not None:
            warnings.warn(
                f"{G.graph.get('model', 'the graph')} is too large for a readable PNG; drew it "
                f"with modules collapsed below depth {depth}. Write .svg or .pdf to see every "
                f"node, or choose the depth yourself ({module_depth(G)} keeps every node).",
                stacklevel=3,
            )
    else:
        view = _view(G, depth, fold=fold)
        guess = _estimate(view, clusters, rankdir)
        if fmt in ("png", None) and max(guess.pixels(dpi)) > MAX_PIXELS:
            raise FxnxValueError(
                f"{_named(G)} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG at "
                f"depth={depth} and dpi={dpi}: {_fitting(G, depth, dpi, guess, clusters, fold, rankdir)}"
            )
    attrs = {**bounded_options(guess), "dpi": str(dpi)}
    dot = _pydot(view, graph_attrs=attrs, **_defaults(options)).to_string()
    return Drawing(dot, name=_named(G), nodes=view.number_of_nodes(), depth=depth, dpi=dpi,
                   advice=partial(_smaller, G, depth, fold), work=(guess.nodes, guess.virtual))


def _named(G: nx.MultiDiGraph) -> str:
    """The model's class name, as the legend shows it, for messages."""
    return clip(str(G.graph.get("model") or "the graph").rsplit(".", 1)[-1])


def _defaults(options: dict[str, Any]) -> dict[str, Any]:
    return {"color_by": options.get("color_by"), "clusters": options.get("clusters", True),
            "rankdir": options.get("rankdir", "TB")}


def _no_png(G: nx.MultiDiGraph, depth: int | None, dpi: int, guess: Estimate, clusters: bool,
            fold: bool, rankdir: str) -> str:
    """Why no PNG of ``G`` is readable and quick at any depth, and what to do instead: SVG,
    PDF or DOT, or a PNG of each top-level module that fits one."""
    across, along = guess.across / 72, guess.along / 72
    where = "even with modules collapsed below depth 1" if depth == 1 else (
        "and has no modules to collapse" if depth is None else f"at depth={depth}")
    fit, too_large = _parts(G, dpi, clusters, fold, rankdir)
    parts = ""
    if fit:
        parts = (f", or draw a part with fxnx.scope_subgraph(G, scope): {_listed_names(fit)} "
                 f"{'fits' if len(fit) == 1 else 'fit'} a PNG")
        if too_large:
            parts += f" ({_listed_names(too_large)} only as SVG or PDF)"
    return (
        f"{_named(G)} is too large for a readable PNG {where}: about {across * along:,.0f} square "
        f"inches ({across:,.0f} by {along:,.0f}) and {guess.work:,} nodes plus virtual nodes for "
        f"long edges, where a PNG is drawn within {PNG_AREA:.0f} square inches and "
        f"{PNG_WORK:,} nodes. Write .svg or .pdf to see it whole, or .dot text to lay out "
        f"yourself{parts}."
    )


def _listed_names(names: list[str], most: int = 6) -> str:
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _parts(G: nx.MultiDiGraph, dpi: int, clusters: bool, fold: bool,
           rankdir: str) -> tuple[list[str], list[str]]:
    """The top-level modules of ``G`` (those holding nodes) whose :func:`fxnx.scope_subgraph`
    fits a PNG at some depth, and those that do not; marked on a copy of ``G``. None where
    there are more than :data:`MOST_PARTS`: each takes a search of its own, and a list that
    long is no advice."""
    tops = sorted({path.split(".")[0] for _, data in G.nodes(data=True)
                   if (path := str(data.get("scope") or ""))})
    if not tops or len(tops) > MOST_PARTS:
        return [], []
    marked = G.copy()  # scope_subgraph marks skip connections: never on the caller's graph
    skip_connections(marked)
    fit, too_large = [], []
    for top in tops:
        _, _, guess = _png_depth(scope_subgraph(marked, top), dpi, clusters, fold, rankdir)
        (fit if _fits_png(guess, dpi) else too_large).append(top)
    return fit, too_large


def _fitting(G: nx.MultiDiGraph, depth: int | None, dpi: int, guess: Estimate, clusters: bool,
             fold: bool, rankdir: str) -> str:
    """What makes a PNG too large at ``depth`` fit Graphviz's limit: a smaller depth (never
    below 1), a smaller dpi, or SVG or PDF."""
    ways = []
    top = module_depth(G) - 1 if depth is None else depth - 1
    order = topological_order(G)
    for smaller in range(top, 0, -1):
        view = _listed(collapse(G, smaller, order=order, skips=False), fold)
        if max(_estimate(view, clusters, rankdir).pixels(dpi)) <= MAX_PIXELS:
            ways.append(f"depth={smaller} or less")
            break
    most = int(MAX_PIXELS * 72 / max(guess.across, guess.along, 1.0))
    if most >= 1:
        ways.append(f"dpi={most} or less")
    drawn = f"draw it with {' or with '.join(ways)}, or " if ways else ""
    return f"{drawn}write .svg or .pdf"


def _readable(guess: Estimate) -> bool:
    """Whether a layout this large is readable and quick as a PNG, at any resolution."""
    return guess.work <= PNG_WORK and guess.across * guess.along / 72**2 <= PNG_AREA


def _fits_png(guess: Estimate, dpi: int) -> bool:
    return _readable(guess) and max(guess.pixels(dpi)) <= MAX_PIXELS


def _estimate(view: nx.MultiDiGraph, clusters: bool, rankdir: str = "TB") -> Estimate:
    """:func:`fxnx._layout.estimate` with the sizes of the labels drawn, and of the legend."""
    rows = legend(view, None).get("label", "").count("<TR>")
    modules = view.graph.get("modules", {})
    return estimate(view, partial(label_width, boxed=clusters), clusters=clusters,
                    label_height=partial(label_height, boxed=clusters), rankdir=rankdir,
                    title=LEGEND_PAD + LEGEND_ROW * rows if rows else 0.0,
                    box_width=lambda path: cluster_width(path, modules.get(path)))


def _too_many(widths: list[float]) -> bool:
    """Whether no PNG of nodes this wide can be readable and quick (see :func:`_fits_png`);
    ``NODE_PAD`` each for nodes known only by their count."""
    return len(widths) > PNG_WORK or area_floor(widths) > PNG_AREA * 72**2


def _png_depth(
    G: nx.MultiDiGraph, dpi: int, clusters: bool, fold: bool = True, rankdir: str = "TB"
) -> tuple[int | None, nx.MultiDiGraph, Estimate]:
    """The deepest depth at which ``G`` makes a readable PNG, its view (skip connections
    marked) and estimate; depth 1 (or None, with no modules to collapse) where none does,
    which :func:`_fits_png` on the estimate tells.

    A depth whose view has too many nodes to fit, whatever their layout, is passed
    over without building the view. ``fold`` is :func:`_view`'s.
    """
    depths = range(module_depth(G) - 1, 0, -1)
    # Drawn whole, the nodes that stay are at least as wide as their own labels.
    folded = folded_parameters(G) if fold else {}
    kept = [label_width(node, data, boxed=clusters)
            for node, data in G.nodes(data=True) if node not in folded]
    if not depths or not _too_many(kept):
        guess = _estimate(_listed(G, fold), clusters, rankdir)
        if not depths or _fits_png(guess, dpi):
            return None, _view(G, None, fold=fold), guess
    order = topological_order(G)
    for depth in depths:  # the last one tried, depth 1, is returned even if it does not fit
        if depth > 1 and _too_many([NODE_PAD] * collapsed_size(G, depth)):
            continue
        view = _listed(collapse(G, depth, order=order, skips=False), fold)
        guess = _estimate(view, clusters, rankdir)
        if _fits_png(guess, dpi):
            break
    skip_connections(view)  # the skip connections still visible once modules are collapsed
    return depth, view, guess


def _quick_depth(G: nx.MultiDiGraph, below: int | None = None, fold: bool = True) -> int | None:
    """The deepest depth, under ``below`` if given, at which dot's layout of ``G`` is quick.

    None when collapsing cannot make ``G`` smaller: it has no nested modules,
    or ``below`` is already 1.
    """
    order = topological_order(G)
    top = module_depth(G) - 1 if below is None else min(below - 1, module_depth(G) - 1)
    for depth in range(top, 0, -1):
        view = _listed(collapse(G, depth, order=order, skips=False), fold)
        if _estimate(view, True).work <= PNG_WORK:
            return depth
    return 1 if top >= 1 else None


def _smaller(G: nx.MultiDiGraph, depth: int | None, fold: bool = True) -> str:
    """What to do when dot's layout of ``G`` at ``depth`` is too slow: a depth, if one helps."""
    quick = _quick_depth(G, depth, fold)
    if quick is None:
        why = "it has no nested modules" if depth is None else f"it is drawn at depth={depth}"
        return (
            f"collapsing modules cannot make it smaller ({why}): draw one part with "
            "fxnx.scope_subgraph(G, scope), or write .dot text and run dot yourself"
        )
    return f"draw it with depth={quick} or less, or write .dot text and run dot yourself"


def _run_dot(text: str, fmt: str, name: str) -> tuple[bytes, str]:
    """Run Graphviz's dot once on DOT text, which carries every attribute (``dpi`` too);
    return what it wrote and its warnings. ``name`` names the drawing in an error."""
    done = subprocess.run(
        ["dot", f"-T{fmt}"],
        input=text.encode(), capture_output=True, check=False, timeout=DOT_TIMEOUT,
    )
    notes = done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise FxnxValueError(f"Graphviz's dot failed on {name}: {notes.strip()}")
    return done.stdout, notes


# --- graphs in notebooks ------------------------------------------------------------------


def _is_fxnx(G: Any) -> bool:
    """Whether ``G`` carries fxnx's format marker, ``G.graph["format_version"]``, an int."""
    version = getattr(G, "graph", {}).get("format_version")
    return isinstance(version, int) and not isinstance(version, bool)


def _shape_text(shape: Any) -> str:
    """A shape as ``1×3×224×224``, several as a list of them, cut short."""
    if isinstance(shape, tuple):
        return "×".join(map(str, shape)) if shape else "scalar"
    if isinstance(shape, list):
        return "[" + ", ".join(_shape_text(s) for s in shape) + "]"
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{k}: {_shape_text(s)}" for k, s in shape.items()) + "}"
    return "?" if shape is None else str(shape)


def _graph_rows(G: nx.MultiDiGraph) -> list[tuple[str, str]]:
    """The short summary an fxnx graph shows in a notebook, as (what, value) rows: model,
    route and level, nodes and edges, parameters, input and output shapes, skip connections
    and FLOPs where recorded (from :func:`fxnx.summary`)."""
    info = summary(G)
    rows = [
        ("model", str(info["model"])),
        ("captured", f"{info['capture']} route, {info['level']} level"),
        ("nodes / edges", f"{info['nodes']:,} / {info['edges']:,}"),
    ]
    costs = info.get("costs") or {}
    if info.get("num_params") is not None:
        frozen = costs.get("frozen_params")
        rows.append(("parameters", f"{info['num_params']:,}" + (f" ({frozen:,} frozen)" if frozen else "")))
    for item in G.graph.get("inputs", []):
        rows.append((f"input {item.get('name')}",
                     f"{_shape_text(item.get('shape'))} {str(item.get('dtype')).removeprefix('torch.')}"))
    outputs = [d.get("out_shape") for _, d in G.nodes(data=True) if d.get("op") == "output"]
    rows.extend(("output", _shape_text(shape)) for shape in outputs)
    skips, identity = info.get("skip_connections"), info.get("identity_skips")
    if skips is not None:
        rows.append(("skip connections", f"{skips}" + (f" ({identity} identity)" if skips else "")))
    if costs.get("flops") is not None:
        macs = f"; {costs['macs']:,} multiply-adds" if costs.get("macs") is not None else ""
        rows.append(("FLOPs", f"{costs['flops']:,} ({_prefixed(costs['flops'])}){macs}"))
    return [(what, clip(value, 120)) for what, value in rows]


def _prefixed(count: int) -> str:
    """A count with an SI prefix: ``3.63 G``."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {prefix}"
    return str(count)


def _graph_bundle(G: Any) -> dict[str, str] | None:
    """IPython's display of a MultiDiGraph: a short summary of an fxnx graph, as text and
    HTML; None for any other graph, or one whose summary fails, so that IPython shows
    networkx's own display."""
    if not _is_fxnx(G):
        return None
    try:
        rows = _graph_rows(G)
    except Exception:  # a graph damaged by hand: networkx's display, never a broken notebook
        return None
    hint = "fxnx.summary(G) for more; fxnx.draw(G) draws it"
    width = max(len(what) for what, _ in rows)
    plain = "\n".join(f"{what:<{width}}  {value}" for what, value in rows)
    cells = "".join(f"<tr><th style='text-align:left'>{text(what)}</th>"
                    f"<td style='text-align:left'>{text(value)}</td></tr>" for what, value in rows)
    return {"text/plain": f"fxnx graph\n{plain}\n({hint})",
            "text/html": f"<table><caption>fxnx graph</caption>{cells}</table>"
                         f"<small>{text(hint)}</small>"}


def _register_display() -> None:
    """Inside IPython (and only there: IPython is not imported otherwise), show fxnx graphs by
    :func:`_graph_bundle`; other graphs keep networkx's display."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is not None and hasattr(shell, "display_formatter"):
        shell.display_formatter.mimebundle_formatter.for_type(nx.MultiDiGraph, _graph_bundle)


_register_display()
