"""``draw``: the drawing pipeline, in order.

1. the view (:mod:`.view`): checks left out, modules collapsed, parameters listed, skips
   marked, on a copy;
2. the style (:mod:`.style`): what each node, edge and box says, in which font and colour;
3. the fit (:mod:`.fit`, from the sizes :mod:`.estimate` predicts): the depth of a PNG, and
   the errors that say what fits;
4. the DOT text (:mod:`.dot`);
5. one Graphviz run (:mod:`.graphviz`), when a file or the notebook asks for an image.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import warnings
from functools import partial
from pathlib import Path
from typing import Any, overload

import networkx as nx

from .._errors import FxnxValueError
from .dot import check_options, pydot_of
from .estimate import Estimate, bounded_options, estimate_view
from .fit import (
    MAX_DPI,
    MAX_PIXELS,
    PNG_WORK,
    fits_png,
    fitting,
    named,
    no_png,
    png_depth,
    readable,
    smaller,
)
from .graphviz import Drawing, file_format, need_dot, run_dot
from .view import acyclic, module_depth, view_of, without_checks

#: The formats drawn within a PNG's bounds when no ``depth`` is given: a PNG, the DOT text
#: that makes it, and a drawing shown inline (``None``). SVG and PDF keep every node.
BOUNDED = ("png", "dot", "gv", None)


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
    fmt = None if path is None else file_format(Path(path))
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 1 <= dpi <= MAX_DPI:
        raise FxnxValueError(
            f"dpi must be a whole number from 1 to {MAX_DPI} (96 for screens, 300 for print), "
            f"got {dpi!r}"
        )
    options = dict(options)
    depth = options.pop("depth", None)
    check_options(options)
    acyclic(G)
    if path is not None and fmt not in ("dot", "gv"):
        need_dot(Path(path).name)
    drawing = _drawing(G, fmt, depth, dpi, options)
    return drawing if path is None else drawing.save(path)


def _drawing(G: nx.MultiDiGraph, fmt: str | None, depth: int | None, dpi: int,
             options: dict[str, Any]) -> Drawing:
    """What :func:`draw` draws of ``G`` for ``fmt`` (None: inline): the view at the depth asked
    for or chosen, checked against a PNG's bounds where ``fmt`` has them, as DOT text."""
    clusters, rankdir = options.get("clusters", True), options.get("rankdir", "TB")
    G = G if options.get("checks", False) else without_checks(G)
    fold = options.get("color_by") is None
    if depth is None and fmt in BOUNDED:
        depth, view, guess = png_depth(G, dpi, clusters, fold, rankdir)
        if not fits_png(guess, dpi) and guess.work <= PNG_WORK:
            # The estimate errs large (its worst case): where it puts even the shallowest view
            # over a PNG's area, dot's own layout of it decides.
            guess = laid_out(view, guess, options) or guess
        if not fits_png(guess, dpi):
            if readable(guess):  # only the resolution makes it too large
                why = (f"{named(G)} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG "
                       f"at depth={depth} and dpi={dpi}: "
                       f"{fitting(G, depth, dpi, guess, clusters, fold, rankdir)}")
            else:
                why = no_png(G, depth, dpi, guess, clusters, fold, rankdir)
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
        view = view_of(G, depth, fold=fold)
        guess = estimate_view(view, clusters, rankdir)
        if fmt in ("png", None) and max(guess.pixels(dpi)) > MAX_PIXELS:
            raise FxnxValueError(
                f"{named(G)} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG at "
                f"depth={depth} and dpi={dpi}: {fitting(G, depth, dpi, guess, clusters, fold, rankdir)}"
            )
    attrs = {**bounded_options(guess), "dpi": str(dpi)}
    dot = pydot_of(view, graph_attrs=attrs, **defaults(options)).to_string()
    return Drawing(dot, name=named(G), nodes=view.number_of_nodes(), depth=depth, dpi=dpi,
                   advice=partial(smaller, G, depth, fold), work=(guess.nodes, guess.virtual))


def laid_out(view: nx.MultiDiGraph, guess: Estimate, options: dict[str, Any]) -> Estimate | None:
    """``guess`` with the size of dot's own layout of ``view``, and the margin a PNG adds
    around it (:data:`PNG_PAD` a side); None without Graphviz, or where dot fails on it (the
    estimate decides then)."""
    if shutil.which("dot") is None:
        return None
    text = pydot_of(view, graph_attrs=bounded_options(guess), **defaults(options)).to_string()
    try:
        plain, _ = run_dot(text, "plain", "the view")
        _, scale, width, height = plain.decode().split(maxsplit=4)[:4]  # "graph scale width height", in inches
    except (FxnxValueError, subprocess.TimeoutExpired, ValueError):
        return None
    inches = (float(width) * float(scale), float(height) * float(scale))
    across, along = sorted(72 * size + 2 * PNG_PAD for size in inches)  # the area and the longer side count
    return dataclasses.replace(guess, across=across, along=along)


#: Points Graphviz's default ``pad`` adds on each side of a PNG's layout.
PNG_PAD = 4.0


def defaults(options: dict[str, Any]) -> dict[str, Any]:
    return {"color_by": options.get("color_by"), "clusters": options.get("clusters", True),
            "rankdir": options.get("rankdir", "TB")}
