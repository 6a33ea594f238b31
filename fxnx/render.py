"""Drawing graphs with Graphviz, through pydot.

The only module that imports pydot (inside its functions). DOT attributes are
built here from a constant palette; the graph's own attributes never go into
DOT as they are. ``draw(G, "x.dot")`` needs no Graphviz; PNG, SVG and PDF need
its ``dot`` program.
"""

from __future__ import annotations

import html
import math
import os
import shutil
import subprocess
import warnings
import zlib
from pathlib import Path
from typing import Any

import networkx as nx

from .analysis import short_name, topological_order
from .errors import FxnxError, FxnxValueError

__all__ = ["GraphvizNotFoundError", "draw", "to_pydot"]

#: Colours of the branches of skip connections and of plain edges.
SKIP, RESIDUAL, MERGE, FORK, PLAIN = "#E8710A", "#1A73E8", "#C5221F", "#137333", "#5F6368"
#: Borders of opaque nodes (kept whole because tracing failed) and of backward-pass nodes.
OPAQUE, BACKWARD, BACKWARD_FILL = "#202124", "#8430CE", "#DCCCF4"
#: Node fills, picked by a stable hash of the node's kind (module class or function name).
FILLS = ("#E8F0FE", "#FCE8E6", "#E6F4EA", "#FEF7E0", "#F3E8FD", "#E4F7FB", "#FDE7F3",
         "#EDEFF1", "#FFF1E6", "#E9F5E1")
#: Viridis at nine stops, for colouring nodes by a number.
VIRIDIS = ("#440154", "#472D7B", "#3B528B", "#2C728E", "#21918C", "#28AE80", "#5EC962",
           "#ADDC30", "#FDE725")
#: Graphviz cannot write a PNG wider or taller than this many pixels.
MAX_PIXELS = 32767
#: Past this many edges a PNG is unreadable and Graphviz's layout takes minutes (DenseNet-201).
MAX_EDGES = 1000
FONT = "Helvetica"
#: Appended to a module's path to name the collapsed node of its backward ops.
BACKWARD_SUFFIX = " (backward)"


class GraphvizNotFoundError(FxnxError, ImportError):
    """Graphviz's ``dot`` program, needed for PNG, SVG and PDF, is not installed."""


def to_pydot(
    G: nx.MultiDiGraph,
    *,
    depth: int | None = None,
    color_by: str | None = None,
    clusters: bool = True,
    rankdir: str = "TB",
) -> Any:
    """A ``pydot.Dot`` drawing of ``G``: skip branches coloured, shapes on edges.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert`. Skip connections are found (and
        annotated on ``G``) unless ``G`` already carries them.
    depth : int, optional
        Collapse every module nested deeper than ``depth`` into one node
        (``depth=1`` shows ResNet's four stages as four nodes).
    color_by : str, optional
        A numeric node attribute (such as ``"credit_norm"`` from credit
        routing) to colour nodes by, with a colour bar in the legend; a log
        scale when the values are positive and span more than two decades.
    clusters : bool
        Draw module boundaries (from each node's ``scope``) as boxes.
    rankdir : {"TB", "LR"}
        Top to bottom, or left to right.

    Returns
    -------
    pydot.Dot

    Examples
    --------
    >>> import torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> print(to_pydot(G).to_string().splitlines()[0])
    digraph fxnx {
    """
    import pydot

    if "skip_connections" not in G.graph:
        from .analysis import skip_connections

        skip_connections(G)
    view = _collapse(G, depth) if depth is not None else G
    if rankdir not in ("TB", "LR"):
        raise FxnxValueError(f"rankdir must be 'TB' or 'LR', got {rankdir!r}")
    dot = pydot.Dot(
        "fxnx", graph_type="digraph", rankdir=rankdir, fontname=FONT, nodesep="0.25",
        ranksep="0.3", newrank="true",
    )
    dot.set_node_defaults(fontname=FONT, fontsize="12", shape="box", style="rounded,filled",
                          margin="0.08,0.04", height="0.3")
    dot.set_edge_defaults(fontname=FONT, fontsize="10", color=PLAIN, fontcolor="#3C4043",
                          arrowsize="0.6")
    scale = _Scale(view, color_by) if color_by else None
    ids = {node: f"n{i}" for i, node in enumerate(topological_order(view))}
    parents = _clusters(dot, view, ids) if clusters else {}
    primals = view.graph.get("primals", {})
    for node, data in view.nodes(data=True):
        (parents.get(data.get("scope") or "") or dot).add_node(
            pydot.Node(ids[node], **_node_style(node, data, scale, primals.get(node)))
        )
    for u, v, data in view.edges(data=True):
        dot.add_edge(pydot.Edge(ids[u], ids[v], **_edge_style(data)))
    dot.add_node(pydot.Node("legend", **_legend(view, scale)))
    return dot


