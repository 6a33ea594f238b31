"""Drawing graphs with Graphviz, through pydot.

The only module that imports pydot (inside its functions). DOT attributes are
built in :mod:`fxnx._style` from a constant palette, every string from the
graph escaped; the graph's own attributes never go into DOT as they are.
``draw(G, "x.dot")`` needs no Graphviz; PNG, SVG and PDF need its ``dot``
program, run once per drawing: the collapse depth of a PNG is chosen before,
from the layout's predicted size and cost (:mod:`fxnx._layout`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import networkx as nx

from ._checks import without_checks
from ._collapse import collapse, collapsed_size, module_depth, module_path
from ._fold import fold_parameters, folded_parameters
from ._layout import NODE_PAD, Estimate, area_floor, beside_consumers, bounded_options, estimate
from ._style import (
    FONT,
    PLAIN,
    Scale,
    cluster_label,
    edge_style,
    label_height,
    label_width,
    legend,
    node_id,
    node_style,
)
from .analysis import cycle_error, skip_connections, topological_order
from .errors import FxnxError, FxnxTypeError, FxnxValueError
from .io import atomic_write

__all__ = ["GraphvizNotFoundError", "draw", "to_pydot"]

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
        Top to bottom, or left to right.
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
    for node in topological_order(view):
        data = view.nodes[node]
        # Declared at the top, so that P.get_node(name) finds it; named in its module's box.
        dot.add_node(pydot.Node(node_id(node), **node_style(node, data, scale, primals.get(node),
                                                            boxed=clusters)))
        cluster = parents.get(module_path(str(data.get("scope") or "")))
        if cluster is not None:
            cluster.add_node(pydot.Node(node_id(node)))
    beside = beside_consumers(view)  # parameters sit beside their consumer, in its box
    for u, v, data in view.edges(data=True):
        dot.add_edge(pydot.Edge(node_id(u), node_id(v), **edge_style(data, beside=u in beside)))
    for key, value in legend(view, scale).items():  # the graph's label: clusters set their own
        dot.set(key, value)
    return dot


def _clusters(dot: Any, G: nx.MultiDiGraph) -> dict[str, Any]:
    """A nested pydot cluster for every scope that holds nodes; scope path to cluster."""
    import pydot

    modules = G.graph.get("modules", {})
    scopes = sorted({module_path(str(d.get("scope") or "")) for _, d in G.nodes(data=True)} - {""})
    needed = set()
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


def draw(G: nx.MultiDiGraph, path: str | os.PathLike[str], *, dpi: int = 96, **options: Any) -> Path:
    """Draw ``G`` to ``path``: PNG, SVG or PDF by its suffix, or DOT text for ``.dot``/``.gv``.

    Graphviz's ``dot`` runs once. Without ``depth``, a PNG is collapsed to the
    deepest module level whose layout is predicted (from node, edge and rank
    counts, before running Graphviz) to be readable and quick: at most
    2,000 nodes plus virtual nodes, 185 square inches (a page of a paper at 60%;
    ResNet-18 and ResNet-50 are drawn by block), and Graphviz's 32,767-pixel
    limit; a warning says so. The model's checks (assertions) are left out
    unless ``checks=True``. SVG and PDF keep every node; past
    6,000 nodes plus virtual nodes, dot's crossing reduction and placement
    passes are limited so the layout takes seconds (edges cross more;
    DenseNet-121 in full takes about 15 s), and a run past two minutes
    stops with an error that names a smaller depth, or says that none helps.
    ``dpi`` is Graphviz's default 96; ask
    for 200 or more for print. Options are those of :func:`to_pydot`. The
    file is written whole or not at all: a failed run leaves ``path`` as it was.

    Raises
    ------
    GraphvizNotFoundError
        Graphviz's ``dot`` is needed (PNG, SVG, PDF) but not installed.
    FxnxValueError
        An unknown suffix, a ``dpi`` that is not a whole number from 1 to
        1200, a PNG too large at the ``depth`` asked for, or a layout that
        Graphviz did not finish.

    Examples
    --------
    >>> import tempfile, torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> draw(G, tempfile.mkdtemp() + "/g.dot").read_text().startswith("digraph fxnx")
    True
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise FxnxValueError(
            f"cannot draw to {path.name!r}: give a .png, .svg, .pdf or .dot file name"
        )
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 1 <= dpi <= MAX_DPI:
        raise FxnxValueError(
            f"dpi must be a whole number from 1 to {MAX_DPI} (96 for screens, 300 for print), "
            f"got {dpi!r}"
        )
    if fmt in ("dot", "gv"):
        with atomic_write(path) as f:
            f.write(to_pydot(G, **options).to_string().encode())
        return path
    _acyclic(G)
    if shutil.which("dot") is None:
        raise GraphvizNotFoundError(
            f"drawing {path.name} needs Graphviz's dot program, which is not installed. "
            "Install it with: apt-get install graphviz (Debian/Ubuntu), brew install graphviz "
            "(macOS) or conda install graphviz. Without it, draw to a .dot file instead."
        )
    depth = options.pop("depth", None)
    _check(options)
    G = G if options.pop("checks", False) else without_checks(G)
    fold = options.get("color_by") is None
    if depth is None and fmt == "png":
        depth, view, guess = _png_depth(G, dpi, options.get("clusters", True), fold)
    else:
        view = _view(G, depth, fold=fold)
        guess = _estimate(view, options.get("clusters", True))
    if fmt == "png" and guess.pixels(dpi)[1] > MAX_PIXELS:
        raise FxnxValueError(_too_large(path, depth, dpi))
    text = _pydot(view, graph_attrs=bounded_options(guess), **_defaults(options)).to_string()
    try:
        notes = _run_dot(text, fmt, dpi, path)
    except subprocess.TimeoutExpired as err:
        raise FxnxValueError(
            f"Graphviz's dot did not lay out {path.name} within {DOT_TIMEOUT:.0f} s "
            f"({guess.nodes} nodes, {guess.virtual} virtual nodes for long edges): "
            f"{_smaller(G, depth, fold)}"
        ) from err
    if "too large" in notes:  # dot would scale the PNG down into a blur: not what was asked
        raise FxnxValueError(_too_large(path, depth, dpi))
    return path


