"""Other tools read fxnx's graphs: torch_geometric's from_networkx, and GraphML readers.

torch_geometric is not installed here (and is no dependency), so its requirements are
restated as code: :func:`from_networkx_steps` does, on the graph's data, what
``torch_geometric.utils.from_networkx`` does before it builds a ``Data`` object. GraphML files
are checked with a plain XML parser against what the GraphML schema asks of typed keys, and
read back with networkx.
"""

from __future__ import annotations

import functools
import json
import xml.etree.ElementTree as ET
from collections import defaultdict

import networkx as nx
import pytest
import torch
from torch import nn

import fxnx

from zoo import CASES

# --- torch_geometric.utils.from_networkx, restated ---------------------------------------------
#
# Source: pyg-team/pytorch_geometric, torch_geometric/utils/convert.py, from_networkx, at
# commit c918f160a9f70ee3ad43468fdfc5548c6af8b73d; later releases keep every step below and
# differ in two: they skip the graph attributes "node_default" and "edge_default", and they
# convert with torch.as_tensor inside `except Exception` where that commit has torch.tensor
# inside `except (ValueError, TypeError)`. Requirements, step by step:
#
# 1. node_attrs = the keys of the FIRST node; every node must have exactly that set of keys,
#    else ValueError("Not all nodes contain the same attributes").
# 2. The same for edges: every edge must have the first edge's keys ("Not all edges ...").
# 3. Each node attribute becomes a list over the nodes (data[key]); each edge attribute one
#    over the edges, renamed "edge_<key>" where a node attribute has its name.
# 4. Each graph attribute goes in as it is (data[key] = value), renamed "graph_<key>" where a
#    node attribute has its name. A graph attribute named like an edge attribute (but no node
#    attribute) REPLACES that edge attribute's list: silently lost data.
# 5. For every collected value: `if isinstance(value, (tuple, list)) and isinstance(value[0],
#    Tensor)` -- outside any try, so an EMPTY list or tuple (a graph attribute such as
#    opaque_modules=[]) raises IndexError and the conversion fails.
# 6. Otherwise torch.tensor(value) is tried and the value kept as it is if that raises one of
#    the caught exceptions. Under torch 2.x, torch.tensor raises RuntimeError for a dict, for
#    None, and for a list holding either ("Could not infer dtype of dict"); ValueError or
#    TypeError for strings and ragged lists. So with the commit above (which does not catch
#    RuntimeError) any dict-valued attribute (node_call_info on every node) fails; with later
#    releases (RuntimeError caught, then every Exception) nothing fxnx writes does. The
#    restatement below catches (ValueError, TypeError, RuntimeError): the narrowest handler
#    fxnx's graphs can meet.
# 7. Data.from_dict(data): every key becomes a Data attribute; x, edge_index, edge_attr, y,
#    pos, time, batch, ptr, face and num_nodes mean something to torch_geometric.

_CAUGHT = (ValueError, TypeError, RuntimeError)
_MEANINGFUL = {"x", "edge_index", "edge_attr", "y", "pos", "time", "batch", "ptr", "face", "num_nodes"}


