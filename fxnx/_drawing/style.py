"""DOT attributes for :mod:`.dot`: palette, line styles, escaped labels, legend.

Every string taken from a graph reaches DOT through :func:`text` (inside
HTML-like labels) or :func:`quoted` (a quoted DOT string shown literally), and
node ids through :func:`node_id`; nothing from the graph is pasted into DOT
as it is. Each is cut short (:func:`clip`), so that a drawing's size is bounded by
its graph's nodes and edges, whatever their strings hold. No pydot, no torch.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import math
import re
import reprlib
import zlib
from typing import Any

import networkx as nx

from .._analysis import node_kind
from .._errors import FxnxValueError
from .view import LISTED

__all__ = [
    "BACKWARD", "BACKWARD_FILL", "FILLS", "FONT", "FORK", "MERGE", "OPAQUE", "PLAIN",
    "RESIDUAL", "SKIP", "SKIP_STYLE", "Scale", "VIRIDIS", "clip", "cluster_label", "cluster_title",
    "edge_label", "edge_style", "kind", "legend", "node_id", "node_style", "quoted",
    "text",
]

#: Okabe and Ito's colour-blind-safe colours: skip branches vermillion and dashed, residual
#: branches blue and solid (told apart in grayscale by the dashes), merges orange with a double
#: border, forks bluish green with a thick one; plain edges gray.
SKIP, RESIDUAL, MERGE, FORK, PLAIN = "#D55E00", "#0072B2", "#E69F00", "#009E73", "#5F6368"
#: The line style of skip edges; residual and plain edges are solid.
SKIP_STYLE = "dashed"
#: Borders of opaque nodes (kept whole because tracing failed) and of backward-pass nodes.
OPAQUE, BACKWARD, BACKWARD_FILL = "#202124", "#8430CE", "#DCCCF4"
#: Node fills, picked by a stable hash of the node's kind (module class or function name).
FILLS = ("#E8F0FE", "#FCE8E6", "#E6F4EA", "#FEF7E0", "#F3E8FD", "#E4F7FB", "#FDE7F3",
         "#EDEFF1", "#FFF1E6", "#E9F5E1")
#: Viridis at nine stops, for colouring nodes by a number.
VIRIDIS = ("#440154", "#472D7B", "#3B528B", "#2C728E", "#21918C", "#28AE80", "#5EC962",
           "#ADDC30", "#FDE725")
#: A standard PostScript font: SVG names it (with sans-serif as fallback), PDF embeds it.
FONT = "Helvetica"
#: Font sizes in points, the only place they are set (:mod:`.estimate` measures text by them,
#: so a change here changes the predicted layout too):
#: a node's name; its kind, notes and listed parameters, and an edge's shape; a module box's
#: label and the legend; the note on an opaque node.
NAME_SIZE, TEXT_SIZE, BOX_SIZE, SMALL_SIZE = 12, 10, 11, 9
#: The size of the thin empty line between a node's name and what follows.
GAP_SIZE = 1
#: Characters a line of the parameters listed on a node may hold, unless one name is longer.
NAMES_LINE = 26
#: Characters of a graph's string shown in a label or a node id, and on a line of a tooltip:
#: longer ones are cut, ending in an ellipsis (real names, targets and paths stay within them).
LABEL_CHARS, TOOLTIP_CHARS = 80, 200
#: Short reprs of values on a tooltip: a shape of any length, or a list of many, is cut short.
_REPR = reprlib.Repr()
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = 16
_REPR.maxstring = _REPR.maxother = TOOLTIP_CHARS

_PLAIN_ID = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PYDOT_QUOTES = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_. ()+\-/]*\Z")  # pydot quotes these faithfully
_KEYWORDS = {"graph", "subgraph", "digraph", "node", "edge", "strict"}


def clip(value: Any, limit: int = LABEL_CHARS) -> str:
    """``value`` as text of at most ``limit`` characters, cut short with an ellipsis.

    Examples
    --------
    >>> clip("layer1_0_conv1"), clip("x" * 100, 10)
    ('layer1_0_conv1', 'xxxxxxxxx…')
    """
    if not isinstance(value, str):  # a shape, a list of shapes, a number
        value = _REPR.repr(value) if isinstance(value, (tuple, list, dict)) else str(value)
    return value if len(value) <= limit else value[: limit - 1] + "…"


def text(value: Any) -> str:
    """``value`` as text inside an HTML-like label: markup escaped, line breaks as spaces.

    Examples
    --------
    >>> text('<IMG SRC="/etc/passwd">')
    '&lt;IMG SRC=&quot;/etc/passwd&quot;&gt;'
    """
    return html.escape(str(value)).replace("\r", " ").replace("\n", " ")


def quoted(value: Any) -> str:
    """``value`` as a quoted DOT string that Graphviz shows literally (``\\N`` stays ``\\N``).

    Examples
    --------
    >>> print(quoted('a "b" \\\\N'))
    "a \\"b\\" \\\\N"
    """
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\r", "")
    return '"' + escaped.replace("\n", "\\n") + '"'


def node_id(name: Any) -> str:
    """The DOT id of a node: its name, so that ``P.get_node(name)`` finds it.

    Names pydot quotes faithfully (identifiers, module paths such as
    ``layer1.0``) are given to pydot as they are; any other name is quoted
    and escaped here, and ``P.get_node`` then needs that quoted form.

    A name longer than :data:`LABEL_CHARS` is cut short and ends in a hash
    of the whole name, which tells such names apart (:func:`_id_text`).

    Examples
    --------
    >>> node_id("layer1_0_conv1"), node_id("layer1.0"), node_id('a"b'), node_id("node")
    ('layer1_0_conv1', 'layer1.0', '"a\\\\"b"', '"node"')
    """
    name = _id_text(name)
    if name.lower() not in _KEYWORDS and (_PLAIN_ID.match(name) or _PYDOT_QUOTES.match(name)):
        return name
    return quoted(name)


def _id_text(name: Any) -> str:
    """A node's name, or for a name longer than :data:`LABEL_CHARS`, its start, an ellipsis
    and 16 hex digits of a hash of the whole name."""
    name = str(name)
    if len(name) <= LABEL_CHARS:
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{name[: LABEL_CHARS - 17]}…{digest}"


def kind(data: dict[str, Any]) -> str:
    """A node's kind as drawn: :func:`fxnx._analysis.node_kind`, cut short; a method as ``.view()``."""
    word = clip(node_kind(data))
    return f".{word}()" if data.get("op") == "call_method" else word


