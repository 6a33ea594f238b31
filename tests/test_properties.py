"""Property-based tests (hypothesis) where they pay most: the pickle reader, the contract, and
file round trips (issue 26, item 5).

The oracles: the reader's promise (every input is a graph or one ``GraphFileError``, never
another exception, never a run of anything), ``validate``'s promise (a graph is accepted or
refused with one ``GraphContractError``), and equality of a graph with itself read back.
"""

from __future__ import annotations

import pickle
import pickletools

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fxnx
from fxnx import _safepickle
from fxnx.errors import GraphContractError, GraphFileError

from conftest import assert_graphs_equal

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _small_graph() -> nx.MultiDiGraph:
    return fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()),
                        torch.zeros(1, 3))


GRAPH = _small_graph()
PICKLED = pickle.dumps(GRAPH, protocol=4)


def _load(data: bytes):
    """The reader on bytes: a graph, or one GraphFileError; anything else fails the test."""
    try:
        return _safepickle.load(data, "f.pkl")
    except GraphFileError:
        return None


# --- the pickle reader: nothing escapes but GraphFileError -----------------------------------------


@SETTINGS
@given(st.binary(max_size=400))
def test_any_bytes_are_a_graph_or_a_graph_file_error(data):
    _load(data)


@SETTINGS
@given(st.binary(max_size=200).map(lambda b: b"\x80\x04" + b))
def test_any_protocol_4_body_is_a_graph_or_a_graph_file_error(data):
    _load(data)


@SETTINGS
@given(st.data())
def test_a_real_file_mutated_anywhere_is_a_graph_or_a_graph_file_error(data):
    raw = bytearray(PICKLED)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    G = _load(bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw))
    if G is not None:  # what a mutated file may become is still a plain-data MultiDiGraph
        assert type(G) is nx.MultiDiGraph


#: Plain values the contract allows in attributes: what fxnx's own writer pickles.
PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)

#: Values no graph file may hold: each must be refused before anything runs.
UNSAFE = st.sampled_from([
    set(), frozenset({1}), b"bytes", bytearray(b"x"), complex(1, 2), slice(1, 2), range(3),
    pickletools, print, object(), type,
])


@SETTINGS
@given(PLAIN)
def test_plain_graph_attributes_round_trip_through_the_reader(value):
    G = nx.MultiDiGraph(value=value)  # built without touching G.nodes, which caches a view
    G.add_node("a", value=value)
    G.add_edge("a", "b")
    H = _safepickle.load(pickle.dumps(G, protocol=4), "f.pkl")
    assert H.graph["value"] == value and H.nodes["a"]["value"] == value
    assert list(H.edges(keys=True)) == [("a", "b", 0)]


@SETTINGS
@given(PLAIN, UNSAFE)
def test_anything_but_plain_data_is_refused_and_nothing_runs(value, unsafe):
    G = nx.MultiDiGraph([("a", "b")], value=[value, unsafe])
    try:
        data = pickle.dumps(G, protocol=4)
    except (TypeError, pickle.PicklingError, AttributeError):
        assume(False)  # pickle itself refuses some (a bare object() of a local kind)
    with pytest.raises(GraphFileError):
        _safepickle.load(data, "f.pkl")


# --- the contract: accepted, or one GraphContractError ---------------------------------------------


ATTRIBUTES = {a.name: a for a in fxnx.contract.NODE_ATTRIBUTES}


@SETTINGS
@given(st.sampled_from(sorted(ATTRIBUTES)), PLAIN | UNSAFE)
def test_validate_accepts_or_refuses_any_node_attribute_value(name, value):
    G = GRAPH.copy()
    G.nodes["output"][name] = value
    try:
        fxnx.validate(G)
    except GraphContractError as err:
        assert repr(name) in str(err) or "output" in str(err)


@SETTINGS
@given(st.text(min_size=1, max_size=12), PLAIN)
def test_validate_accepts_any_plain_user_attribute(name, value):
    assume(name not in ATTRIBUTES and not any(0xD800 <= ord(c) <= 0xDFFF for c in name))
    G = GRAPH.copy()
    G.nodes["output"][name] = value
    fxnx.validate(G)  # a user's own plain attribute is always allowed


# --- round trips through every file format ---------------------------------------------------------


@SETTINGS
@given(st.text(max_size=12), PLAIN)
def test_user_attributes_round_trip_through_pickle_and_json(tmp_path_factory, name, value):
    assume(name not in ATTRIBUTES and name not in ("id", "source", "target", "key", "nodes",
                                                   "edges", "links", "graph", "directed",
                                                   "multigraph"))
    G = GRAPH.copy()
    G.nodes["output"][name] = value
    try:
        fxnx.validate(G)
    except GraphContractError:
        assume(False)  # a lone surrogate is not text: validate refuses it, as it should
    path = tmp_path_factory.mktemp("rt")
    fxnx.write_pickle(G, path / "g.pkl")
    assert fxnx.read_pickle(path / "g.pkl").nodes["output"][name] == value
    try:
        fxnx.write_json(G, path / "g.json")
    except fxnx.errors.FxnxValueError:
        return  # JSON refuses what it cannot hold (NaN, clashing names) with one error
    # fxnx's JSON keeps tuples apart from lists: the value comes back equal, tuples as tuples
    assert fxnx.read_json(path / "g.json").nodes["output"][name] == value


# --- collapsing modules for a drawing ----------------------------------------------------------------

SCOPES = ["", "a", "a.b", "a.b.c", "a.d", "e", "e.f", "e.f.g"]


@st.composite
def scoped_dags(draw):
    """A random DAG of ``call_function`` nodes, each in a module scope, between an input and an
    output: what collapse sees of a traced model."""
    n = draw(st.integers(1, 14))
    names = ["x", *(f"n{i}" for i in range(n)), "output"]
    G = nx.MultiDiGraph()
    for i, name in enumerate(names):
        op = "placeholder" if name == "x" else "output" if name == "output" else "call_function"
        scope = "" if op != "call_function" else draw(st.sampled_from(SCOPES))
        G.add_node(name, op=op, target=name, scope=scope, order=i)
    for j in range(1, len(names)):  # every node reads an earlier one; some read more
        for i in draw(st.sets(st.integers(0, j - 1), min_size=1, max_size=3)):
            G.add_edge(names[i], names[j], arg=0, shape=[1, 2])
    return G


@SETTINGS
@given(scoped_dags(), st.integers(1, 3))
def test_collapse_keeps_every_node_and_edge_and_makes_no_cycle(G, depth):
    import copy

    from fxnx._drawing.view import collapse, collapsed_size

    before = copy.deepcopy(G)
    H = collapse(G, depth, skips=False)
    assert_graphs_equal(G, before)  # the caller's graph is untouched
    assert nx.is_directed_acyclic_graph(H)

    def home(node):  # where a node of G is drawn: itself, or the module at depth holding it
        if node in H:
            return node
        return ".".join(G.nodes[node]["scope"].split(".")[:depth])

    assert all(home(n) in H for n in G)
    drawn = sum(d["members"] if d["op"] == "module" else 1 for _, d in H.nodes(data=True))
    assert drawn == G.number_of_nodes()  # each node of G drawn once, alone or in its module
    edges = {(home(u), home(v)) for u, v in G.edges() if home(u) != home(v)}
    assert set(H.edges()) == edges  # no edge lost, none made up
    assert collapsed_size(G, depth) <= H.number_of_nodes()
