"""Analyses and drawings in bounded time and size, whatever the graph (issue 23, items 6 to 8).

Whatever could run for minutes runs in a subprocess with a generous timeout, so a regression
fails the test instead of stopping the suite. This module imports no torch at the top: the
subprocesses import it to build their graphs.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

import fxnx
from fxnx import _analysis as analysis

from conftest import needs_dot

TESTS = Path(__file__).parent


def _within(seconds: float, code: str) -> str:
    """Run ``code`` in a fresh Python that imports this module; its output, or a failure if it
    takes longer than ``seconds``."""
    prelude = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom test_bounds import *\n"
    try:
        done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish within {seconds} s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# --- graphs built without torch -------------------------------------------------------------


def _add(G: nx.MultiDiGraph, node: str, op: str, target: str, scope: str = "") -> None:
    G.add_node(node, op=op, target=target, scope=scope, order=len(G))


def chain(n: int) -> nx.MultiDiGraph:
    """``x = x + relu_i(x)``, ``n`` times: n residual adds, each forking at the one before."""
    G = nx.MultiDiGraph()
    _add(G, "x", "placeholder", "x")
    prev = "x"
    for i in range(n):
        _add(G, f"relu_{i}", "call_function", "torch.relu")
        _add(G, f"add_{i}", "call_function", "operator.add")
        G.add_edges_from([(prev, f"relu_{i}"), (f"relu_{i}", f"add_{i}"), (prev, f"add_{i}")])
        prev = f"add_{i}"
    _add(G, "output", "output", "output")
    G.add_edge(prev, "output")
    return G


def hub(n: int) -> nx.MultiDiGraph:
    """``x + relu_i(x)`` for each of ``n`` blocks, all summed by one cat: every add forks at x."""
    G = nx.MultiDiGraph()
    _add(G, "x", "placeholder", "x")
    for i in range(n):
        _add(G, f"relu_{i}", "call_function", "torch.relu")
        _add(G, f"add_{i}", "call_function", "operator.add")
        G.add_edges_from([("x", f"relu_{i}"), (f"relu_{i}", f"add_{i}"), ("x", f"add_{i}")])
    _add(G, "output", "output", "output")
    G.add_edges_from((f"add_{i}", "output") for i in range(n))
    return G


def called_around(k: int, plain: int = 0) -> nx.MultiDiGraph:
    """``k`` modules, each with an op inside it before and after an op outside it (so that
    collapsing any one closes a cycle), then ``plain`` modules that collapse."""
    G = nx.MultiDiGraph()
    _add(G, "x", "placeholder", "x")
    path = ["x"]
    for i in range(k):
        _add(G, f"m{i}_a", "call_function", "torch.relu", f"m{i}.inner")
        _add(G, f"c{i}", "call_function", "torch.relu")
        _add(G, f"m{i}_b", "call_function", "torch.relu", f"m{i}")
        path += [f"m{i}_a", f"c{i}", f"m{i}_b"]
    for i in range(plain):
        _add(G, f"p{i}_a", "call_function", "torch.relu", f"p{i}")
        _add(G, f"p{i}_b", "call_function", "torch.relu", f"p{i}")
        path += [f"p{i}_a", f"p{i}_b"]
    _add(G, "output", "output", "output")
    nx.add_path(G, [*path, "output"])
    return G


def nested(depth: int, n: int) -> nx.MultiDiGraph:
    """A chain of ``n`` ops, the second half inside a module nested ``depth`` deep."""
    G = nx.MultiDiGraph()
    _add(G, "x", "placeholder", "x")
    scope = ".".join(["a"] * depth)
    for i in range(n):
        _add(G, f"n{i}", "call_function", "torch.relu", scope if i >= n // 2 else "")
    _add(G, "output", "output", "output")
    nx.add_path(G, list(G))
    return G


# --- skip connections: near-linear, and what the plain definition finds ------------------------


def test_a_10000_merge_chain_has_10000_skips_found_in_seconds():
    # Quadratic before: 4,000 merges took 40-54 s, 8,000 did not finish.
    out = _within(30, """
        skips = fxnx.skip_connections(chain(10_000), "all")  # relu learns nothing: parallel
        assert len(skips) == 10_000
        for i, s in enumerate(skips):  # by hand: add_i forks at add_(i-1), around relu_i
            assert (s.merge, s.fork, s.skip, s.residual, s.kind) == (
                f"add_{i}", f"add_{i - 1}" if i else "x", (), (f"relu_{i}",), "parallel")
        print(fxnx.summary(chain(10_000))["parallel_branches"])
    """)
    assert out.split() == ["10000"]


def test_10000_merges_forking_at_one_input_are_found_in_seconds():
    out = _within(30, """
        skips = fxnx.skip_connections(hub(10_000), "all")
        assert [(s.fork, s.skip, s.residual) for s in skips] == [
            ("x", (), (f"relu_{i}",)) for i in range(10_000)]
        print(len(skips))
    """)
    assert out.split() == ["10000"]


def _plain_skip_connections(G):
    """The definition as fxnx wrote it before issue 23, with whole ancestor and descendant
    sets per merge: the oracle on graphs small enough for it."""
    order = {n: i for i, n in enumerate(analysis.topological_order(G))}
    flow = analysis._data_flow(G)
    tensors = lambda m: {u for u in G.predecessors(m) if u in flow and analysis._carries_tensor(G, u)}  # noqa: E731
    merges = [n for n in order if (G.nodes[n].get("op"), G.nodes[n].get("target"))
              in analysis.MERGE_TARGETS and len(tensors(n)) >= 2]
    idom = nx.immediate_dominators(flow, analysis._ROOT) if merges else {}
    found = []
    for merge in merges:
        fork = idom[merge]
        inputs = sorted(tensors(merge), key=order.get)
        if fork == analysis._ROOT:
            fork = next((u for u in inputs if all(
                v == u or u in nx.ancestors(flow, v) for v in inputs)), analysis._ROOT)
            if fork == analysis._ROOT:
                continue
        below_fork = nx.descendants(flow, fork)
        branches = []
        for u in inputs:
            nodes = (nx.ancestors(flow, u) | {u}) & below_fork if u != fork else set()
            branches.append(tuple(sorted(nodes, key=order.get)))
        branches.sort(key=len)
        residual = sorted({n for b in branches[1:] for n in b}, key=order.get)
        found.append(analysis.SkipConnection(merge, fork, branches[0], tuple(residual),
                                             tuple(branches)))
    return found


def _structure(skips):
    """What the plain definition decides: everything but the kind."""
    return [(s.merge, s.fork, s.skip, s.residual, s.branches) for s in skips]


def _plain_roles(G, skips, kinds):
    """Each node's and edge's branch_role and branch_merge, innermost skip first, as annotated
    before issue 23: from every edge leaving the fork or a branch node. ``kinds``: each skip
    connection's kind, which names its branches' roles (``branch`` on a parallel one's)."""
    role, merge, edge_role, edge_merge = {}, {}, {}, {}
    kind_of = dict(zip((s.merge for s in skips), kinds, strict=True))
    for s in sorted(skips, key=lambda s: len(s.skip) + len(s.residual)):
        names = ("branch", "branch") if kind_of[s.merge] == "parallel" else ("skip", "residual")
        for kind, branch, shortest in zip(names, (s.skip, s.residual), (True, False), strict=True):
            for node in branch:
                role.setdefault(node, kind)
                merge.setdefault(node, s.merge)
            for u, v, k in G.out_edges([s.fork, *branch], keys=True):
                if (v == s.merge or v in branch) and (shortest or (u, v) != (s.fork, s.merge)):
                    edge_role.setdefault((u, v, k), kind)
                    edge_merge.setdefault((u, v, k), s.merge)
        role.setdefault(s.fork, "fork")
        role[s.merge], merge[s.merge] = "merge", s.merge
    return ({n: (r, merge.get(n)) for n, r in role.items()},
            {e: (r, edge_merge[e]) for e, r in edge_role.items()})


def _roles(G):
    nodes = {n: (d["branch_role"], d.get("branch_merge")) for n, d in G.nodes(data=True)
             if d.get("branch_role") is not None}
    edges = {(u, v, k): (d["branch_role"], d["branch_merge"])
             for u, v, k, d in G.edges(keys=True, data=True) if d.get("branch_role") is not None}
    return nodes, edges


def _random_dag(rng: random.Random) -> nx.MultiDiGraph:
    """Inputs (data, or integer masks), parameters, adds and cats of two or three earlier
    nodes, and other ops: every kind of merge, fork and side input, nested any way."""
    G = nx.MultiDiGraph()
    for i in range(rng.randint(1, 3)):
        G.add_node(f"in{i}", op="placeholder", target=f"in{i}",
                   out_dtype=rng.choice(["torch.float32", "torch.int64"]))
    for i in range(rng.randint(0, 2)):
        G.add_node(f"w{i}", op="get_attr", target=f"w{i}")
    for i in range(rng.randint(3, 30)):
        kind = rng.random()
        if kind < 0.45:
            op, target = "call_function", rng.choice(["operator.add", "torch.cat"])
        elif kind < 0.55:
            op, target = "call_module", "torch.nn.modules.sparse.Embedding"
        else:
            op, target = "call_function", "torch.relu"
        G.add_node(f"n{i}", op=op, target=target, module_type=target,
                   out_dtype="torch.float32")
        earlier = list(G)[:-1]
        for u in rng.sample(earlier, min(len(earlier), rng.randint(1, 3))):
            G.add_edge(u, f"n{i}", arg="input")
    G.add_node("output", op="output", target="output")
    G.add_edges_from((n, "output") for n in list(G) if G.out_degree(n) == 0 and n != "output")
    nx.set_node_attributes(G, {n: i for i, n in enumerate(G)}, "order")
    return G


def test_skip_connections_match_the_plain_definition_on_random_graphs():
    rng = random.Random(23)
    seen_side_inputs = 0
    for _ in range(400):
        G = _random_dag(rng)
        expected = _plain_skip_connections(G)
        found = fxnx.skip_connections(G, "all")
        assert _structure(found) == _structure(expected)
        assert _roles(G) == _plain_roles(G, expected, [s.kind for s in found])
        flow = analysis._data_flow(G)
        idom = nx.immediate_dominators(flow, analysis._ROOT)
        seen_side_inputs += any(idom[s.merge] == analysis._ROOT for s in expected)
    assert seen_side_inputs >= 10  # the cross-attention rule was exercised too


@pytest.mark.parametrize("name", ["nested_skip", "skip_block", "cat_chunk", "inplace_relu",
                                  "self_attention", "resnet18"])
def test_skip_connections_match_the_plain_definition_on_models(name, torchvision_model):
    import torch

    from zoo import CASES

    if name == "resnet18":
        G = fxnx.convert(torchvision_model(name), torch.randn(1, 3, 32, 32))
    else:
        case = CASES[name]
        G = fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())
    expected = _plain_skip_connections(G)
    found = fxnx.skip_connections(G, "all")
    assert _structure(found) == _structure(expected)
    assert _roles(G) == _plain_roles(G, expected, [s.kind for s in found])


