"""The fit: every decision about a drawing's size, and the one search for the depth.

A PNG drawn without ``depth`` is collapsed to the deepest module level whose layout, predicted
before Graphviz runs (:mod:`.estimate`), is readable and quick (:data:`PNG_WORK`,
:data:`PNG_AREA`) and within Graphviz's :data:`MAX_PIXELS`. :func:`deepest` is that search;
the advice in errors (a smaller depth, a smaller dpi, a part that fits) asks it other questions.
No pydot, no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from .._analysis import scope_subgraph, skip_connections, topological_order
from .estimate import NODE_PAD, Estimate, area_floor, estimate_view, label_width
from .style import clip
from .view import collapse, collapsed_size, folded_parameters, listed, module_depth, view_of

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


#: The most top-level modules whose PNGs an error looks at, to name those that fit one.
MOST_PARTS = 32


def named(G: nx.MultiDiGraph) -> str:
    """The model's class name, as the legend shows it, for messages."""
    return clip(str(G.graph.get("model") or "the graph").rsplit(".", 1)[-1])


def no_png(G: nx.MultiDiGraph, depth: int | None, dpi: int, guess: Estimate, clusters: bool,
            fold: bool, rankdir: str) -> str:
    """Why no PNG of ``G`` is readable and quick at any depth, and what to do instead: SVG,
    PDF or DOT, or a PNG of each top-level module that fits one."""
    across, along = guess.across / 72, guess.along / 72
    where = "even with modules collapsed below depth 1" if depth == 1 else (
        "and has no modules to collapse" if depth is None else f"at depth={depth}")
    fit, too_large = fitting_parts(G, dpi, clusters, fold, rankdir)
    parts = ""
    if fit:
        parts = (f", or draw a part with fxnx.scope_subgraph(G, scope): {listed_names(fit)} "
                 f"{'fits' if len(fit) == 1 else 'fit'} a PNG")
        if too_large:
            parts += f" ({listed_names(too_large)} only as SVG or PDF)"
    return (
        f"{named(G)} is too large for a readable PNG {where}: about {across * along:,.0f} square "
        f"inches ({across:,.0f} by {along:,.0f}) and {guess.work:,} nodes plus virtual nodes for "
        f"long edges, where a PNG is drawn within {PNG_AREA:.0f} square inches and "
        f"{PNG_WORK:,} nodes. Write .svg or .pdf to see it whole, or .dot text to lay out "
        f"yourself{parts}."
    )