def from_networkx_steps(G: nx.Graph) -> dict:
    """What torch_geometric's from_networkx does to ``G``'s data, raising where it raises."""
    data: dict = defaultdict(list)
    node_attrs = list(next(iter(G.nodes(data=True)))[-1]) if G.number_of_nodes() else []
    edge_attrs = list(next(iter(G.edges(data=True)))[-1]) if G.number_of_edges() else []
    for _, features in G.nodes(data=True):
        if set(features) != set(node_attrs):
            raise ValueError("Not all nodes contain the same attributes")
        for key, value in features.items():
            data[str(key)].append(value)
    for _, _, features in G.edges(data=True):
        if set(features) != set(edge_attrs):
            raise ValueError("Not all edges contain the same attributes")
        for key, value in features.items():
            data[f"edge_{key}" if key in node_attrs else str(key)].append(value)
    for key, value in G.graph.items():
        name = f"graph_{key}" if key in node_attrs else str(key)
        if name in data:  # fxnx's own check: from_networkx would drop the list silently
            raise KeyError(f"graph attribute {key!r} would replace the attribute {name!r}")
        data[name] = value
    for key, value in data.items():
        if isinstance(value, (tuple, list)) and isinstance(value[0], torch.Tensor):  # IndexError
            data[key] = torch.stack(value, dim=0)
        else:
            try:
                data[key] = torch.tensor(value)
            except _CAUGHT:
                pass
    clash = _MEANINGFUL & set(data)
    if clash:
        raise KeyError(f"attributes {sorted(clash)} mean something else to torch_geometric")
    return dict(data)


def test_the_restatement_fails_where_from_networkx_fails():
    G = nx.MultiDiGraph(note="kept", sizes=[1, 2])
    G.add_edge("a", "b", w=1.0)
    data = from_networkx_steps(G)
    assert data["note"] == "kept" and torch.equal(data["sizes"], torch.tensor([1, 2]))
    G.add_node("c", role="skip")
    with pytest.raises(ValueError, match="Not all nodes contain the same attributes"):
        from_networkx_steps(G)
    H = nx.MultiDiGraph(modules=[])
    H.add_edge("a", "b")
    with pytest.raises(IndexError):
        from_networkx_steps(H)
    H = nx.MultiDiGraph()
    H.add_edge("a", "b", w=1.0)
    H.add_edge("b", "c")
    with pytest.raises(ValueError, match="Not all edges contain the same attributes"):
        from_networkx_steps(H)
    H = nx.MultiDiGraph(w=3)
    H.add_edge("a", "b", w=1.0)
    with pytest.raises(KeyError, match="would replace"):
        from_networkx_steps(H)


GRAPHS = ["skip_block", "nested_skip", "tuple_output", "cat_chunk", "mul_self", "small_cnn_joint",
          "small_cnn_credit"]


@functools.cache
def _graph(name: str) -> nx.MultiDiGraph:
    """fxnx graphs as users make them: converted, with skip connections found, credit routed
    (tests change copies only)."""
    if name in CASES:
        case = CASES[name]
        G = fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())
        fxnx.skip_connections(G)
        return G
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    x = torch.randn(2, 3, 8, 8)
    if name == "small_cnn_joint":
        G = fxnx.convert(model, x, level="joint")
        fxnx.skip_connections(G)
    else:
        G = fxnx.convert(model, x)
        fxnx.route_credit(G, model, x)
    return G


@pytest.mark.parametrize("name", GRAPHS)
def test_torch_geometric_from_networkx_accepts_fxnx_graphs(name):
    G = _graph(name)
    data = from_networkx_steps(G)
    assert len(data["order"]) == G.number_of_nodes()
    assert len(data["nbytes"]) == G.number_of_edges()


# --- GraphML -------------------------------------------------------------------------------------

_NS = {"g": "http://graphml.graphdrawing.org/xmlns"}

#: GraphML's attr.type values and what their text must parse as (GraphML 1.0 schema; XML
#: Schema's lexical forms: booleans are true/false/1/0).
_PARSE = {
    "boolean": lambda t: {"true": True, "false": False, "1": True, "0": False}[t.strip().lower()],
    "int": int, "long": int, "float": float, "double": float, "string": str,
}


def _keys_and_values(path):
    """Each <key> as (for, attr.name) -> attr.type, and every <data> text with its key."""
    root = ET.parse(path).getroot()
    keys, ids = {}, {}
    for key in root.findall("g:key", _NS):
        where = (key.get("for"), key.get("attr.name"))
        assert where not in keys, f"{where} is declared twice: {keys[where]} and {key.get('attr.type')}"
        keys[where] = key.get("attr.type")
        ids[key.get("id")] = (where, key.get("attr.type"))
    values = [(ids[d.get("key")], d.text or "") for d in root.iter(f"{{{_NS['g']}}}data")]
    return keys, values