# --- a cycle is one error that says what to do ----------------------------------------------


def _cyclic() -> nx.MultiDiGraph:
    G = nx.MultiDiGraph([("x", "a"), ("a", "b"), ("b", "a"), ("b", "output")])
    nx.set_node_attributes(G, {"x": "placeholder", "a": "call_function", "b": "call_function",
                               "output": "output"}, "op")
    nx.set_node_attributes(G, "operator.add", "target")
    return G


@pytest.mark.parametrize("call", [
    fxnx.summary, fxnx.skip_connections, fxnx.node_depths, fxnx.topological_order, fxnx.to_pydot,
    lambda G: fxnx.to_pydot(G, depth=1, checks=True),
    lambda G: fxnx.draw(G, "unwritten.dot"), lambda G: fxnx.draw(G, "unwritten.png"),
    lambda G: fxnx.draw(G, "unwritten.svg", checks=True),
], ids=["summary", "skip_connections", "node_depths", "topological_order", "to_pydot",
        "to_pydot-depth", "draw-dot", "draw-png", "draw-svg-checks"])
def test_a_cycle_is_one_error_naming_its_nodes(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fxnx.errors.GraphContractError,
                       match=r"^G has a cycle through 'a' -> 'b' -> 'a': .*fxnx\.validate\(G\)"):
        call(_cyclic())
    assert list(tmp_path.iterdir()) == []


