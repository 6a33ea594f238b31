"""Graphs in notebooks: inside IPython, an fxnx graph shows a short summary.

Imported by ``import fxnx``; IPython is not imported here, only looked up where it already is.
"""

from __future__ import annotations

import sys
from typing import Any

import networkx as nx

from ._analysis import summary
from ._drawing.style import clip, text


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


def register() -> None:
    """Inside IPython (and only there: IPython is not imported otherwise), show fxnx graphs by
    :func:`_graph_bundle`; other graphs keep networkx's display."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is not None and hasattr(shell, "display_formatter"):
        shell.display_formatter.mimebundle_formatter.for_type(nx.MultiDiGraph, _graph_bundle)