def _title(node: Any, data: dict[str, Any], boxed: bool = True) -> str:
    """The bold name on a node: its own name, or what its module's box leaves to say.

    A collapsed module is named by the last part of its path; a parameter
    drawn in its module's box (``boxed``) by its path from that module
    (``weight``, or ``norm.weight`` if read by the norm's parent). At most
    :data:`LABEL_CHARS` characters.
    """
    target = str(data.get("target"))
    if data.get("op") == "module":  # inside its parent's box, the last part of the path says it
        last = target.rpartition(".")[2]
        return clip(target if last.isdigit() else last)
    scope = str(data.get("scope") or "")
    if boxed and data.get("op") == "get_attr" and scope and target.startswith(scope + "."):
        return clip(target[len(scope) + 1:])
    return clip(node)


def _parameter_lines(data: dict[str, Any], boxed: bool = True) -> list[str]:
    """The parameters listed on a node (see :func:`.view.fold_parameters`), a few to a
    line: inside the node's module box by their path from it (``weight``), else by their
    node names."""
    names = [_title(name, {"op": "get_attr", "target": target, "scope": data.get("scope")}, boxed)
             for name, target, _ in data.get(LISTED, ())]
    lines: list[str] = []
    for name in names:
        if lines and len(lines[-1]) + 3 + len(name) <= NAMES_LINE:
            lines[-1] += " · " + name
        else:
            lines.append(name)
    return lines