def test_a_long_cycle_is_named_by_its_first_nodes():
    G = nx.MultiDiGraph()
    nx.add_cycle(G, [f"{'n' * 1000}{i}" for i in range(500)])
    with pytest.raises(fxnx.errors.GraphContractError) as info:
        fxnx.skip_connections(G)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600 and "(500 nodes)" in message


# --- collapsing modules: one pass --------------------------------------------------------------


@needs_dot
def test_collapsing_2000_modules_that_each_close_a_cycle_takes_seconds(tmp_path):
    # Each cycle found cost a rebuild of the whole view: minutes for a 500 KB file.
    out = _within(30, f"""
        import pickle, warnings
        from fxnx import _drawing as dr
        G = called_around(2000, plain=400)
        print(len(pickle.dumps(G)) // 1000)
        view = dr.view.collapse(G, 1)
        # by hand: every module called around an outside op stays expanded, the others collapse
        assert set(view) == set(G) - {{n for n in G if n.startswith("p")}} | {{
            f"p{{i}}" for i in range(400)}}
        fxnx.draw(G, {str(tmp_path / "g.dot")!r}, depth=1)
        dr.graphviz.run_dot = lambda *args: (b"", "")  # the time before Graphviz runs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fxnx.draw(G, {str(tmp_path / "g.png")!r})
            except fxnx.errors.FxnxValueError as err:  # too large for a PNG at depth 1: said at once
                assert "too large for a readable PNG even with modules collapsed" in str(err)
    """)
    assert 400 <= int(out) <= 600  # KB pickled: the size of the file that took minutes


