"""The graph contract: every graph convert makes satisfies it; each broken graph is named."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import networkx as nx
import pytest
import torch

import fxnx
import fxnx._errors
from fxnx._contract import PRESENCE

from zoo import CASES

# (level, routes) pairs convert supports; the zoo runs through each.
CAPTURES = {
    "module": {},
    "aten": {"level": "aten"},
    "joint": {"level": "joint"},
    "export": {"routes": "export"},
    "draft_export": {"routes": "draft_export"},
}


def _convert(case, **options):
    try:
        return fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs(), **options)
    except (fxnx.errors.CaptureError, fxnx.errors.FxnxValueError) as err:  # e.g. joint on an int output
        pytest.skip(f"convert refuses this case: {fxnx._errors.first_line(err)}")


def _all_forms(G):
    """G, and G after pickle and JSON-like round trips (plain pickle keeps every type)."""
    yield G
    yield pickle.loads(pickle.dumps(G))


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("name", CASES)
def test_every_zoo_graph_satisfies_the_contract(name, capture):
    G = _convert(CASES[name], **CAPTURES[capture])
    fxnx.validate(G)
    fxnx.skip_connections(G)
    for H in _all_forms(G):
        fxnx.validate(H)


@pytest.mark.parametrize("name", CASES)
def test_graphs_without_example_inputs_satisfy_the_contract(name):
    case = CASES[name]
    if case.kwargs():
        pytest.skip("keyword inputs need example values")
    fxnx.validate(fxnx.convert(case.build()))


@pytest.mark.parametrize("model", ["resnet18", "densenet121"])
def test_torchvision_graphs_with_annotations_satisfy_the_contract(model, torchvision_model):
    net = torchvision_model(model)
    x = torch.randn(1, 3, 64, 64)
    G = fxnx.convert(net, x)
    fxnx.skip_connections(G, "all")  # DenseNet's are all parallel: none by default
    fxnx.route_credit(G, net, x)
    assert "credit_rule" in G.graph and G.graph["skip_connections"]
    fxnx.validate(G)
    for options in ({"level": "aten"}, {"level": "joint"}, {"routes": "export"}):
        H = fxnx.convert(net, x, **options)
        fxnx.skip_connections(H, "all")
        fxnx.validate(H)


def _graph():
    G = fxnx.convert(CASES["skip_block"].build(), torch.randn(2, 4))
    fxnx.skip_connections(G)
    return G


def _broken(edit):
    G = _graph()
    edit(G)
    return G


def _set_node(name, attr, value):
    return lambda G: G.nodes[name].__setitem__(attr, value)


def _set_edge(attr, value):
    return lambda G: G.edges["x", "add", 0].__setitem__(attr, value)


def _nested(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def _set_graph(attr, value):
    return lambda G: G.graph.__setitem__(attr, value)


BROKEN = {
    "str num_params": (_set_node("lin", "num_params", "20"),
                       r"node 'lin' attribute 'num_params' must be an int >= 0, got str '20'"),
    "bool num_params": (_set_node("lin", "num_params", True), r"'num_params' must be an int >= 0, got bool"),
    "negative order": (_set_node("lin", "order", -1), r"'order' must be an int >= 0, got int -1"),
    "unknown op": (_set_node("lin", "op", "call_magic"), r"'op' must be one of 'placeholder'.*got str 'call_magic'"),
    "float in shape": (_set_node("lin", "out_shape", (2, 4.0)), r"'out_shape' must be a shape.*got tuple \(2, 4.0\)"),
    "int in shape list": (_set_node("lin", "out_shape", [(2, 4), 3]), r"'out_shape' must be a shape.*int 3 at \[1\]"),
    "list shape leaf": (_set_node("lin", "out_shape", [[2, 4]]), r"'out_shape' must be a shape.*got int 2 at \[0\]\[0\]"),
    "int dtype": (_set_edge("dtype", 32), r"edge 'x' -> 'add' \(key 0\) attribute 'dtype' must be a dtype"),
    "negative nbytes": (_set_edge("nbytes", -8), r"'nbytes' must be an int >= 0 or None, got int -8"),
    "float arg": (_set_edge("arg", 1.5), r"'arg' must be an int >= 0 or str, got float 1.5"),
    "unknown phase": (_set_node("lin", "phase", "sideways"), r"'phase' must be one of 'forward', 'backward'"),
    "unknown level": (_set_graph("level", "molecule"), r"G.graph attribute 'level' must be one of"),
    "unknown branch role": (_set_node("lin", "branch_role", "bridge"), r"'branch_role' must be one of 'fork'"),
    "int credit_norm": (_set_node("lin", "credit_norm", 1), r"'credit_norm' must be a float or None, got int 1"),
    "inputs missing dtype": (_set_graph("inputs", [{"name": "x", "shape": (2, 4)}]),
                             r"'inputs' must be a list of \{name, shape, dtype\} dicts.*at \[0\]"),
    "skip entry not a list": (_set_graph("skip_connections", {"merge": "add"}),
                              r"'skip_connections' must be a list of \{merge, fork, skip, residual, kind\}"),
    "missing node attribute": (lambda G: G.nodes["lin"].pop("scope"),
                               r"node 'lin' lacks attribute 'scope' \(always present"),
    "missing graph attribute": (lambda G: G.graph.pop("model"), r"G.graph lacks attribute 'model'"),
    "make_fx without primals": (_set_graph("capture", "make_fx"),
                                r"G.graph lacks attribute 'primals' \(when capture is make_fx"),
    "set attribute": (_set_node("lin", "mine", {1, 2}), r"node 'lin' attribute 'mine': builtins.set .*not plain data"),
    "tensor attribute": (_set_graph("mine", torch.zeros(1)), r"attribute 'mine': torch.Tensor is not plain data"),
    "complex in a list": (_set_edge("mine", [1, 2j]), r"'mine': builtins.complex at \[1\] is not plain data"),
    "slice": (_set_node("lin", "mine", slice(2)), r"builtins.slice is not plain data"),
    "bytes": (_set_node("lin", "mine", b"x"), r"builtins.bytes is not plain data"),
    "int dict key": (_set_node("lin", "mine", {"a": {1: 2}}), r"dict key int 1 at \['a'\]: keys must be str"),
    "too deep": (_set_node("lin", "mine", _nested(40)),
                 r"nesting deeper than 32"),
    "int node name": (lambda G: G.add_node(7, **G.nodes["lin"]), r"node int 7: node names must be str"),
    "str edge key": (lambda G: G.add_edge("x", "lin", key="k", **G.edges["x", "lin", 0]),
                     r"edge 'x' -> 'lin' key str 'k': edge keys must be int"),
    "cycle": (lambda G: G.add_edge("add", "lin", **G.edges["x", "lin", 0]),
              r"G has a cycle \('lin' -> 'relu' -> 'add' -> 'lin'\)"),
    "list as G.graph": (lambda G: setattr(G, "graph", [1, 2]), r"G.graph must be a dict of graph attributes, got list"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_graph_names_what_is_wrong(case):
    edit, message = BROKEN[case]
    G = _broken(edit)
    with pytest.raises(fxnx.errors.GraphContractError, match=message):
        fxnx.validate(G)


def test_empty_and_non_multidigraph_graphs_are_refused():
    with pytest.raises(fxnx.errors.GraphContractError, match="G has no nodes"):
        fxnx.validate(nx.MultiDiGraph(**_graph().graph))
    with pytest.raises(fxnx.errors.GraphContractError, match="must be a networkx.MultiDiGraph, got DiGraph"):
        fxnx.validate(nx.DiGraph(_graph()))
    with pytest.raises(fxnx.errors.GraphContractError, match="must be a networkx.MultiDiGraph, got dict"):
        fxnx.validate({})


@pytest.mark.parametrize(
    ("version", "message"),
    [("2", "must be an int .*got str '2'"), (2.0, "got float 2.0"), (99.5, "got float 99.5"),
     (True, "got bool True"), (-1, "got int -1"), (None, "got NoneType"),
     (fxnx.contract.FORMAT_VERSION + 1, r"newer than the 4 this fxnx knows: upgrade fxnx \(pip install -U fxnx\)")],
)
def test_format_version_must_be_an_int_this_fxnx_knows(version, message):
    G = _broken(_set_graph("format_version", version))
    with pytest.raises(fxnx.errors.GraphContractError, match=message):
        fxnx.validate(G)


def test_users_own_plain_attributes_are_accepted():
    G = _graph()
    G.graph["note"] = {"runs": [1, 2.5, None, True, ("a", "b")], "by": "me"}
    G.nodes["lin"]["tag"] = "hot"
    G.edges["x", "add", 0]["weight"] = 0.5
    fxnx.validate(G)
    fxnx.validate(copy.deepcopy(G))


def test_validate_leaves_the_graph_unchanged():
    G = _graph()
    before = copy.deepcopy((G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))))
    fxnx.validate(G)
    assert (G.graph, list(G.nodes(data=True)), list(G.edges(keys=True, data=True))) == before


# --- docs/graph.md is the same contract -------------------------------------------------------

DOC = Path(__file__).resolve().parent.parent / "docs" / "graph.md"


def _doc_tables() -> dict[str, set[tuple[str, str, str]]]:
    tables: dict[str, set[tuple[str, str, str]]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"## (Graph|Node|Edge) attributes", line)
        if heading:
            current = heading.group(1).lower()
            tables[current] = set()
        elif line.startswith("## "):
            current = None
        elif current and line.startswith("| `"):
            name, kind, present, _ = (cell.strip() for cell in line.strip("|").split("|", 3))
            tables[current].add((name.strip("`"), kind, present))
    return tables


def test_docs_list_every_attribute_of_the_contract_and_no_other():
    code = {
        where: {(a.name, a.kind, PRESENCE[a.present]) for a in table}
        for where, table in (("graph", fxnx.contract.GRAPH_ATTRIBUTES), ("node", fxnx.contract.NODE_ATTRIBUTES),
                             ("edge", fxnx.contract.EDGE_ATTRIBUTES))
    }
    assert _doc_tables() == code
    # Every attribute a converted graph has is in the tables (the tables miss nothing convert writes).
    G = _graph()
    assert set(G.graph) <= {a.name for a in fxnx.contract.GRAPH_ATTRIBUTES}
    for _, data in G.nodes(data=True):
        assert set(data) <= {a.name for a in fxnx.contract.NODE_ATTRIBUTES}
    for *_, data in G.edges(data=True):
        assert set(data) <= {a.name for a in fxnx.contract.EDGE_ATTRIBUTES}


def test_contract_module_needs_no_torch():
    from blocktorch import run_without_torch

    done = run_without_torch(
        """
        import sys, networkx as nx, fxnx
        from fxnx import _contract as contract
        assert "torch" not in sys.modules
        try:
            contract.validate(nx.MultiDiGraph())
        except fxnx.errors.GraphContractError as err:
            print(err)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "has no 'format_version'" in done.stdout