def listed_names(names: list[str], most: int = 6) -> str:
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def fitting_parts(G: nx.MultiDiGraph, dpi: int, clusters: bool, fold: bool,
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
    fit: list[str] = []
    too_large: list[str] = []
    for top in tops:
        _, _, guess = png_depth(scope_subgraph(marked, top), dpi, clusters, fold, rankdir)
        (fit if fits_png(guess, dpi) else too_large).append(top)
    return fit, too_large


def fitting(G: nx.MultiDiGraph, depth: int | None, dpi: int, guess: Estimate, clusters: bool,
             fold: bool, rankdir: str) -> str:
    """What makes a PNG too large at ``depth`` fit Graphviz's limit: a smaller depth (never
    below 1), a smaller dpi, or SVG or PDF."""
    ways = []
    found = deepest(G, lambda e: max(e.pixels(dpi)) <= MAX_PIXELS, below=depth, fold=fold,
                    clusters=clusters, rankdir=rankdir)
    if found is not None and max(found[2].pixels(dpi)) <= MAX_PIXELS:
        ways.append(f"depth={found[0]} or less")
    most = int(MAX_PIXELS * 72 / max(guess.across, guess.along, 1.0))
    if most >= 1:
        ways.append(f"dpi={most} or less")
    drawn = f"draw it with {' or with '.join(ways)}, or " if ways else ""
    return f"{drawn}write .svg or .pdf"


def deepest(G: nx.MultiDiGraph, fits: Callable[[Estimate], bool], *, below: int | None = None,
            fold: bool = True, clusters: bool = True, rankdir: str = "TB",
            crowded: Callable[[int], bool] | None = None,
            ) -> tuple[int, nx.MultiDiGraph, Estimate] | None:
    """The depth search, the only one: from the deepest module level under ``below`` (under
    ``G``'s own when None) down to 1, the first depth whose collapsed view's estimate ``fits``,
    with that view and estimate; depth 1's where none fits; None where there is no depth to
    collapse to. ``crowded(depth)`` passes a depth over (never 1) without building its view."""
    order = topological_order(G)
    top = module_depth(G) - 1 if below is None else min(below - 1, module_depth(G) - 1)
    found = None
    for depth in range(top, 0, -1):
        if depth > 1 and crowded is not None and crowded(depth):
            continue
        view = listed(collapse(G, depth, order=order, skips=False), fold)
        found = depth, view, estimate_view(view, clusters, rankdir)
        if fits(found[2]):
            break
    return found


def readable(guess: Estimate) -> bool:
    """Whether a layout this large is readable and quick as a PNG, at any resolution."""
    return guess.work <= PNG_WORK and guess.across * guess.along / 72**2 <= PNG_AREA


def fits_png(guess: Estimate, dpi: int) -> bool:
    return readable(guess) and max(guess.pixels(dpi)) <= MAX_PIXELS


def too_many(widths: list[float]) -> bool:
    """Whether no PNG of nodes this wide can be readable and quick (see :func:`fits_png`);
    ``NODE_PAD`` each for nodes known only by their count."""
    return len(widths) > PNG_WORK or area_floor(widths) > PNG_AREA * 72**2


def png_depth(
    G: nx.MultiDiGraph, dpi: int, clusters: bool, fold: bool = True, rankdir: str = "TB"
) -> tuple[int | None, nx.MultiDiGraph, Estimate]:
    """The deepest depth at which ``G`` makes a readable PNG, its view (skip connections
    marked) and estimate; depth 1 (or None, with no modules to collapse) where none does,
    which :func:`fits_png` on the estimate tells.

    A depth whose view has too many nodes to fit, whatever their layout, is passed
    over without building the view. ``fold`` is :func:`view_of`'s.
    """
    depths = range(module_depth(G) - 1, 0, -1)
    # Drawn whole, the nodes that stay are at least as wide as their own labels.
    folded = folded_parameters(G) if fold else {}
    kept = [label_width(node, data, boxed=clusters)
            for node, data in G.nodes(data=True) if node not in folded]
    if not depths or not too_many(kept):
        guess = estimate_view(listed(G, fold), clusters, rankdir)
        if not depths or fits_png(guess, dpi):
            return None, view_of(G, None, fold=fold), guess
    found = deepest(G, lambda e: fits_png(e, dpi), fold=fold, clusters=clusters, rankdir=rankdir,
                    crowded=lambda depth: too_many([NODE_PAD] * collapsed_size(G, depth)))
    assert found is not None  # depths is not empty
    depth, view, guess = found
    skip_connections(view)  # the skip connections still visible once modules are collapsed
    return depth, view, guess


def quick_depth(G: nx.MultiDiGraph, below: int | None = None, fold: bool = True) -> int | None:
    """The deepest depth, under ``below`` if given, at which dot's layout of ``G`` is quick.

    None when collapsing cannot make ``G`` smaller: it has no nested modules,
    or ``below`` is already 1.
    """
    found = deepest(G, lambda e: e.work <= PNG_WORK, below=below, fold=fold)
    return None if found is None else found[0]


def smaller(G: nx.MultiDiGraph, depth: int | None, fold: bool = True) -> str:
    """What to do when dot's layout of ``G`` at ``depth`` is too slow: a depth, if one helps."""
    quick = quick_depth(G, depth, fold)
    if quick is None:
        why = "it has no nested modules" if depth is None else f"it is drawn at depth={depth}"
        return (
            f"collapsing modules cannot make it smaller ({why}): draw one part with "
            "fxnx.scope_subgraph(G, scope), or write .dot text and run dot yourself"
        )
    return f"draw it with depth={quick} or less, or write .dot text and run dot yourself"