@needs_dot
def test_modules_nested_thousands_deep_draw_in_seconds(tmp_path):
    # Before: a RecursionError writing .dot, and 90 s choosing a PNG's depth (a 34 KB file).
    _within(30, f"""
        import warnings
        from fxnx import _drawing as dr
        G = nested(4000, 400)
        fxnx.draw(G, {str(tmp_path / "g.dot")!r}, depth=4000)  # every node, every box
        dr.graphviz.run_dot = lambda *args: (b"", "")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fxnx.draw(G, {str(tmp_path / "g.png")!r})
    """)
    text = (tmp_path / "g.dot").read_text()
    assert text.count("subgraph cluster") == 32  # boxes nest MAX_NESTING deep at most


def test_collapse_keeps_the_shallow_views_of_deep_modules():
    from fxnx import _drawing as dr

    G = nested(40, 6)
    assert dr.view.module_depth(G) == 32
    assert sorted(dr.view.collapse(G, 2)) == ["a.a", "n0", "n1", "n2", "output", "x"]


# --- drawings: bounded size ------------------------------------------------------------------


def _long_strings(shared: bool) -> nx.MultiDiGraph:
    """A converted MLP whose names, targets, scopes, module types and shapes are long, with
    each edge eight times over: each its own string, or (``shared``) one string for every
    attribute, which a pickle holds once."""
    import torch

    layers = [torch.nn.Linear(3, 3) if i % 2 else torch.nn.ReLU() for i in range(40)]
    G = fxnx.convert(torch.nn.Sequential(*layers), torch.zeros(1, 3))
    rng = random.Random(0)

    def word(n: int) -> str:
        return "".join(rng.choice("abcdefgh_") for _ in range(n))

    same, dims = word(20_000), tuple(range(1000))
    long = (lambda n: same) if shared else word
    scope = f"{same}.{same}"
    if not shared:
        G = nx.relabel_nodes(G, {n: f"{n}_{word(3000)}" for n in G})
    for _, data in G.nodes(data=True):
        data.update(target=long(3000), module_type=long(3000), scope=scope if shared else f"{word(1000)}.{word(1000)}")
    for u, v, data in list(G.edges(data=True)):
        data["shape"] = dims if shared else tuple(range(1000))
        G.add_edges_from([(u, v, data)] * 7)
    G.graph["model"] = long(5000)
    return G


@pytest.mark.parametrize("shared", [False, True], ids=["own-strings", "shared-strings"])
def test_dot_text_is_a_small_multiple_of_the_graph_file(shared, tmp_path):
    from fxnx import _drawing as dr

    G = _long_strings(shared)
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    for depth in (None, 1):
        fxnx.draw(G, tmp_path / "g.dot", depth=depth)
        size = (tmp_path / "g.dot").stat().st_size
        assert size <= 4 * (tmp_path / "g.pkl").stat().st_size  # was 20 to 200 times
        P, view = fxnx.to_pydot(G, depth=depth), dr.view.view_of(dr.view.without_checks(G), depth)
        # The file is to_pydot's text plus the graph attributes draw gives dot (dpi, and the
        # layout's limits on a large graph), one line each.
        given = ("dpi=", "mclimit=", "nslimit=", "nslimit1=", "searchsize=")
        text = [line for line in (tmp_path / "g.dot").read_text().splitlines()
                if not line.startswith(given)]
        assert P.to_string().splitlines() == text
        # Long names that start alike keep ids of their own: a node, and edges, for each.
        assert len({n.get_name() for n in P.get_nodes()} - {"node", "edge"}) == len(view)
        assert len(P.get_edges()) == view.number_of_edges()


def test_long_names_keep_their_start_and_ids_stay_distinct():
    from fxnx._drawing import style as _style

    a, b = "x" * 200 + "a", "x" * 200 + "b"
    assert _style.node_id(a) != _style.node_id(b)
    assert _style.node_id(a).startswith('"' + "x" * 60) and len(_style.node_id(a)) <= 82
    assert _style.node_id("layer1_0_conv1") == "layer1_0_conv1"  # real names are kept whole
    assert _style.clip("y" * 100) == "y" * 79 + "…"