def draw(G: nx.MultiDiGraph, path: str | os.PathLike[str], *, dpi: int = 96, **options: Any) -> Path:
    """Draw ``G`` to ``path``: PNG, SVG or PDF by its suffix, or DOT text for ``.dot``/``.gv``.

    ``dpi`` is Graphviz's default 96; ask for 200 or more for print. Options are
    those of :func:`to_pydot`. A graph too tall or wide for a PNG
    (Graphviz's 32,767-pixel limit), or too dense to read (over 1,000 edges),
    is drawn collapsed to the deepest module level that fits, with a warning,
    never scaled down into a blur; SVG and PDF have no such limit.

    Raises
    ------
    GraphvizNotFoundError
        Graphviz's ``dot`` is needed (PNG, SVG, PDF) but not installed.
    FxnxValueError
        An unknown suffix, or a PNG too large at the ``depth`` asked for.

    Examples
    --------
    >>> import tempfile, torch, fxnx
    >>> G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.zeros(1, 3))
    >>> draw(G, tempfile.mkdtemp() + "/g.dot").read_text().startswith("digraph fxnx")
    True
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg", "pdf", "dot", "gv"):
        raise FxnxValueError(
            f"cannot draw to {path.name!r}: give a .png, .svg, .pdf or .dot file name"
        )
    if fmt in ("dot", "gv"):
        path.write_text(to_pydot(G, **options).to_string())
        return path
    if shutil.which("dot") is None:
        raise GraphvizNotFoundError(
            f"drawing {path.name} needs Graphviz's dot program, which is not installed. "
            "Install it with: apt-get install graphviz (Debian/Ubuntu), brew install graphviz "
            "(macOS) or conda install graphviz. Without it, draw to a .dot file instead."
        )
    depth = options.pop("depth", None)
    if fmt != "png":
        _graphviz("dot", to_pydot(G, depth=depth, **options).to_string(), fmt, dpi, path)
        return path
    # A cheap lower bound skips layouts that cannot fit; dot itself reports the rest.
    tries = [depth] if depth is not None else [None, *range(_module_depth(G) - 1, 0, -1)]
    for depth_now in tries:
        last = depth_now == tries[-1]
        view = _collapse(G, depth_now) if depth_now is not None else G
        fits = _least_pixels(view, dpi) <= MAX_PIXELS
        if not last and (not fits or view.number_of_edges() > MAX_EDGES):
            continue
        if fits:
            notes = _graphviz("dot", to_pydot(view, **options).to_string(), "png", dpi, path)
            if "too large" not in notes:
                break
            path.unlink(missing_ok=True)  # dot scaled it down into a blur: not what was asked
        if last:
            raise FxnxValueError(
                f"{path.name} would exceed Graphviz's {MAX_PIXELS}-pixel limit for PNG at "
                f"depth={depth_now} and dpi={dpi}: use a smaller depth or dpi, or write .svg or .pdf"
            )
    if depth_now != depth:
        warnings.warn(
            f"{G.graph.get('model', 'the graph')} is too large for a readable PNG; drew it "
            f"with modules collapsed below depth {depth_now}. Write .svg or .pdf to see every "
            "node, or pick depth= yourself.",
            stacklevel=2,
        )
    return path


def _graphviz(program: str, text: str, fmt: str, dpi: int, path: Path) -> str:
    """Run a Graphviz program on DOT text, writing ``path``; return its warnings."""
    done = subprocess.run(
        [program, f"-T{fmt}", f"-Gdpi={dpi}", "-o", str(path)],
        input=text.encode(), capture_output=True, check=False,
    )
    if done.returncode != 0:
        raise FxnxValueError(f"Graphviz's {program} failed: {done.stderr.decode().strip()}")
    return done.stderr.decode()


def _least_pixels(G: nx.MultiDiGraph, dpi: int) -> float:
    """A lower bound on the layout's length along its ranks: 0.3 inch a node, 0.3 between."""
    return (nx.dag_longest_path_length(G) * 0.6 + 0.3) * dpi