def _tooltip(node: Any, data: dict[str, Any], kind_text: str) -> str:
    """A node's tooltip: its name, op, target and shape, each line of at most
    :data:`TOOLTIP_CHARS` characters."""
    lines = [clip(node, TOOLTIP_CHARS), f"op: {clip(data.get('op'))} ({kind_text})",
             f"target: {clip(data.get('target'), TOOLTIP_CHARS)}"]
    if data.get("out_shape") is not None:
        lines.append(f"output shape: {clip(data['out_shape'], TOOLTIP_CHARS)}")
    if data.get("op") == "module" and data.get("members"):
        lines.append(f"{clip(data['members'])} ops collapsed")
    lines.extend(clip(f"reads {clip(target)}: shape {clip(shape)} (node {clip(name)})",
                      TOOLTIP_CHARS) for name, target, shape in data.get(LISTED, ()))
    return "\n".join(lines)


def node_style(
    node: Any, data: dict[str, Any], scale: Scale | None, primal: dict[str, str] | None = None,
    *, boxed: bool = True,
) -> dict[str, str]:
    """DOT attributes of one node: label, tooltip, SVG id, fill and border by branch role.

    ``boxed`` says the node is drawn inside its module's box, which names the
    module, so a parameter is labelled by its attribute name alone.
    """
    what = clip(f"{clip(primal.get('kind'))} {clip(primal.get('name'))}") if primal else kind(data)
    name = _title(node, data, boxed)
    # a thin empty line under the name: its underscores (layer1_0_conv1) hang below its
    # baseline and would touch the next line's capitals, which then look overlined
    lines = [f'<B>{text(name)}</B><BR/><FONT POINT-SIZE="{GAP_SIZE}"> </FONT>']
    note = what
    if data.get("op") == "module" and data.get("members"):
        note = f"{what} · {clip(data['members'])} ops"
    if note and note != name:
        lines.append(f'<FONT POINT-SIZE="{TEXT_SIZE}">{text(note)}</FONT>')
    # The parameters it alone reads, in italics: what it holds, not what flows into it.
    lines.extend(f'<FONT POINT-SIZE="{TEXT_SIZE}"><I>{text(line)}</I></FONT>'
                 for line in _parameter_lines(data, boxed))
    if data.get("opaque"):
        lines.append(f'<FONT POINT-SIZE="{SMALL_SIZE}">opaque: not traced</FONT>')
    style = {"label": "<" + "<BR/>".join(lines) + ">", "tooltip": quoted(_tooltip(node, data, what)),
             "id": quoted(_id_text(node))}
    fill = FILLS[zlib.crc32(str(primal.get("kind") if primal else what).encode()) % len(FILLS)]
    if scale is not None:
        value: Any = data.get(scale.attr)
        usable = isinstance(value, (int, float)) and math.isfinite(value)
        fill = scale.color(value) if usable else "#FFFFFF"
        if usable and scale.dark(value):
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


def edge_label(data: dict[str, Any]) -> str | None:
    """The label of an edge: the tensor's shape (``" 2×4 "``), or how many tensors a collapsed
    module's edge carries; None for neither. At most :data:`LABEL_CHARS` characters between
    its two spaces.

    Several tensors (a list or dict of shapes: what ``unbind`` or ``split`` returns) are
    counted, with their one shape where they share it.

    Examples
    --------
    >>> edge_label({"shape": (1, 64, 56, 56)}), edge_label({"tensors": 3}), edge_label({})
    (' 1×64×56×56 ', ' 3 tensors ', None)
    >>> edge_label({"shape": [(2, 8), (2, 8)]}), edge_label({"shape": {"a": (2,), "b": (3,)}})
    (' 2 of 2×8 ', ' 2 tensors ')
    >>> edge_label({"shape": ()}), edge_label({"shape": []})
    (' () ', None)
    """
    shape = data.get("shape")
    if isinstance(shape, (tuple, list, dict)):
        shapes = [leaf for leaf in _shape_leaves(shape) if leaf is not None]
        if not shapes:
            return None
        if len(shapes) == 1:
            return _dims(shapes[0])
        if all(leaf == shapes[0] for leaf in shapes):
            return " " + clip(f"{len(shapes)} of {_dims(shapes[0]).strip()}") + " "
        return f" {len(shapes)} tensors "
    if data.get("tensors"):
        return f" {clip(data['tensors'])} tensors "
    return None


