"""Matplotlib figures: credit per depth, alignment angles per layer, node census.

Sized for a paper column (3.3 inches wide, 8-point text). matplotlib is
imported inside the functions, so importing fxnx never pays for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import networkx as nx

from ._analysis import node_depths, node_kind, topological_order

__all__ = ["plot_alignment", "plot_census", "plot_credit_by_depth"]

COLUMN = (3.3, 2.3)  # inches: one column of a two-column paper
COLORS = ("#1A73E8", "#E8710A", "#137333", "#C5221F", "#9334E6")


def _axes(ax: Any) -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            f"fxnx's plots need matplotlib, which is not installed here ({err}): "
            "pip install 'fxnx[plot]'"
        ) from None

    if ax is not None:
        return ax
    with plt.rc_context({"font.size": 8}):
        _, ax = plt.subplots(figsize=COLUMN, layout="constrained")
    return ax


def _style(ax: Any) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.25, linewidth=0.5)


def plot_credit_by_depth(
    G: nx.MultiDiGraph, norms: Mapping[str, Mapping[str, float | None]] | None = None, ax: Any = None
) -> Any:
    """Credit norm of every node against its depth, one series per run.

    Parameters
    ----------
    G : networkx.MultiDiGraph
    norms : mapping, optional
        Series label to ``{node: norm}`` (``CreditResult.norms()``); default:
        the ``credit_norm`` attribute the last ``route_credit`` wrote on ``G``.
    ax : matplotlib Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    if norms is None:
        norms = {G.graph.get("credit_rule", "credit"): dict(G.nodes(data="credit_norm"))}
    depth = node_depths(G)
    ax = _axes(ax)
    for (label, values), color in zip(norms.items(), COLORS, strict=False):
        points = sorted((depth[n], v) for n, v in values.items() if n in depth and v)
        ax.plot([d for d, _ in points], [v for _, v in points], ".", ms=3, color=color,
                label=label, alpha=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("depth (edges from the input)", fontsize=8)
    ax.set_ylabel("credit norm", fontsize=8)
    ax.legend(fontsize=7, frameon=False)
    _style(ax)
    return ax


def plot_alignment(
    G: nx.MultiDiGraph, angles: Mapping[str, Mapping[str, float]], ax: Any = None,
    label: str = "feedback alignment vs exact",
) -> Any:
    """Angle between two rules' credit at each layer with parameters, in graph order.

    ``angles`` is :func:`fxnx.credit.credit_alignment`'s result.
    """
    layers = [
        n for n in topological_order(G)
        if n in angles and G.nodes[n].get("num_params") and G.nodes[n].get("op") == "call_module"
    ]
    ax = _axes(ax)
    ax.plot(range(len(layers)), [angles[n]["angle"] for n in layers], "o-", ms=2.5, lw=1,
            color=COLORS[1], label=label)
    ax.axhline(90, color="#5F6368", lw=0.6, ls="--")
    ax.set_ylim(0, 100)
    ax.set_xlabel("layer with parameters, input to output", fontsize=8)
    ax.set_ylabel("angle to exact credit (°)", fontsize=8)
    ax.legend(fontsize=7, frameon=False, loc="lower left")
    _style(ax)
    return ax


def plot_census(G: nx.MultiDiGraph, top: int = 10, ax: Any = None) -> Any:
    """Horizontal bars: how many calls of each kind (module class or function), most first."""
    kinds = Counter(node_kind(data) for _, data in G.nodes(data=True)
                    if data.get("op") in ("call_module", "call_function", "call_method"))
    items = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))[:top][::-1]
    ax = _axes(ax)
    ax.barh([k for k, _ in items], [v for _, v in items], color=COLORS[0])
    ax.set_xlabel("nodes", fontsize=8)
    _style(ax)
    return ax