def test_a_format_1_graph_without_capture_options_is_read_and_routed(tmp_path):
    """Graphs written before format 2 lack capture_options: they load, and credit is still exact."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    G = fxnx.convert(model, x)
    del G.graph["capture_options"]
    G.graph["format_version"] = 1
    fxnx.write_pickle(G, tmp_path / "old.pkl")
    old = fxnx.read_pickle(tmp_path / "old.pkl")
    res = fxnx.route_credit(old, model, x)
    x_ = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(model(x_).sum(), x_)
    assert torch.allclose(res.node_credit["input_1"], expected, rtol=1e-12, atol=0)
    G.graph["format_version"] = 2  # from format 2 on, it must be there
    with pytest.raises(fxnx.errors.GraphContractError, match="lacks attribute 'capture_options'"):
        fxnx.validate(G)


@pytest.mark.parametrize("reader", ["node_link_graph", "graphml"])
def test_a_graph_read_back_by_another_reader_is_refused_naming_fxnxs(reader, tmp_path):
    """networkx's own ``node_link_graph`` leaves fxnx's JSON tuples encoded, and GraphML keeps
    structures as text: validating such a graph (as routing does) was refused naming the
    attribute alone ("'inputs' must be a list of {name, shape, dtype} dicts"). The refusal now
    names the reader and fxnx's own."""
    import json

    G = _graph()
    if reader == "node_link_graph":
        fxnx.write_json(G, tmp_path / "g.json")
        H = nx.node_link_graph(json.loads((tmp_path / "g.json").read_text()), edges="edges")
        match = r"read by networkx's own node_link_graph.*fxnx\.read_json"
    else:
        fxnx.write_graphml(G, tmp_path / "g.graphml")
        H = nx.read_graphml(tmp_path / "g.graphml", force_multigraph=True)
        match = r"as GraphML stores it.*fxnx\.read_json, fxnx\.read_pickle"
    with pytest.raises(fxnx.errors.GraphContractError, match=match):
        fxnx.validate(H)
    fxnx.validate(fxnx.read_json(tmp_path / "g.json") if reader == "node_link_graph" else G)