# --- collapsing modules -----------------------------------------------------------------------


def _path(data: dict[str, Any]) -> str:
    """The module path a node belongs to: the module itself for call_module, else its scope."""
    return data["target"] if data.get("op") == "call_module" else (data.get("scope") or "")


def _module_depth(G: nx.MultiDiGraph) -> int:
    return max((len(_path(d).split(".")) for _, d in G.nodes(data=True) if _path(d)), default=0)


def _collapse(G: nx.MultiDiGraph, depth: int) -> nx.MultiDiGraph:
    """Replace every module nested deeper than ``depth`` by one node for its ancestor at ``depth``.

    A module whose calls would close a cycle once merged (one module called at
    several places) is left expanded.
    """
    if depth < 1:
        raise FxnxValueError(f"depth must be 1 or more, got {depth}")
    group: dict[str, str] = {}
    owners = {  # a parameter or buffer belongs to the module that owns it
        node: primal["name"].rpartition(".")[0]
        for node, primal in G.graph.get("primals", {}).items() if primal["kind"] != "input"
    }
    owners.update(
        (node, data["target"].rpartition(".")[0])
        for node, data in G.nodes(data=True) if data.get("op") == "get_attr"
    )
    for node, data in G.nodes(data=True):
        path = owners.get(node, _path(data))
        parts = path.split(".") if path else []
        leaf_call = data.get("op") == "call_module" and len(parts) == depth
        # In a joint graph a module's backward ops form a node of their own.
        suffix = BACKWARD_SUFFIX if data.get("phase") == "backward" else ""
        keep = len(parts) >= depth and not leaf_call
        group[node] = ".".join(parts[:depth]) + suffix if keep else node
    while True:
        H = _grouped(G, group)
        if nx.is_directed_acyclic_graph(H):
            break
        cyclic = {u for u, *_ in nx.find_cycle(H)} - set(G)
        group.update({n: n for n, g in group.items() if g in cyclic})
    from .analysis import skip_connections

    skip_connections(H)  # the skip connections still visible once modules are collapsed
    return H


def _grouped(G: nx.MultiDiGraph, group: dict[str, str]) -> nx.MultiDiGraph:
    modules = G.graph.get("modules", {})
    H = nx.MultiDiGraph(**{k: v for k, v in G.graph.items() if k != "skip_connections"})
    for node in topological_order(G):
        key, data = group[node], G.nodes[node]
        if key == node:
            H.add_node(node, **_without_roles(data))
            continue
        if key not in H:
            path = key.removesuffix(BACKWARD_SUFFIX)
            H.add_node(key, op="module", target=path, module_type=modules.get(path),
                       scope=path.rpartition(".")[0], order=data.get("order"), members=0,
                       phase="backward" if path != key else "forward")
        H.nodes[key]["members"] += 1
        for attr in ("credit_norm", "out_shape"):  # the value at the module's output
            if data.get(attr) is not None:
                H.nodes[key][attr] = data[attr]
    bundles: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for u, v, data in G.edges(data=True):
        if group[u] != group[v]:
            bundles.setdefault((group[u], group[v]), []).append(data)
    for (gu, gv), edges in bundles.items():
        # One edge per pair of nodes; several distinct tensors become one edge that counts them.
        distinct = {str(d.get("shape")) for d in edges}
        data = _without_roles(edges[0])
        if len(distinct) > 1:
            data.update(shape=None, tensors=len(distinct))
        H.add_edge(gu, gv, **data)
    return H