def parse_shape(text: str, rank: int | None = None):
    """A shape as write_graphml's docstring spells it: sizes joined by "x", "" for 0-d, several
    outputs joined by "; " ("?" for one not a tensor, "key: shape" in a dict); JSON text where
    that spelling would be ambiguous."""
    if text.startswith(("[", "{", '"')):
        return _tuples(json.loads(text))

    def one(part):
        if part == "?":
            return None
        return tuple(int(d) if d.isdigit() else d for d in part.split("x")) if part else ()

    if rank is not None:
        return one(text)
    parts = text.split("; ")
    if all(": " in p for p in parts):
        return {k: one(v) for k, v in (p.split(": ", 1) for p in parts)}
    return [one(p) for p in parts]


def _tuples(value):  # JSON has no tuples: a shape is a list of sizes
    if isinstance(value, list) and all(isinstance(d, (int, str)) for d in value):
        return tuple(value)
    if isinstance(value, list):
        return [_tuples(v) for v in value]
    return {k: _tuples(v) for k, v in value.items()} if isinstance(value, dict) else value


def _write(G, tmp_path):
    path = tmp_path / "g.graphml"
    fxnx.write_graphml(G, path)
    return path


@pytest.mark.parametrize("name", GRAPHS)
def test_graphml_declares_each_attribute_once_and_every_value_parses_as_its_type(name, tmp_path):
    keys, values = _keys_and_values(_write(_graph(name), tmp_path))
    assert ("node", "out_shape") in keys and ("edge", "nbytes") in keys
    for (where, declared), text in values:
        try:
            _PARSE[declared](text)
        except (KeyError, ValueError) as err:
            raise AssertionError(f"{where} declared {declared} holds {text!r}") from err
    assert keys[("node", "order")] == "long" and keys[("node", "opaque")] == "boolean"
    assert keys[("node", "out_rank")] == "long" and keys[("edge", "rank")] == "long"


@pytest.mark.parametrize("name", GRAPHS)
def test_graphml_shapes_read_back_as_the_graph_s_shapes(name, tmp_path):
    G = _graph(name)
    H = nx.read_graphml(_write(G, tmp_path), force_multigraph=True)
    for node, data in G.nodes(data=True):
        written = H.nodes[node]
        if data["out_shape"] is None:
            assert "out_shape" not in written and "out_rank" not in written
            continue
        assert parse_shape(written["out_shape"], written.get("out_rank")) == data["out_shape"], node
        if isinstance(data["out_shape"], tuple):
            assert written["out_rank"] == len(data["out_shape"])
        dtype = data["out_dtype"]
        assert written["out_dtype"] == (dtype if isinstance(dtype, str) else "; ".join(dtype))
    for u, v, k, data in G.edges(keys=True, data=True):
        written = H.edges[u, v, k]
        if data["shape"] is not None:
            assert parse_shape(written["shape"], written.get("rank")) == data["shape"]
        assert written.get("nbytes") == data["nbytes"]


def test_graphml_resnet18_is_readable_by_other_tools(torchvision_model, tmp_path):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 32, 32))
    fxnx.skip_connections(G)
    H = nx.read_graphml(_write(G, tmp_path), force_multigraph=True)
    assert H.nodes["conv1"]["out_shape"] == "1x64x16x16" and H.nodes["conv1"]["out_rank"] == 4
    assert H.edges["maxpool", "add", 0]["shape"] == "1x64x8x8"
    assert json.loads(H.nodes["flatten"]["node_call_info"]) == G.nodes["flatten"]["node_call_info"]
    assert json.loads(H.graph["skip_connections"])[0]["merge"] == "add"