def _dims(shape: Any) -> str:
    """One shape, as ``" 2×4 "``, a scalar's as ``" () "`` (no more of a long one read than
    is shown)."""
    dims = "×".join(clip(d) for d in itertools.islice(shape, LABEL_CHARS // 2 + 1))
    return " " + (clip(dims) or "()") + " "


def _shape_leaves(shape: Any) -> list[Any]:
    """The shapes in a shape, or in a list or dict of shapes (nested, None for a value that is
    no tensor); a list of dimensions is one shape (as a JSON reader of networkx's own gives it
    back)."""
    if shape is None or isinstance(shape, tuple):
        return [shape]
    if isinstance(shape, list) and shape and all(isinstance(d, int | str) for d in shape):
        return [tuple(shape)]
    values = shape.values() if isinstance(shape, dict) else shape
    return [leaf for value in values for leaf in _shape_leaves(value)]


def edge_style(data: dict[str, Any], *, beside: bool = False, rankdir: str = "TB") -> dict[str, str]:
    """DOT attributes of one edge: the tensor's shape, and colour and dashes by branch role.

    With ``beside``, the edge may stay within a rank (``minlen=0``): its tail is
    a parameter, drawn beside its consumer rather than above it. Top to bottom,
    the shape is an ``xlabel``, set beside the edge after layout; left to right,
    where the edges between ranks are short and such labels would cover the
    nodes, it is the edge's ``label``, which dot makes room for.

    Examples
    --------
    >>> edge_style({"shape": (2, 4)}), edge_style({"shape": (2, 4)}, rankdir="LR")
    ({'xlabel': '" 2×4 "'}, {'label': '" 2×4 "'})
    """
    style = {"minlen": "0"} if beside else {}
    label = edge_label(data)
    if label is not None:
        style["xlabel" if rankdir == "TB" else "label"] = quoted(label)
    if data.get("tensors") and not isinstance(data.get("shape"), (tuple, list)):
        style["penwidth"] = "2"
    role = data.get("branch_role")
    if role == "skip":
        style.update(color=SKIP, penwidth="2.5", style=SKIP_STYLE)
    elif role == "residual":
        style.update(color=RESIDUAL, penwidth="1.6")
    return style


def cluster_title(scope: str, module_type: Any) -> str:
    """The text of a module box's label: its path and class.

    Examples
    --------
    >>> cluster_title("layer1.0", "torchvision.models.resnet.BasicBlock")
    'layer1.0: BasicBlock'
    """
    kind_text = clip(str(module_type or "").rsplit(".", 1)[-1])
    return f"{clip(scope)}: {kind_text}" if kind_text else clip(scope)


def cluster_label(scope: str, module_type: Any) -> str:
    """The HTML-like label of a module's box: its path and class (:func:`cluster_title`)."""
    return "<" + text(cluster_title(scope, module_type)) + ">"


class Scale:
    """Maps a numeric node attribute onto viridis, on a log scale when it spans decades."""

    def __init__(self, G: nx.MultiDiGraph, attr: str) -> None:
        values = [v for _, v in G.nodes(data=attr)
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
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


def _line(color: str, dashed: bool) -> str:
    """A legend cell showing a line 3 points thick: four dashes, or one solid bar."""
    bar = f'<TD BGCOLOR="{color}" WIDTH="{{}}" HEIGHT="3" FIXEDSIZE="TRUE"></TD>'
    cells = bar.format(6) * 4 if dashed else bar.format(33)
    return (f'<TD><TABLE BORDER="0" CELLPADDING="0" CELLSPACING="3"><TR>{cells}</TR>'
            "</TABLE></TD>")


def legend(G: nx.MultiDiGraph, scale: Scale | None) -> dict[str, str]:
    """The legend, as the drawing's own label above it at the right (a node beside the input
    would widen the figure): the model's name, and one row for each mark that the drawing
    of ``G`` shows; no label when there is nothing to say."""
    node_roles = {data.get("branch_role") for _, data in G.nodes(data=True)}
    edge_roles = {data.get("branch_role") for *_, data in G.edges(data=True)}
    rows = []
    if "skip" in edge_roles:
        rows.append(f'<TR>{_line(SKIP, True)}<TD ALIGN="LEFT">skip branch (dashed)</TD></TR>')
    if "residual" in edge_roles:
        rows.append(f'<TR>{_line(RESIDUAL, False)}<TD ALIGN="LEFT">residual branch (solid)</TD></TR>')
    if "merge" in node_roles:
        double = (f'<TABLE BORDER="2" CELLBORDER="2" CELLSPACING="2" COLOR="{MERGE}">'
                  f'<TR><TD COLOR="{MERGE}"> </TD></TR></TABLE>')
        rows.append(f'<TR><TD>{double}</TD><TD ALIGN="LEFT">merge (add, cat)</TD></TR>')
    if "fork" in node_roles:
        rows.append(f'<TR><TD BORDER="2" COLOR="{FORK}"> </TD><TD ALIGN="LEFT">fork</TD></TR>')
    if any(data.get("opaque") for _, data in G.nodes(data=True)):
        rows.append(
            f'<TR><TD BORDER="1" STYLE="dashed" COLOR="{OPAQUE}"> </TD>'
            '<TD ALIGN="LEFT">opaque: kept whole, tracing failed inside</TD></TR>'
        )
    if any(data.get("phase") == "backward" for _, data in G.nodes(data=True)):
        rows.append(
            f'<TR><TD BORDER="1" BGCOLOR="{BACKWARD_FILL}" COLOR="{BACKWARD}"> </TD>'
            '<TD ALIGN="LEFT">backward pass</TD></TR>'
        )
    if any(data.get(LISTED) for _, data in G.nodes(data=True)):
        rows.append('<TR><TD><I>italics</I></TD><TD ALIGN="LEFT">parameters only this op reads</TD></TR>')
    left_out = G.graph.get("checks_left_out")
    if left_out:
        rows.append(
            f'<TR><TD COLSPAN="2" ALIGN="LEFT">{clip(left_out)} assertion{"s" if left_out > 1 else ""} '
            'not drawn (checks=True)</TD></TR>'
        )
    if scale is not None:
        cells = "".join(f'<TD BGCOLOR="{c}" WIDTH="12"> </TD>' for c in VIRIDIS)
        rows.append(
            f'<TR><TD COLSPAN="2"><TABLE BORDER="0" CELLSPACING="0"><TR>{cells}</TR></TABLE></TD></TR>'
        )
        rows.append(
            f'<TR><TD ALIGN="LEFT">{scale.low:.3g}</TD><TD ALIGN="RIGHT">{scale.high:.3g}</TD></TR>'
            f'<TR><TD COLSPAN="2">{text(clip(scale.attr))}{" (log scale)" if scale.log else ""}</TD></TR>'
        )
    title = text(clip(str(G.graph.get("model") or "").rsplit(".", 1)[-1]))
    if title:  # (an empty <B></B> is a syntax error to dot)
        rows.insert(0, f'<TR><TD COLSPAN="2"><B>{title}</B></TD></TR>')
    if not rows:
        return {}
    table = '<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2">' + "".join(rows) + "</TABLE>"
    return {"label": f"<{table}>", "labelloc": "t", "labeljust": "r", "fontsize": str(BOX_SIZE)}