def _without_roles(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in ("branch_role", "branch_merge")}


# --- styles -----------------------------------------------------------------------------------


def _kind(data: dict[str, Any]) -> str:
    op = data.get("op")
    if op in ("call_module", "module"):
        return (data.get("module_type") or "module").rsplit(".", 1)[-1]
    if op == "call_method":
        return f".{data['target']}()"
    if op == "call_function":
        return short_name(data["target"])
    return {"placeholder": "input", "get_attr": "parameter", "output": "output"}.get(op, op or "")


def _node_style(
    node: str, data: dict[str, Any], scale: _Scale | None, primal: dict[str, str] | None = None
) -> dict[str, str]:
    kind = f"{primal['kind']} {primal['name']}" if primal else _kind(data)
    name = node
    if data.get("op") == "module":  # inside its parent's box, the last part of the path says it
        last = data["target"].rpartition(".")[2]
        name = data["target"] if last.isdigit() else last
    lines = [f"<B>{html.escape(str(name))}</B>"]
    if kind and kind != name:
        lines.append(f'<FONT POINT-SIZE="10">{html.escape(kind)}</FONT>')
    if data.get("op") == "module" and data.get("members"):
        lines[-1] = lines[-1].replace("</FONT>", f" · {data['members']} ops</FONT>")
    if data.get("opaque"):
        lines.append('<FONT POINT-SIZE="9">opaque: not traced</FONT>')
    style = {"label": "<" + "<BR/>".join(lines) + ">"}
    fill = FILLS[zlib.crc32((primal["kind"] if primal else kind).encode()) % len(FILLS)]
    if scale is not None:
        value = data.get(scale.attr)
        fill = scale.color(value) if value is not None else "#FFFFFF"
        if value is not None and scale.dark(value):
            style["fontcolor"] = "#FFFFFF"
    style["fillcolor"] = fill
    role = data.get("branch_role")
    if role == "merge":
        style.update(color=MERGE, penwidth="2.5", peripheries="2")
    elif role == "fork":
        style.update(color=FORK, penwidth="2.5")
    elif role == "skip":
        style.update(color=SKIP, penwidth="1.5")
    elif role == "residual":
        style.update(color=RESIDUAL, penwidth="1.2")
    if data.get("phase") == "backward":
        style.setdefault("color", BACKWARD)
        if scale is None:
            style["fillcolor"] = BACKWARD_FILL
    if data.get("op") in ("placeholder", "output"):
        style["shape"] = "oval"
    if data.get("op") == "module":
        style["style"] = "rounded,filled,bold"
    if data.get("opaque"):
        style.update(style="rounded,filled,dashed", penwidth="2", color=OPAQUE)
    return style


def _edge_style(data: dict[str, Any]) -> dict[str, str]:
    style = {}
    shape = data.get("shape")
    if isinstance(shape, tuple):
        style["xlabel"] = " " + "×".join(map(str, shape)) + " "
    elif data.get("tensors"):
        style.update(xlabel=f" {data['tensors']} tensors ", penwidth="2")
    role = data.get("branch_role")
    if role == "skip":
        style.update(color=SKIP, penwidth="2.5")
    elif role == "residual":
        style.update(color=RESIDUAL, penwidth="1.6")
    return style


def _clusters(dot: Any, G: nx.MultiDiGraph, ids: dict[str, str]) -> dict[str, Any]:
    """A nested pydot cluster for every scope that holds nodes; scope path to cluster."""
    import pydot

    modules = G.graph.get("modules", {})
    scopes = sorted({d.get("scope") or "" for _, d in G.nodes(data=True)} - {""})
    needed = set()
    for scope in scopes:  # every ancestor of a used scope needs a box too
        parts = scope.split(".")
        needed.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    clusters: dict[str, Any] = {}
    for i, scope in enumerate(sorted(needed, key=lambda s: (s.count("."), s))):
        kind = (modules.get(scope) or "").rsplit(".", 1)[-1]
        label = f"{scope}: {kind}" if kind else scope
        cluster = pydot.Cluster(
            f"c{i}", label=html.escape(label), style="rounded,dashed", color="#9AA0A6",
            fontname=FONT, fontsize="11", fontcolor="#5F6368", labeljust="l",
        )
        clusters[scope] = cluster
        parent = scope.rpartition(".")[0]
        (clusters.get(parent) or dot).add_subgraph(cluster)
    return clusters