def test_graphml_gives_an_attribute_of_mixed_types_one_type(tmp_path):
    G = _graph("skip_block").copy()
    G.nodes["lin"]["tag"], G.nodes["relu"]["tag"] = 3, "three"
    G.nodes["lin"]["weight"], G.nodes["relu"]["weight"] = 2, 0.5
    G.nodes["lin"]["flag"], G.nodes["relu"]["flag"] = True, 1
    G.nodes["lin"]["big"] = 2**70
    keys, _ = _keys_and_values(_write(G, tmp_path))
    assert keys[("node", "tag")] == "string" and keys[("node", "weight")] == "double"
    assert keys[("node", "flag")] == "string" and keys[("node", "big")] == "string"
    H = nx.read_graphml(tmp_path / "g.graphml")
    assert (H.nodes["lin"]["tag"], H.nodes["relu"]["tag"]) == ("3", "three")
    assert (H.nodes["lin"]["weight"], H.nodes["relu"]["weight"]) == (2.0, 0.5)
    assert (H.nodes["lin"]["flag"], H.nodes["relu"]["flag"]) == ("true", "1")
    assert H.nodes["lin"]["big"] == str(2**70)


def test_graphml_spells_ambiguous_shapes_as_json(tmp_path):
    G = _graph("skip_block").copy()
    G.nodes["lin"]["out_shape"] = ("max(s0, s1)", 4)  # a symbolic size holding "x"
    G.nodes["relu"]["out_shape"] = [(2, 4), [(1,), (2,)]]  # nested outputs
    G.nodes["add"]["out_shape"] = ("u0", 4)
    H = nx.read_graphml(_write(G, tmp_path))
    assert H.nodes["lin"]["out_shape"] == '["max(s0, s1)", 4]'
    assert parse_shape(H.nodes["lin"]["out_shape"], H.nodes["lin"].get("out_rank")) == ("max(s0, s1)", 4)
    assert parse_shape(H.nodes["relu"]["out_shape"]) == [(2, 4), [(1,), (2,)]]
    assert (H.nodes["add"]["out_shape"], H.nodes["add"]["out_rank"]) == ("u0x4", 2)


def test_graphml_refuses_a_shape_text_xml_cannot_hold_and_writes_nothing(tmp_path):
    G = _graph("skip_block").copy()
    G.nodes["lin"]["out_shape"] = ("u\x1b0", 4)
    with pytest.raises(fxnx.errors.GraphContractError, match=r"node 'lin' attribute 'out_shape' holds U\+001B"):
        fxnx.write_graphml(G, tmp_path / "g.graphml")
    assert list(tmp_path.iterdir()) == []


def test_a_graph_read_back_by_networkx_alone_gets_the_contracts_error(tmp_path):
    """A graph through ``nx.node_link_data`` and JSON, or fxnx's GraphML read by
    ``nx.read_graphml``, has lists or strings where fxnx keeps tuples: ``summary`` and
    ``memory_profile`` failed with ``TypeError: 'int' object is not iterable``, ``cost_table``
    on the GraphML one with an ``AttributeError``, none saying what was wrong. They raise the contract's error
    now, naming the attribute and what to do."""
    import json

    G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.randn(2, 4))
    data = json.loads(json.dumps(nx.node_link_data(G, edges="links")))
    linked = nx.node_link_graph(data, edges="links", multigraph=True, directed=True)
    fxnx.write_graphml(G, tmp_path / "g.graphml")
    read = nx.read_graphml(tmp_path / "g.graphml", force_multigraph=True)
    for H, analyses in ((linked, (fxnx.summary, fxnx.memory_profile)),
                        (read, (fxnx.summary, fxnx.memory_profile, fxnx.frames.cost_table))):
        for analysis in analyses:
            with pytest.raises(fxnx.errors.GraphContractError, match=r"cannot read G.*'inputs' must be a list.*fxnx.read_json"):
                analysis(H)