def _defaults(options: dict[str, Any]) -> dict[str, Any]:
    return {"color_by": options.get("color_by"), "clusters": options.get("clusters", True),
            "rankdir": options.get("rankdir", "TB")}


def _too_large(path: Path, depth: int | None, dpi: int) -> str:
    return (
        f"{path.name} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG at "
        f"depth={depth} and dpi={dpi}: use a smaller depth or dpi, or write .svg or .pdf"
    )


def _fits_png(guess: Estimate, dpi: int) -> bool:
    across, along = guess.pixels(dpi)
    area = guess.across * guess.along / 72**2
    return guess.work <= PNG_WORK and area <= PNG_AREA and max(across, along) <= MAX_PIXELS


def _estimate(view: nx.MultiDiGraph, clusters: bool) -> Estimate:
    """:func:`fxnx._layout.estimate` with the sizes of the labels drawn."""
    return estimate(view, partial(label_width, boxed=clusters), clusters=clusters,
                    label_height=partial(label_height, boxed=clusters))


def _too_many(widths: list[float]) -> bool:
    """Whether no PNG of nodes this wide can be readable and quick (see :func:`_fits_png`);
    ``NODE_PAD`` each for nodes known only by their count."""
    return len(widths) > PNG_WORK or area_floor(widths) > PNG_AREA * 72**2


def _png_depth(
    G: nx.MultiDiGraph, dpi: int, clusters: bool, fold: bool = True
) -> tuple[int | None, nx.MultiDiGraph, Estimate]:
    """The deepest depth at which ``G`` makes a readable PNG, its view (skip connections
    marked) and estimate.

    A depth whose view has too many nodes to fit, whatever their layout, is passed
    over without building the view. ``fold`` is :func:`_view`'s.
    """
    depths = range(module_depth(G) - 1, 0, -1)
    # Drawn whole, the nodes that stay are at least as wide as their own labels.
    folded = folded_parameters(G) if fold else {}
    kept = [label_width(node, data, boxed=clusters)
            for node, data in G.nodes(data=True) if node not in folded]
    if not depths or not _too_many(kept):
        guess = _estimate(_listed(G, fold), clusters)
        if not depths or _fits_png(guess, dpi):
            return None, _view(G, None, fold=fold), guess
    order = topological_order(G)
    for depth in depths:  # the last one tried, depth 1, is drawn even if it does not fit
        if depth > 1 and _too_many([NODE_PAD] * collapsed_size(G, depth)):
            continue
        view = _listed(collapse(G, depth, order=order, skips=False), fold)
        guess = _estimate(view, clusters)
        if _fits_png(guess, dpi):
            break
    skip_connections(view)  # the skip connections still visible once modules are collapsed
    warnings.warn(
        f"{G.graph.get('model', 'the graph')} is too large for a readable PNG; drew it "
        f"with modules collapsed below depth {depth}. Write .svg or .pdf to see every "
        f"node, or choose the depth yourself ({module_depth(G)} keeps every node).",
        stacklevel=3,
    )
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


def _run_dot(text: str, fmt: str, dpi: int, path: Path) -> str:
    """Run Graphviz's dot once on DOT text, writing ``path`` atomically; return its warnings.

    dot writes to a pipe; ``path`` is replaced (:func:`fxnx.io.atomic_write`) only when dot
    succeeds, so on any failure it is left as it was.
    """
    done = subprocess.run(
        ["dot", f"-T{fmt}", f"-Gdpi={dpi}"],
        input=text.encode(), capture_output=True, check=False, timeout=DOT_TIMEOUT,
    )
    notes = done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise FxnxValueError(f"Graphviz's dot failed on {path.name}: {notes.strip()}")
    if "too large" not in notes:
        with atomic_write(path) as f:
            f.write(done.stdout)
    return notes