class _Scale:
    """Maps a numeric node attribute onto viridis, on a log scale when it spans decades."""

    def __init__(self, G: nx.MultiDiGraph, attr: str) -> None:
        values = [v for _, v in G.nodes(data=attr) if isinstance(v, (int, float)) and math.isfinite(v)]
        if not values:
            raise FxnxValueError(
                f"color_by={attr!r}: no node has a numeric {attr!r} attribute "
                "(for 'credit_norm', run fxnx.route_credit on G first)"
            )
        self.attr = attr
        self.low, self.high = min(values), max(values)
        self.log = self.low > 0 and self.high / self.low > 100

    def position(self, value: float) -> float:
        lo, hi, v = self.low, self.high, value
        if self.log:
            lo, hi, v = math.log10(lo), math.log10(hi), math.log10(max(value, self.low))
        return 0.0 if hi == lo else min(1.0, max(0.0, (v - lo) / (hi - lo)))

    def color(self, value: float) -> str:
        return VIRIDIS[round(self.position(value) * (len(VIRIDIS) - 1))]

    def dark(self, value: float) -> bool:
        return self.position(value) < 0.55


def _legend(G: nx.MultiDiGraph, scale: _Scale | None) -> dict[str, str]:
    rows = []
    if G.graph.get("skip_connections"):
        rows += [
            f'<TR><TD><FONT COLOR="{SKIP}"><B>━━</B></FONT></TD><TD ALIGN="LEFT">skip branch</TD></TR>',
            f'<TR><TD><FONT COLOR="{RESIDUAL}"><B>━━</B></FONT></TD><TD ALIGN="LEFT">residual branch</TD></TR>',
            f'<TR><TD BORDER="2" COLOR="{MERGE}"> </TD><TD ALIGN="LEFT">merge (add, cat)</TD></TR>',
            f'<TR><TD BORDER="2" COLOR="{FORK}"> </TD><TD ALIGN="LEFT">fork</TD></TR>',
        ]
    if any(data.get("opaque") for _, data in G.nodes(data=True)):
        rows.append(
            f'<TR><TD BORDER="1" STYLE="dashed" COLOR="{OPAQUE}"> </TD>'
            '<TD ALIGN="LEFT">opaque: kept whole, tracing failed inside</TD></TR>'
        )
    if G.graph.get("level") == "joint":
        rows.append(
            f'<TR><TD BORDER="1" BGCOLOR="{BACKWARD_FILL}" COLOR="{BACKWARD}"> </TD>'
            '<TD ALIGN="LEFT">backward pass</TD></TR>'
        )
    if scale is not None:
        cells = "".join(f'<TD BGCOLOR="{c}" WIDTH="12"> </TD>' for c in VIRIDIS)
        low, high = f"{scale.low:.3g}", f"{scale.high:.3g}"
        rows.append(
            f'<TR><TD COLSPAN="2"><TABLE BORDER="0" CELLSPACING="0"><TR>{cells}</TR></TABLE></TD></TR>'
        )
        rows.append(
            f'<TR><TD ALIGN="LEFT">{low}</TD><TD ALIGN="RIGHT">{high}</TD></TR>'
            f'<TR><TD COLSPAN="2">{html.escape(scale.attr)}{" (log scale)" if scale.log else ""}</TD></TR>'
        )
    title = html.escape((G.graph.get("model") or "").rsplit(".", 1)[-1])
    table = (
        f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2"><TR><TD COLSPAN="2"><B>{title}</B></TD></TR>'
        + "".join(rows) + "</TABLE>"
    )
    return {"label": f"<{table}>", "shape": "plain", "style": "", "fontsize": "11"}
