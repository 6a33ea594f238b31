"""A graph as tables: what each module costs, as torchinfo shows it, and pandas DataFrames.

:func:`module_costs` adds up the nodes' ``flops``, ``macs`` and parameters by module;
:func:`cost_table` prints them as text and :func:`cost_summary` gives the totals.
:func:`to_frames` gives the nodes and edges as two pandas DataFrames. Nothing here
imports torch, and pandas only inside :func:`to_frames`: graphs loaded from files work
without either.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import networkx as nx

from ._contract import EDGE_ATTRIBUTES, NODE_ATTRIBUTES, explained
from ._errors import PandasNotFoundError

__all__ = ["PandasNotFoundError", "cost_summary", "cost_table", "module_costs", "to_frames"]

#: Attribute name to its type in the contract, for nodes and edges.
_KINDS = {"node": {a.name: a.kind for a in NODE_ATTRIBUTES},
          "edge": {a.name: a.kind for a in EDGE_ATTRIBUTES}}
#: The columns of :func:`module_costs`' rows that hold counts.
COUNTS = ("params", "trainable_params", "flops", "macs")


def module_costs(G: nx.MultiDiGraph, depth: int | None = None) -> list[dict[str, Any]]:
    """What each module of ``G`` costs, its submodules included: one row per module.

    A node counts towards the module it belongs to and every module around it: a
    ``call_module`` node to the module it calls, any other node to its ``scope``.
    Parameters count once per owner (a module called twice owns its parameters once), and
    a parameter tied between two owners once in each module around both; for ATen graphs
    the owner of a parameter is the module its name is in.

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert`.
    depth : int, optional
        Only modules at most this deep (the model is 0, its children 1); all by default.

    Returns
    -------
    list of dict
        In the order modules are first used (parents before children), each
        ``{"module": path, "type": qualified class name, "depth": int, "out_shape": shape
        of the last value leaving the module, "params", "trainable_params", "flops",
        "macs"}``. A count is None where a node's is unknown or the graph predates costs.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> G = fxnx.convert(model, torch.zeros(5, 3))
    >>> [(row["module"], row["params"], row["flops"]) for row in module_costs(G)]
    [('', 26, 200), ('0', 16, 120), ('1', 0, 0), ('2', 10, 80)]
    """
    rows = {
        path: {"module": path, "type": cls, "depth": _depth(path), "out_shape": None,
               **dict.fromkeys(COUNTS, 0)}
        for path, cls in G.graph.get("modules", {"": None}).items()
    }
    for _, data in G.nodes(data=True):
        for key in ("flops", "macs"):
            _add(rows, _home(data), key, data.get(key))
    owners = _owners(G)
    for path, (params, trainable) in owners.items():
        _add(rows, path, "params", params)
        _add(rows, path, "trainable_params", trainable)
    _count_tied_once(G, rows, owners)
    if "flops" not in G.graph:  # made before costs were recorded
        for row in rows.values():
            row["flops"] = row["macs"] = row["trainable_params"] = None
    for path, shape in _out_shapes(G).items():
        if path in rows:
            rows[path]["out_shape"] = shape
    if "" in rows:
        rows[""]["out_shape"] = _model_output(G)
    return [row for row in rows.values() if depth is None or row["depth"] <= depth]


def cost_summary(G: nx.MultiDiGraph) -> dict[str, Any]:
    """The model's totals: parameters (trainable and frozen), FLOPs and multiply-adds.

    ``forward_flops`` and ``backward_flops`` split ``flops`` by the nodes' ``phase``
    (``backward_flops`` is 0 but on joint graphs). Counts a graph made before costs
    were recorded lacks are None.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Linear(3, 2)
    >>> model.bias.requires_grad_(False)
    Parameter containing:
    tensor([...])
    >>> cost_summary(fxnx.convert(model, torch.zeros(5, 3)))
    {'params': 8, 'trainable_params': 6, 'frozen_params': 2, 'flops': 60, 'macs': 30, 'forward_flops': 60, 'backward_flops': 0}
    """
    params, trainable = G.graph.get("num_params"), G.graph.get("trainable_params")
    phases: dict[str, int | None] = {"forward": 0, "backward": 0}
    for _, data in G.nodes(data=True):
        phase = data.get("phase", "forward")
        flops = data.get("flops")
        phases[phase] = None if flops is None or phases[phase] is None else phases[phase] + flops
    known = "flops" in G.graph
    return {
        "params": params,
        "trainable_params": trainable,
        "frozen_params": None if params is None or trainable is None else params - trainable,
        "flops": G.graph.get("flops"),
        "macs": G.graph.get("macs"),
        "forward_flops": phases["forward"] if known else None,
        "backward_flops": phases["backward"] if known else None,
    }


@explained
def cost_table(G: nx.MultiDiGraph, depth: int | None = 3) -> str:
    """A table of what each module costs, with totals, as torchinfo prints one.

    Each row is a module, indented by depth, with the shape of its output, its
    parameters (trainable ones too), FLOPs and multiply-adds, its submodules
    included; "-" where a count is unknown. The totals are the model's
    (:func:`cost_summary`).

    Parameters
    ----------
    G : networkx.MultiDiGraph
        A graph from :func:`fxnx.convert`.
    depth : int or None
        The deepest modules shown (the model's children are 1); None shows all.

    Examples
    --------
    >>> import torch, fxnx
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> print(cost_table(fxnx.convert(model, torch.zeros(5, 3))))
    Module        Output shape  Params  Trainable  FLOPs  MACs
    ------------  ------------  ------  ---------  -----  ----
    Sequential    (5, 2)            26         26    200   100
      0 (Linear)  (5, 4)            16         16    120    60
      1 (ReLU)    (5, 4)             0          0      0     0
      2 (Linear)  (5, 2)            10         10     80    40
    ------------  ------------  ------  ---------  -----  ----
    Total parameters: 26 (trainable 26, frozen 0)
    Total FLOPs: 200 (200 forward, 0 backward)
    Total MACs: 100
    """
    header = ("Module", "Output shape", "Params", "Trainable", "FLOPs", "MACs")
    lines = [
        (_label(row), _shape(row["out_shape"]), *(_count(row[key]) for key in COUNTS))
        for row in module_costs(G, depth)
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines, strict=True)]
    rule = "  ".join("-" * w for w in widths)

    def line(cells: Iterable[str]) -> str:
        cells = list(cells)
        text = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        text += [cell.rjust(width) for cell, width in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(text).rstrip()

    totals = cost_summary(G)
    return "\n".join([
        line(header), rule, *map(line, lines), rule,
        f"Total parameters: {_count(totals['params'])} (trainable "
        f"{_count(totals['trainable_params'])}, frozen {_count(totals['frozen_params'])})",
        f"Total FLOPs: {_count(totals['flops'])}{_scaled(totals['flops'])} "
        f"({_count(totals['forward_flops'])} forward, {_count(totals['backward_flops'])} backward)",
        f"Total MACs: {_count(totals['macs'])}{_scaled(totals['macs'])}",
    ])


def to_frames(G: nx.MultiDiGraph) -> tuple[Any, Any]:
    """The nodes and the edges of ``G`` as two pandas DataFrames.

    One row per node, indexed by node name (in ``G``'s order, which is fx order), and
    one per edge with ``source``, ``target`` and ``key`` columns; one column per
    attribute, the contract's first, in its order, then the user's own. Values are the
    attributes as they are: shapes stay tuples, ``node_call_info`` a dict; a missing
    attribute is None (NA in a column of numbers). Counts are integer columns
    (pandas' ``Int64`` where some are None).

    Raises
    ------
    PandasNotFoundError
        pandas is not installed (``pip install fxnx[frames]``).

    Examples
    --------
    >>> import torch, fxnx
    >>> G = fxnx.convert(torch.nn.Linear(3, 2), torch.zeros(5, 3))
    >>> nodes, edges = to_frames(G)
    >>> nodes.at["linear", "out_shape"], nodes["flops"].tolist()
    ((5, 2), [0, 0, 0, 60, 0])
    >>> edges[["source", "target", "shape"]].values.tolist()[-2:]
    [['bias', 'linear', (2,)], ['linear', 'output', (5, 2)]]
    """
    try:
        import pandas as pd
    except ImportError as err:
        raise PandasNotFoundError(
            "fxnx.frames.to_frames needs pandas, which is not installed: pip install fxnx[frames]"
        ) from err
    node_data = [data for _, data in G.nodes(data=True)]
    nodes = pd.DataFrame(
        {c: _column(pd, [d.get(c) for d in node_data], _KINDS["node"].get(c))
         for c in _columns(node_data, NODE_ATTRIBUTES)},
        index=pd.Index(list(G.nodes), name="node"),
    )
    edge_list = list(G.edges(keys=True, data=True))
    edge_data = [data for *_, data in edge_list]
    edges = pd.DataFrame({
        "source": _column(pd, [u for u, *_ in edge_list]),
        "target": _column(pd, [v for _, v, *_ in edge_list]),
        "key": _column(pd, [k for _, _, k, _ in edge_list]),
        **{c: _column(pd, [d.get(c) for d in edge_data], _KINDS["edge"].get(c))
           for c in _columns(edge_data, EDGE_ATTRIBUTES)},
    })
    return nodes, edges


# --- helpers ------------------------------------------------------------------------------------


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _ancestors(path: str) -> list[str]:
    """``path`` and every module around it, the model ("") last."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _home(data: dict[str, Any]) -> str:
    """The module a node belongs to: the one it calls, or the one whose forward called it."""
    return str(data.get("target")) if data.get("op") == "call_module" else str(data.get("scope", ""))


def _add(rows: dict[str, dict[str, Any]], path: str, key: str, value: int | None) -> None:
    for outer in _ancestors(path):
        row = rows.get(outer)
        if row is not None:
            row[key] = None if value is None or row[key] is None else row[key] + value


def _count_tied_once(G: nx.MultiDiGraph, rows: dict[str, dict[str, Any]], owners: dict[str, Any]) -> None:
    """A parameter two owners hold under two names (tied weights: an embedding and the output
    layer) counts once in each module around both (``G.graph["tied_parameters"]``)."""
    for alias, tied in G.graph.get("tied_parameters", {}).items():
        held = [next((p for p in _ancestors(name.rpartition(".")[0]) if p in owners), None)
                for name in (alias, tied["same_as"])]
        if None in held or held[0] == held[1]:
            continue  # one owner (a module kept whole) counted it once already
        shared = set(_ancestors(held[0])) & set(_ancestors(held[1]))  # type: ignore[arg-type]
        for path in shared:
            row = rows.get(path)
            if row is None:
                continue
            if row["params"] is not None:
                row["params"] -= tied["numel"]
            if tied["trainable"] and row["trainable_params"] is not None:
                row["trainable_params"] -= tied["numel"]


def _owners(G: nx.MultiDiGraph) -> dict[str, tuple[int, int | None]]:
    """Module path to the parameters it owns directly, counting each owning node once."""
    primals = G.graph.get("primals", {})
    owned: dict[tuple[str, str], tuple[str, int, int | None]] = {}
    for name, data in G.nodes(data=True):
        if not data.get("num_params"):
            continue
        counts = data["num_params"], data.get("trainable_params")
        if data["op"] == "call_module":
            owned["module", data["target"]] = (data["target"], *counts)
        elif data["op"] == "get_attr":
            owned["attr", data["target"]] = (data["target"].rpartition(".")[0], *counts)
        elif name in primals:
            owned["primal", name] = (primals[name]["name"].rpartition(".")[0], *counts)
    called = {target for kind, target in owned if kind == "module"}
    totals: dict[str, tuple[int, int | None]] = {}
    for (kind, _), (path, params, trainable) in owned.items():
        if kind != "module" and any(outer in called for outer in _ancestors(path)):
            continue  # a weight of a module the graph also calls (h @ emb.weight.T): counted there
        before = totals.get(path, (0, 0))
        totals[path] = (before[0] + params,
                        None if trainable is None or before[1] is None else before[1] + trainable)
    return totals


def _out_shapes(G: nx.MultiDiGraph) -> dict[str, Any]:
    """Module path to the shape of the last value (in fx order) that leaves it, forward."""
    homes = {name: _home(data) for name, data in G.nodes(data=True)}
    forward = {name for name, data in G.nodes(data=True)
               if data.get("phase", "forward") == "forward" or data.get("op") == "output"}
    last: dict[str, tuple[int, Any]] = {}
    for u, v in G.edges():
        if u not in forward or v not in forward:  # a value kept for the backward pass
            continue
        inside_v = set(_ancestors(homes[v]))
        order = G.nodes[u].get("order", 0)
        for path in _ancestors(homes[u]):
            if path not in inside_v and (path not in last or last[path][0] < order):
                last[path] = (order, G.nodes[u].get("out_shape"))
    return {path: shape for path, (_, shape) in last.items()}


def _model_output(G: nx.MultiDiGraph) -> Any:
    """The shape of the model's output: the output node's; for make_fx's graphs (which
    return a list, with the gradients in joint graphs) the forward values it returns."""
    for name, data in G.nodes(data=True):
        if data.get("op") != "output":
            continue
        if G.graph.get("capture") != "make_fx":
            return data.get("out_shape")
        shapes = [d.get("shape") for u, _, d in G.in_edges(name, data=True)
                  if G.nodes[u].get("phase", "forward") == "forward"]
        return shapes[0] if len(shapes) == 1 else shapes
    return None


def _label(row: dict[str, Any]) -> str:
    cls = (row["type"] or "").rpartition(".")[2]
    if row["module"] == "":
        return cls or "model"
    return "  " * row["depth"] + f"{row['module'].rpartition('.')[2]} ({cls})"


def _shape(shape: Any) -> str:
    if shape is None:
        return "-"
    return str(shape) if not isinstance(shape, (list, dict)) else str(shape).replace("'", "")


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _scaled(value: int | None) -> str:
    """`` (1.82 G)`` for big counts: the unit torchinfo and papers use."""
    if value is None or value < 10**6:
        return ""
    for unit, size in (("T", 10**12), ("G", 10**9), ("M", 10**6)):
        if value >= size:
            return f" ({value / size:.2f} {unit})"
    return ""  # pragma: no cover


def _columns(data: list[dict[str, Any]], contract: tuple[Any, ...]) -> list[str]:
    """The contract's attributes present in ``data`` in its order, then the user's own."""
    present: dict[str, None] = {}
    for d in data:
        present.update(dict.fromkeys(d))
    known = [a.name for a in contract if a.name in present]
    return known + [name for name in present if name not in set(known)]


def _column(pd: Any, values: list[Any], kind: str | None = None) -> Any:
    """A column of ``values`` kept as they are; counts as integers (``Int64`` where some are
    None). ``kind`` is the attribute's type in the contract; a user's attribute has none."""
    kinds = {type(v) for v in values} - {type(None)}
    if kind in _INTEGERS or (kind is None and kinds == {int}):
        if kinds <= {int}:
            return pd.array(values, dtype="Int64" if None in values or not values else "int64")
    if kind == "float or None" or (kind is None and kinds == {float}):
        if kinds <= {float}:
            return pd.array([float("nan") if v is None else v for v in values], dtype="float64")
    if kinds == {bool} and None not in values:
        return pd.array(values, dtype="bool")
    return pd.array(values, dtype=object)


#: Contract types whose columns are integers.
_INTEGERS = frozenset({"int", "int >= 0", "int >= 0 or None"})
