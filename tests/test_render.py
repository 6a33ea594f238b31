"""Drawings: golden DOT text, structure of the drawing, files Graphviz writes, and errors."""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import networkx as nx
import pytest
import torch
import torchvision

import fxnx
import fxnx._drawing.draw
from fxnx import _drawing as dr
from fxnx._drawing import style as _style
from fxnx._drawing.view import check_nodes, without_checks

from conftest import assert_graphs_equal, needs_dot
from zoo import CASES

GOLDEN = Path(__file__).parent / "golden"


def _zoo(name):
    case = CASES[name]
    torch.manual_seed(0)
    return fxnx.convert(case.build(), *case.inputs(), kwargs=case.kwargs())


@pytest.mark.parametrize(
    ("name", "options"),
    [("skip_block", {}), ("cat_chunk", {}), ("nested_skip", {}), ("nested_skip", {"depth": 1}),
     ("self_attention", {"rankdir": "LR", "clusters": False})],
    ids=["skip_block", "cat_chunk", "nested_skip", "nested_skip_depth1", "self_attention_lr"],
)
def test_dot_text_matches_golden(name, options, request):
    text = fxnx.to_pydot(_zoo(name), **options).to_string()
    suffix = "_".join(f"{k}{v}" for k, v in options.items())
    path = GOLDEN / f"{name}{'_' + suffix if suffix else ''}.dot"
    if request.config.getoption("--update-golden"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}: run pytest --update-golden once and review it"
    assert text == path.read_text()


def _styles(dot):
    nodes = {}  # a node in a module's box is declared at the top and named again in the box
    for n in _all_nodes(dot):
        nodes.setdefault(n.get_name(), {}).update(n.get_attributes())
    edges = [e.get_attributes() for e in _all_edges(dot)]
    return nodes, edges


def _all_nodes(graph):
    yield from graph.get_nodes()
    for sub in graph.get_subgraphs():
        yield from _all_nodes(sub)


def _all_edges(graph):
    yield from graph.get_edges()
    for sub in graph.get_subgraphs():
        yield from _all_edges(sub)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v3_small"])
def test_skip_edges_stand_out_and_merges_are_marked(name, torchvision_model):
    G = fxnx.convert(torchvision_model(name), torch.randn(1, 3, 64, 64))
    skips = fxnx.skip_connections(G)
    nodes, edges = _styles(fxnx.to_pydot(G))
    skip_colors = {e.get("color") for e in edges if e.get("penwidth") == "2.5"}
    other_colors = {e.get("color", _style.PLAIN) for e in edges if e.get("penwidth") != "2.5"}
    assert skip_colors == {_style.SKIP}
    assert _style.SKIP not in other_colors
    assert sum(e.get("color") == _style.SKIP for e in edges) >= len(skips)
    merges = [n for n, a in nodes.items() if a.get("peripheries") == "2"]
    assert len(merges) == len(skips)
    assert all(nodes[m]["color"] == _style.MERGE for m in merges)


def test_edges_carry_shapes_and_nodes_their_kind():
    text = fxnx.to_pydot(_zoo("skip_block")).to_string()
    assert 'xlabel=" 2×4 "' in text
    assert "<B>lin</B><BR/><FONT POINT-SIZE=\"1\"> </FONT><BR/><FONT POINT-SIZE=\"10\">Linear</FONT>" in text


def test_depth_one_shows_resnet50_stages(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet50"), torch.randn(1, 3, 64, 64))
    text = fxnx.to_pydot(G, depth=1).to_string()
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        assert f"<B>{stage}</B>" in text
    assert "layer1_0_conv1" not in text
    assert text.count("Bottleneck") == 0 and text.count("Sequential ·") == 4
    assert len(fxnx.skip_connections(G)) == 16  # G itself is not collapsed


def test_color_by_credit_adds_a_colour_bar():
    model = CASES["skip_block"].build()
    x = torch.randn(2, 4)
    G = fxnx.convert(model, x)
    fxnx.route_credit(G, model, x)
    text = fxnx.to_pydot(G, color_by="credit_norm").to_string()
    assert all(c in text for c in _style.VIRIDIS)
    assert "credit_norm" in text
    with pytest.raises(fxnx.errors.FxnxValueError, match="run fxnx.route_credit on G first"):
        fxnx.to_pydot(_zoo("skip_block"), color_by="credit_norm")


def test_labels_are_escaped():
    G = _zoo("skip_block")
    G.graph["model"] = "a<b>&c"
    assert "a&lt;b&gt;&amp;c" in fxnx.to_pydot(G).to_string()


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@needs_dot
def test_png_svg_pdf_are_written(tmp_path):
    G = _zoo("nested_skip")
    width, height = _png_size(fxnx.draw(G, tmp_path / "g.png"))
    assert 100 < width < 4000 and 100 < height < 4000
    assert b"<svg" in (fxnx.draw(G, tmp_path / "g.svg")).read_bytes()[:500]
    assert fxnx.draw(G, tmp_path / "g.pdf").read_bytes().startswith(b"%PDF")


@needs_dot
@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet152", "densenet201"])
def test_too_large_for_png_is_collapsed_with_a_warning(name, tmp_path):
    G = fxnx.convert(torchvision.models.get_model(name, weights=None), torch.randn(1, 3, 64, 64))
    with pytest.warns(UserWarning, match=r"too large for a readable PNG; drew it with modules collapsed below depth \d"):
        path = fxnx.draw(G, tmp_path / "big.png")
    width, height = _png_size(path)
    assert max(width, height) <= dr.fit.MAX_PIXELS
    assert height > 1000


@needs_dot
def test_a_png_too_large_at_the_asked_depth_is_refused(tmp_path, monkeypatch, dot_runs):
    chain = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(60)))
    G = fxnx.convert(chain, torch.zeros(1, 2))
    runs = dot_runs
    with pytest.raises(fxnx.errors.FxnxValueError, match="32767-pixel limit"):
        fxnx.draw(G, tmp_path / "g.png", dpi=1200, depth=1)  # 60 ranks x 0.75 in x 1200 dpi
    assert not (tmp_path / "g.png").exists()
    assert runs == []  # refused from the prediction, before running Graphviz


def test_without_dot_a_clear_error_and_dot_text_still_works(tmp_path, monkeypatch):
    monkeypatch.setattr(dr.graphviz.shutil, "which", lambda name: None)
    G = _zoo("skip_block")
    with pytest.raises(fxnx.errors.GraphvizNotFoundError, match="apt-get install graphviz") as info:
        fxnx.draw(G, tmp_path / "g.png")
    assert isinstance(info.value, ImportError)
    assert not (tmp_path / "g.png").exists()
    assert fxnx.draw(G, tmp_path / "g.dot").read_text().startswith("digraph fxnx {")


def test_bad_options_are_refused(tmp_path):
    G = _zoo("skip_block")
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"give a \.png, \.svg, \.pdf or \.dot"):
        fxnx.draw(G, tmp_path / "g.jpeg")
    with pytest.raises(fxnx.errors.FxnxValueError, match="rankdir"):
        fxnx.to_pydot(G, rankdir="BT")
    with pytest.raises(fxnx.errors.FxnxValueError, match="depth must be 1 or more"):
        fxnx.to_pydot(G, depth=0)


def test_drawing_is_deterministic():
    assert fxnx.to_pydot(_zoo("nested_skip")).to_string() == fxnx.to_pydot(_zoo("nested_skip")).to_string()
    assert re.search(r"digraph fxnx \{", fxnx.to_pydot(_zoo("nested_skip")).to_string())


# --- node ids, branch styles, one Graphviz run ----------------------------------------------


def test_dot_ids_are_node_names(torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    P = fxnx.to_pydot(G)
    for node in G:
        (found,) = P.get_node(node)
        assert found.get("id") == f'"{node}"'  # the SVG element's id
    assert P.get_node("layer1_0_conv1")[0].get("tooltip").startswith('"layer1_0_conv1\\nop: call_module')
    P1 = fxnx.to_pydot(G, depth=1)
    assert {"layer1", "layer2", "layer3", "layer4", "conv1", "fc"} <= {
        n.get_name().strip('"') for n in P1.get_nodes()
    }
    assert P1.get_node("layer1.0") == [] and len(fxnx.to_pydot(G, depth=2).get_node("layer1.0")) == 1


class Checked(torch.nn.Module):
    """Checks its input twice, reads a size it never uses, and sizes a view by a checked dim."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        torch._assert(x.shape[1] == 4, "four features")
        n = x.shape[0]
        torch._assert(n > 0, "a batch")
        x.size()
        return self.lin(x).view(n, 2, 2)


def test_checks_are_left_out_of_drawings_unless_asked():
    G = fxnx.convert(Checked(), torch.randn(3, 4))
    # Oracle: a check is a node the output does not depend on (no mutation in this model).
    needed = nx.ancestors(G, "output") | {"output"}
    assert check_nodes(G) == set(G) - needed == {
        "getattr_1", "getitem", "eq", "_assert", "gt", "_assert_1", "size"}
    assert {"getattr_2", "getitem_1"} <= needed  # x.shape[0] sizes the view: kept
    P = fxnx.to_pydot(G)
    assert _drawn(P) == needed
    assert "2 assertions not drawn (checks=True)" in _legend(P)
    everything = fxnx.to_pydot(G, checks=True)
    assert _drawn(everything) == set(G)
    assert "not drawn" not in _legend(everything)


def _drawn(P):
    """The graph's nodes in a pydot drawing: its nodes less DOT's defaults."""
    return {n.get_name().strip('"') for n in P.get_nodes()} - {"node", "edge"}


def _legend(P):
    """The legend: the drawing's own label, set above it at the right."""
    attrs = P.get_attributes()
    assert (attrs["labelloc"], attrs["labeljust"]) == ("t", "r")
    return attrs["label"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["swin_tiny_patch4_window7_224", "efficientnet_b0"])
def test_checks_of_timm_models_are_what_the_output_does_not_need(name):
    timm = pytest.importorskip("timm")
    G = fxnx.convert(timm.create_model(name, pretrained=False).eval(), torch.randn(1, 3, 224, 224))
    checks = check_nodes(G)
    assert checks == set(G) - nx.ancestors(G, "output") - {"output"}
    assert any(G.nodes[n]["target"] == "torch._assert" for n in checks)


def test_densenet_concatenations_are_not_drawn_as_skips(torchvision_model):
    # DenseNet's merges are concatenations: parallel branches, not residuals (issue 27, item 6)
    G = fxnx.convert(torchvision_model("densenet121"), torch.randn(1, 3, 64, 64))
    nodes, edges = _styles(fxnx.to_pydot(G))
    assert not any(e.get("color") == _style.SKIP for e in edges)
    assert not any(a.get("peripheries") == "2" for a in nodes.values())


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_every_edge_into_a_merge_is_styled_by_its_branch_role(name, torchvision_model):
    G = fxnx.convert(torchvision_model(name), torch.randn(1, 3, 64, 64))
    fxnx.skip_connections(G)
    P = fxnx.to_pydot(G)
    drawn = {}  # (u, v) -> the attributes of the pydot edges between them, in order
    for e in P.get_edges():
        drawn.setdefault((e.get_source(), e.get_destination()), []).append(e.get_attributes())
    merges = [n for n, d in G.nodes(data=True) if d.get("branch_role") == "merge"]
    assert merges
    for merge in merges:
        by_role = {}
        for u, v, data in G.in_edges(merge, data=True):
            attrs = drawn[(u, v)].pop(0)
            look = (attrs.get("color"), attrs.get("style", "solid"), attrs.get("penwidth"))
            by_role.setdefault(data.get("branch_role"), set()).add(look)
        assert {"skip", "residual"} <= set(by_role), merge
        for role, looks in by_role.items():
            others = set().union(*(v for r, v in by_role.items() if r != role))
            assert not looks & others, (merge, role)
        # told apart without colour: skip edges dashed, residual edges solid
        assert {look[1] for look in by_role["skip"]} == {"dashed"}
        assert {look[1] for look in by_role["residual"]} == {"solid"}


def test_legend_shows_only_what_is_drawn():
    G = fxnx.convert(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()), torch.zeros(1, 3))
    legend = _legend(fxnx.to_pydot(G))
    assert "skip branch" not in legend and "merge" not in legend and "fork" not in legend
    legend = _legend(fxnx.to_pydot(_zoo("nested_skip")))
    assert "skip branch (dashed)" in legend and "residual branch (solid)" in legend
    assert "merge" in legend and "fork" in legend and "backward" not in legend


@needs_dot
def test_densenet121_png_is_drawn_with_one_graphviz_run(tmp_path, monkeypatch, torchvision_model, dot_runs):
    G = fxnx.convert(torchvision_model("densenet121"), torch.randn(1, 3, 224, 224))
    runs = dot_runs
    with pytest.warns(UserWarning, match=r"collapsed below depth \d"):
        path = fxnx.draw(G, tmp_path / "densenet121.png")
    assert runs == ["png"]
    width, height = _png_size(path)
    assert 100 < max(width, height) <= dr.fit.MAX_PIXELS


@needs_dot
@pytest.mark.parametrize("suffix", ["png", "svg", "pdf"])
def test_one_graphviz_run_per_drawing(suffix, tmp_path, monkeypatch, dot_runs):
    runs = dot_runs
    fxnx.draw(_zoo("nested_skip"), tmp_path / f"g.{suffix}")
    fxnx.draw(_zoo("nested_skip"), tmp_path / f"g1.{suffix}", depth=1)
    assert runs == [suffix, suffix]


@needs_dot
def test_svg_names_and_pdf_embeds_a_standard_font(tmp_path):
    svg = fxnx.draw(_zoo("skip_block"), tmp_path / "g.svg").read_text()
    assert 'font-family="Helvetica,sans-Serif"' in svg
    assert '<g id="lin" class="node">' in svg and "<title>lin</title>" in svg
    assert 'xlink:title="lin&#10;op: call_module (Linear)&#10;target: lin&#10;output shape: (2, 4)"' in svg
    pdf = fxnx.draw(_zoo("skip_block"), tmp_path / "g.pdf").read_bytes()
    assert b"/FontFile" in pdf  # the font's program is embedded, not only named


# --- crafted graphs, dpi, atomic output (issue 10) --------------------------------------------

CRAFTED = [
    '"]; evil [label="x', "<IMG SRC=\"/etc/passwd\">", 'a"b', "back\\", "line\nbreak",
    "semi; colon -> edge", "\\N\\G", "node",
]


def _crafted():
    G = _zoo("nested_skip")
    names = {n: f"{n}{CRAFTED[i % len(CRAFTED)]}" for i, n in enumerate(G)}
    import networkx as nx

    G = nx.relabel_nodes(G, names)
    G.graph["model"] = '<IMG SRC="/etc/hostname">"]; evil [label="'
    G.graph["modules"] = {"inner": '<IMG SRC="/etc/passwd">', "": 'x"]; y [label="'}
    for i, (_, data) in enumerate(G.nodes(data=True)):
        data["target"] = CRAFTED[i % len(CRAFTED)] + str(data.get("target"))
        data["module_type"] = "<IMG SRC='/etc/passwd'>" + CRAFTED[(i + 1) % len(CRAFTED)]
        data["out_shape"] = (2, CRAFTED[(i + 2) % len(CRAFTED)])
        data['score"]; evil [label="<IMG SRC=x>'] = float(i + 1)
    for i, (*_, data) in enumerate(G.edges(data=True)):
        data["shape"] = (2, CRAFTED[i % len(CRAFTED)])
    output = next(n for n, d in G.nodes(data=True) if d["op"] == "output")
    G.nodes[output].update(op="module", members='<IMG SRC="/etc/passwd"/>"]; evil [label="')
    return G


def _parsed_counts(text):
    import pydot

    (P,) = pydot.graph_from_dot_data(text)
    nodes = {n.get_name() for n in _all_nodes(P)} - {"node", "edge", "graph"}
    return nodes, list(_all_edges(P))


@pytest.mark.parametrize("depth", [None, 1])
def test_crafted_attributes_cannot_add_nodes_or_markup(depth, tmp_path):
    import pydot

    G = _crafted()
    text = fxnx.to_pydot(G, depth=depth, color_by='score"]; evil [label="<IMG SRC=x>').to_string()
    view = dr.view.collapse(G, depth) if depth else G
    nodes, edges = _parsed_counts(text)
    assert len(nodes) == view.number_of_nodes()
    assert len(edges) == view.number_of_edges()
    assert "evil" not in {n.strip('"') for n in nodes}
    (P,) = pydot.graph_from_dot_data(text)
    for item in [P, *_all_nodes(P), *_all_edges(P), *P.get_subgraphs()]:  # P: the legend
        for key, value in item.get_attributes().items():
            if str(value).startswith("<"):  # an HTML-like label: markup only from fxnx
                assert not re.search(r"<\s*img", value, re.IGNORECASE), (key, value)
    if dr.graphviz.shutil.which("dot"):
        done = dr.graphviz.subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True)
        assert done.returncode == 0, done.stderr
        assert b"<image" not in done.stdout
        assert b"Warning" not in done.stderr and b"Error" not in done.stderr


def test_odd_node_names_round_trip_as_ids():
    import pydot

    G = _crafted()
    P = fxnx.to_pydot(G)
    (parsed,) = pydot.graph_from_dot_data(P.to_string())
    ids = {n.get_name() for n in _all_nodes(parsed)}
    for node in G:
        assert dr.style.node_id(node) in ids, node
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", node):
            assert len(P.get_node(node)) == 1


@pytest.mark.parametrize("dpi", [-5, 0, 1.5, "96", True, 100_000])
def test_dpi_is_checked_before_graphviz_runs(dpi, tmp_path, monkeypatch, dot_runs):
    runs = dot_runs
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"dpi must be a whole number from 1 to 1200"):
        fxnx.draw(_zoo("skip_block"), tmp_path / "g.png", dpi=dpi)
    assert runs == [] and list(tmp_path.iterdir()) == []


@needs_dot
@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_a_failed_graphviz_run_leaves_the_previous_file(suffix, tmp_path, monkeypatch):
    path = tmp_path / f"g.{suffix}"
    path.write_bytes(b"the previous drawing")
    broken = type("Broken", (), {"to_string": lambda self: "digraph { a -> ; }"})()
    monkeypatch.setattr(dr.draw, "pydot_of", lambda view, **kw: broken)
    with pytest.raises(fxnx.errors.FxnxValueError, match="Graphviz's dot failed on"):
        fxnx.draw(_zoo("skip_block"), path)
    assert path.read_bytes() == b"the previous drawing"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@needs_dot
def test_a_layout_past_the_time_limit_names_a_depth(tmp_path, monkeypatch, torchvision_model):
    G = fxnx.convert(torchvision_model("resnet50"), torch.randn(1, 3, 64, 64))
    path = tmp_path / "g.svg"
    path.write_bytes(b"the previous drawing")
    monkeypatch.setattr(dr.graphviz, "DOT_TIMEOUT", 0.01)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"did not lay out g\.svg within .*depth=3 or less"):
        fxnx.draw(G, path)
    assert path.read_bytes() == b"the previous drawing"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _dot_times_out(monkeypatch):
    def slow(text, fmt, name):
        raise dr.graphviz.subprocess.TimeoutExpired(["dot"], dr.graphviz.DOT_TIMEOUT)

    monkeypatch.setattr(dr.graphviz, "run_dot", slow)


@needs_dot
@pytest.mark.parametrize(
    ("asked", "advice"),
    [(3, r"draw it with depth=2 or less"), (2, r"draw it with depth=1 or less"),
     (1, r"cannot make it smaller \(it is drawn at depth=1\): draw one part with "
         r"fxnx\.scope_subgraph")],
)
def test_a_slow_layout_at_an_asked_depth_names_a_smaller_one(asked, advice, tmp_path,
                                                             monkeypatch, torchvision_model):
    G = fxnx.convert(torchvision_model("resnet50"), torch.randn(1, 3, 64, 64))  # 3 levels deep
    _dot_times_out(monkeypatch)
    with pytest.raises(fxnx.errors.FxnxValueError, match=advice):
        fxnx.draw(G, tmp_path / "g.pdf", depth=asked)
    assert list(tmp_path.iterdir()) == []


@needs_dot
def test_a_slow_layout_without_modules_says_no_depth_helps(tmp_path, monkeypatch):
    G = _zoo("skip_block")
    for _, data in G.nodes(data=True):
        data["scope"], data["op"] = "", "call_function" if data["op"] == "call_module" else data["op"]
    _dot_times_out(monkeypatch)
    with pytest.raises(fxnx.errors.FxnxValueError, match=r"cannot make it smaller \(it has no nested modules\)"):
        fxnx.draw(G, tmp_path / "g.svg")
    assert list(tmp_path.iterdir()) == []


@needs_dot
@pytest.mark.slow
def test_densenet121_svg_keeps_every_node_with_a_bounded_layout(tmp_path, monkeypatch, torchvision_model, dot_runs):
    G = fxnx.convert(torchvision_model("densenet121"), torch.randn(1, 3, 224, 224))
    runs = dot_runs
    svg = fxnx.draw(G, tmp_path / "densenet121.svg").read_text()
    assert runs == ["svg"]
    assert all(f'<g id="{node}" class="node">' in svg for node in G)


class _NormBlock(torch.nn.Module):
    """A ViT-like block: a layer norm with its own parameters, then a residual add."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(d))
        self.norm.bias = torch.nn.Parameter(torch.zeros(d))
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x):
        y = torch.nn.functional.layer_norm(x, (self.d,), self.norm.weight, self.norm.bias)
        return x + self.fc(y)


def _dot_size(text):
    """The width and height in points of dot's own layout of DOT text: the oracle."""
    plain = dr.graphviz.subprocess.run(["dot", "-Tplain"], input=text.encode(), capture_output=True,
                                  check=True).stdout.decode()
    width, height = plain.split("\n", 1)[0].split()[2:4]
    return float(width) * 72, float(height) * 72


def _dot_ranks(text):
    """Each node's y coordinate in dot's own layout of DOT text (nodes on one rank share it)."""
    plain = dr.graphviz.subprocess.run(["dot", "-Tplain"], input=text.encode(), capture_output=True,
                                  check=True).stdout.decode()
    return {p[1]: float(p[3]) for p in map(shlex.split, plain.splitlines()) if p[0] == "node"}


def _norm_stack(blocks):
    G = fxnx.convert(torch.nn.Sequential(*(_NormBlock(4) for _ in range(blocks))), torch.zeros(1, 4))
    fxnx.skip_connections(G)
    return G


@needs_dot
def test_blocks_in_sequence_stack_instead_of_drifting_across():
    # A block's parameters are listed on the layer norm that reads them, inside its box; drawn
    # a rank above, they would share the previous block's last rank, and dot would set the
    # boxes side by side: eight blocks a staircase about eight blocks wide.
    one, _ = _dot_size(fxnx.to_pydot(_norm_stack(1)).to_string())
    G = _norm_stack(8)
    text = fxnx.to_pydot(G).to_string()
    width, height = _dot_size(text)
    assert width < 1.5 * one
    drawn = dr.view.fold_parameters(G)  # each layer norm lists its weight and bias
    assert {d["op"] for _, d in drawn.nodes(data=True)} == {"placeholder", "call_function",
                                                             "call_module", "output"}
    guess = dr.estimate.estimate(drawn, dr.estimate.label_width)  # the prediction follows what dot drew
    assert 0.7 < guess.across / width < 1.5
    assert 0.7 < guess.along / height < 1.5


def test_parameters_are_named_by_attribute_inside_their_modules_box():
    G = _norm_stack(2)
    (reader,) = G.successors("_1_norm_weight")
    boxed = fxnx.to_pydot(G).get_node(reader)[0].get("label")
    assert '<I>norm.weight · norm.bias</I>' in boxed  # in the box of block 1, which reads them
    loose = fxnx.to_pydot(G, clusters=False).get_node(reader)[0].get("label")
    assert "<I>_1_norm_weight</I>" in loose and "<I>_1_norm_bias</I>" in loose  # one a line


class _WrittenNorm(torch.nn.Module):
    """A batch norm written out (four tensors into one call), a scale read by two ops and a
    shift read by one: as timm's BatchNormAct2d and hand-written layers read parameters."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(d, dtype=torch.float64) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.register_buffer("running_mean", torch.randn(d, dtype=torch.float64))
        self.register_buffer("running_var", torch.rand(d, dtype=torch.float64) + 0.5)
        self.scale = torch.nn.Parameter(torch.randn(d, dtype=torch.float64))
        self.shift = torch.nn.Parameter(torch.randn(d, dtype=torch.float64))

    def forward(self, x):
        y = torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                           self.bias)
        return y * self.scale + self.scale + self.shift


def _read_alone_by_fx(model):
    """The oracle, from torch.fx's own graph: each attribute that one node alone reads, to
    that node's name."""
    gm = torch.fx.symbolic_trace(model)
    return {node.target: next(iter(node.users)).name for node in gm.graph.nodes
            if node.op == "get_attr" and len(node.users) == 1}


def test_parameters_one_op_alone_reads_are_listed_on_it():
    model = torch.nn.Sequential(_WrittenNorm(4))
    G = fxnx.convert(model, torch.randn(3, 4, dtype=torch.float64))
    before = {n: dict(d) for n, d in G.nodes(data=True)}
    alone = _read_alone_by_fx(model)
    assert sorted(alone) == ["0.bias", "0.running_mean", "0.running_var", "0.shift", "0.weight"]
    P = fxnx.to_pydot(G)
    listed = {n for n, d in G.nodes(data=True) if d["target"] in alone}
    assert _drawn(P) == set(G) - listed  # 0.scale, read by two ops, is still a node
    assert {n: dict(d) for n, d in G.nodes(data=True)} == before  # G itself is not changed
    for target, reader in alone.items():  # named within its module's box, in italics
        (node,) = P.get_node(reader)
        assert target.removeprefix("0.") in node.get("label")
        assert f"reads {target}: shape (4,)" in node.get("tooltip")
    (norm,) = P.get_node(alone["0.weight"])
    assert "<I>weight · bias</I>" in norm.get("label")
    assert "<I>running_mean · running_var</I>" in norm.get("label")  # a few to a line
    assert not any(e.get_source() in listed for e in _all_edges(P))


class _Returns(torch.nn.Module):
    """Returns a parameter beside its output: the output node reads it, and lists nothing."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.lin(x), self.w


def test_a_returned_parameter_stays_a_node_and_a_users_attributes_are_not_listed():
    G = fxnx.convert(_Returns(), torch.zeros(1, 4))
    gm = torch.fx.symbolic_trace(_Returns())  # the oracle: torch.fx reads w for the output
    (read,) = [n.name for n in gm.graph.nodes if n.op == "get_attr"]
    assert [u.op for u in next(n for n in gm.graph.nodes if n.name == read).users] == ["output"]
    nx.set_node_attributes(G, 3, "parameters")  # a user's attribute of that name
    P = fxnx.to_pydot(G)
    assert read in _drawn(P)
    assert not any("<I>" in str(n.get("label")) for n in P.get_nodes())
    assert "italics" not in _legend(P)


@needs_dot
def test_the_estimate_counts_the_lines_of_listed_parameters():
    class Norms(torch.nn.Module):  # two written-out batch norms: four tensors listed on each
        def __init__(self):
            super().__init__()
            self.a, self.b = _WrittenNorm(4), _WrittenNorm(4)

        def forward(self, x):
            return self.b(self.a(x))

    G = fxnx.convert(torch.nn.Sequential(*(Norms() for _ in range(10))),
                     torch.zeros(2, 4, dtype=torch.float64))
    text = fxnx.to_pydot(G).to_string()
    assert "parameters only this op reads" in _legend(fxnx.to_pydot(G))
    width, height = _dot_size(text)
    guess = dr.estimate.estimate_view(dr.view.fold_parameters(dr.view.view_of(G, None)), True)
    assert 0.9 < guess.along / height < 1.15, (guess.along, height)  # 0.83 without the lines
    assert 0.7 < guess.across / width < 1.5


@needs_dot
def test_a_graph_without_a_model_name_draws():
    G = nx.MultiDiGraph([("x", "y")])
    nx.set_node_attributes(G, {"x": "placeholder", "y": "output"}, "op")
    text = fxnx.to_pydot(G).to_string()
    done = dr.graphviz.subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True)
    assert done.returncode == 0, done.stderr


def test_coloured_by_credit_each_parameter_keeps_its_node_and_colour():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_WrittenNorm(4))
    x = torch.randn(3, 4, dtype=torch.float64)
    G = fxnx.convert(model, x)
    fxnx.route_credit(G, model, x)
    P = fxnx.to_pydot(G, color_by="credit_norm")
    assert _drawn(P) == set(G)
    norm = model[0]
    grads = torch.autograd.grad(model(x).sum(), [norm.weight, norm.bias, norm.shift])
    scale = _style.Scale(G, "credit_norm")
    for name, grad in zip(["_0_weight", "_0_bias", "_0_shift"], grads, strict=True):
        expected = grad.norm().item()  # the oracle: autograd
        assert abs(G.nodes[name]["credit_norm"] - expected) <= 1e-12 * expected
        assert P.get_node(name)[0].get("fillcolor") == scale.color(expected)


def test_constants_made_by_tracing_collapse_into_their_module():
    class Shifted(torch.nn.Module):
        def forward(self, x):
            return x + torch.tensor([1.0, 2.0])  # traced as a get_attr _tensor_constant0

    G = fxnx.convert(torch.nn.Sequential(torch.nn.Sequential(Shifted())), torch.zeros(1, 2))
    assert any(d.get("op") == "get_attr" and "." not in d["target"] for _, d in G.nodes(data=True))
    assert {d.get("op") for _, d in dr.view.collapse(G, 1).nodes(data=True)} == {
        "placeholder", "module", "output"}


@needs_dot
def test_swin_png_depth_is_chosen_once_and_fits(tmp_path, monkeypatch, dot_runs):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).eval()
    G = fxnx.convert(model, torch.randn(1, 3, 224, 224))
    runs = dot_runs
    with pytest.warns(UserWarning, match=r"collapsed below depth (\d)") as caught:
        path = fxnx.draw(G, tmp_path / "swin.png")
    assert runs == ["png"]
    width, height = _png_size(path)
    assert max(width, height) <= dr.fit.MAX_PIXELS
    # What dot drew is what was predicted to fit: within the area limit, give or take a half.
    assert width * height / 96**2 <= 1.5 * dr.fit.PNG_AREA
    depth = int(re.search(r"below depth (\d)", str(caught[0].message)).group(1))
    deeper = dr.view.collapse(without_checks(G), depth + 1)
    w, h = _dot_size(dr.dot.to_pydot(deeper).to_string())
    assert w * h / 72**2 > dr.fit.PNG_AREA  # one level deeper would not have fit


def _deepest_fitting_depth(G, dpi=96):
    """The PNG depth by brute force: every depth collapsed and estimated, deepest fit wins."""
    if dr.fit.fits_png(dr.estimate.estimate_view(dr.view.fold_parameters(G), True), dpi):
        return None
    top = dr.view.module_depth(G) - 1
    for depth in range(top, 0, -1):
        drawn = dr.view.fold_parameters(dr.view.collapse(G, depth))
        if dr.fit.fits_png(dr.estimate.estimate_view(drawn, True), dpi):
            return depth
    return 1


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "densenet121", "mobilenet_v3_small",
                                  "googlenet"])
def test_png_depth_passing_over_depths_picks_what_trying_every_depth_picks(name, torchvision_model):
    _check_png_depth(torchvision_model(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["efficientnet_b0", "swin_tiny_patch4_window7_224", "repvgg_a0"])
def test_png_depth_of_timm_models_is_what_trying_every_depth_picks(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    _check_png_depth(timm.create_model(name, pretrained=False).eval())


def _check_png_depth(model):
    G = without_checks(fxnx.convert(model, torch.randn(1, 3, 224, 224)))
    depth, view, _ = dr.fit.png_depth(G, 96, True)
    assert depth is not None  # too large in full
    assert depth == _deepest_fitting_depth(G)
    assert all("branch_role" in d for _, d in view.nodes(data=True))  # its own skip marks
    for d in range(1, dr.view.module_depth(G) + 1):  # the count it passes over by: a floor
        assert dr.view.collapsed_size(G, d) <= dr.view.view_of(G, d).number_of_nodes()


def test_no_estimate_is_smaller_than_the_area_floor():
    from fxnx._drawing.estimate import NODE_PAD, area_floor

    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 60, (1,), generator=rng))
        G = nx.gnp_random_graph(n, 0.1, seed=trial, directed=True)
        G = nx.MultiDiGraph((u, v) for u, v in G.edges if u < v)  # a DAG
        G.add_nodes_from(range(n))
        scopes = ["", "a", "a.b", "c"]
        for node in G:
            G.nodes[node]["scope"] = scopes[int(torch.randint(0, 4, (1,), generator=rng))]
        widths = {node: NODE_PAD + float(torch.randint(0, 100, (1,), generator=rng))
                  for node in G}
        for clusters in (True, False):
            e = dr.estimate.estimate(G, lambda node, data, w=widths: w[node], clusters=clusters)
            assert e.across * e.along >= area_floor(widths.values())
    e = dr.estimate.estimate(nx.MultiDiGraph([(0, 1)]), lambda node, data: NODE_PAD)
    assert e.across * e.along == pytest.approx(area_floor([NODE_PAD] * 2))  # one a rank: the floor


# --- left to right without covered labels; DOT text that makes the same drawing ---------------


def _label_and_node_boxes(text):
    """Boxes (x0, y0, x1, y1) in points of every node and edge label in dot's own layout of
    DOT text (``-Tjson``): the oracle for what covers what."""
    out = dr.graphviz.subprocess.run(["dot", "-Tjson"], input=text.encode(), capture_output=True,
                                check=True).stdout
    layout = json.loads(out)
    nodes = {}
    for obj in layout.get("objects", []):
        if "pos" in obj and "width" in obj:  # a node (clusters have a bb, not a pos)
            x, y = map(float, obj["pos"].split(","))
            w, h = float(obj["width"]) * 72, float(obj["height"]) * 72
            nodes[obj["name"]] = (x - w / 2, y - h / 2, x + w / 2, y + h / 2)
    labels = []
    for edge in layout.get("edges", []):
        where = edge.get("xlp") or edge.get("lp")
        texts = [op for op in edge.get("_ldraw_", []) if op["op"] == "T"]
        sizes = [op["size"] for op in edge.get("_ldraw_", []) if op["op"] == "F"]
        if where and texts:
            x, y = map(float, where.split(","))
            w, h = texts[0]["width"], sizes[0] * 1.2  # dot's line height: 1.2 times the size
            labels.append((texts[0]["text"], (x - w / 2, y - h / 2, x + w / 2, y + h / 2)))
    return nodes, labels


def _overlap(a, b, tolerance=2.0):
    """Whether two boxes share more than ``tolerance`` points both ways (dot lets a label
    touch what it is set beside)."""
    return (min(a[2], b[2]) - max(a[0], b[0]) > tolerance
            and min(a[3], b[3]) - max(a[1], b[1]) > tolerance)


@needs_dot
@pytest.mark.parametrize("rankdir", ["TB", "LR"])
@pytest.mark.parametrize("depth", [1, 2, None])
def test_edge_labels_cover_no_node_and_no_other_label(depth, rankdir, tmp_path, torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    text = fxnx.draw(G, tmp_path / "g.dot", depth=depth or dr.view.module_depth(G),
                     rankdir=rankdir).read_text()
    nodes, labels = _label_and_node_boxes(text)
    assert len(labels) == fxnx.to_pydot(G, depth=depth).to_string().count("label=\" ")
    covered = [(label, node) for label, box in labels for node, other in nodes.items()
               if _overlap(box, other)]
    assert covered == []
    crossed = [(a, b) for i, (a, box) in enumerate(labels) for b, other in labels[i + 1:]
               if _overlap(box, other)]
    assert crossed == []


def test_left_to_right_labels_are_dots_own_edge_labels():
    text = fxnx.to_pydot(_zoo("skip_block"), rankdir="LR").to_string()
    assert 'label=" 2×4 "' in text and "xlabel" not in text
    assert 'xlabel=" 2×4 "' in fxnx.to_pydot(_zoo("skip_block")).to_string()


@needs_dot
@pytest.mark.parametrize(("options", "dpi"), [({}, 96), ({"rankdir": "LR"}, 150),
                                              ({"depth": 1, "color_by": "credit_norm"}, 200)])
def test_dot_text_written_by_draw_makes_the_same_png(options, dpi, tmp_path, torchvision_model):
    model = torchvision_model("resnet18")
    x = torch.randn(1, 3, 64, 64)
    G = fxnx.convert(model, x)
    if "color_by" in options:
        fxnx.route_credit(G, model, x)
    with warnings.catch_warnings(record=True) as png_warnings:
        warnings.simplefilter("always")
        png = fxnx.draw(G, tmp_path / "g.png", dpi=dpi, **options).read_bytes()
    with warnings.catch_warnings(record=True) as dot_warnings:
        warnings.simplefilter("always")
        dot = fxnx.draw(G, tmp_path / "g.dot", dpi=dpi, **options)
    assert [str(w.message) for w in dot_warnings] == [str(w.message) for w in png_warnings]
    # The oracle: Graphviz run by hand on the file, as a user would, with no other option.
    done = dr.graphviz.subprocess.run(["dot", "-Tpng", str(dot)], capture_output=True, check=True)
    assert done.stdout == png
    assert f"dpi={dpi}" in dot.read_text()


@needs_dot
def test_dot_text_of_a_large_graph_carries_the_layouts_limits(tmp_path, torchvision_model):
    G = fxnx.convert(torchvision_model("densenet121"), torch.randn(1, 3, 64, 64))
    full = dr.view.module_depth(G)  # every node: what SVG draws
    text = fxnx.draw(G, tmp_path / "g.dot", depth=full).read_text()
    import pydot

    (P,) = pydot.graph_from_dot_data(text)
    attrs = P.get_attributes()
    expected = dr.estimate.bounded_options(dr.estimate.estimate_view(dr.view.view_of(without_checks(G), full), True))
    assert expected  # DenseNet-121 in full is past the work at which dot's passes are limited
    assert {key: attrs[key] for key in expected} == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = fxnx.draw(G, tmp_path / "png.dot").read_text()  # as a PNG: collapsed
    assert len(chosen) < len(text) / 3


def test_a_subgraphs_drawing_is_the_same_in_every_process(tmp_path, torchvision_model):
    G = fxnx.convert(torchvision_model("resnet18"), torch.randn(1, 3, 64, 64))
    fxnx.write_pickle(G, tmp_path / "g.pkl")
    code = ("import sys, fxnx; G = fxnx.read_pickle(sys.argv[1]); "
            "print(fxnx.to_pydot(fxnx.scope_subgraph(G, 'layer2')).to_string())")
    texts = set()
    for seed in ("1", "2", "3"):  # string hashing, and so the order of sets, differs with it
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "g.pkl")],
                              capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        texts.add(done.stdout)
    assert len(texts) == 1


class _Checked(torch.nn.Module):
    """A residual block that checks its input as timm's models do: an assertion node in G."""

    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x):
        torch._assert(x.shape[-1] == 4, "four features")
        return self.block(x) + x


class _Unchecked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x):
        return self.block(x) + x


@pytest.mark.parametrize("model", [_Checked, _Unchecked])
@pytest.mark.parametrize("options", [{}, {"depth": 1}, {"checks": True}, {"color_by": "order"},
                                     {"clusters": False, "rankdir": "LR"}])
def test_draw_and_to_pydot_leave_G_as_it_was(model, options, tmp_path):
    import copy

    G = fxnx.convert(model(), torch.zeros(2, 4))
    assert any("_assert" in str(d.get("target")) for _, d in G.nodes(data=True)) == (model is _Checked)
    before = copy.deepcopy(G)
    fxnx.to_pydot(G, **options)
    fxnx.draw(G, tmp_path / "g.dot", **options)
    fxnx.draw(G, **options).dot  # noqa: B018  (the inline drawing's DOT text)
    assert_graphs_equal(G, before)
    assert not any("branch_role" in d for _, d in G.nodes(data=True))  # skips marked on a copy


def test_an_edge_of_several_tensors_is_labelled_by_their_count():
    """unbind's out-edge carries three tensors, not one of shape a×b×c: labelled by their
    count and their one shape (the premise: G's edge holds a list of three shapes)."""

    class Unbound(torch.nn.Module):
        def forward(self, x):
            a, b, c = x.unbind(0)
            return a + b * c

    G = fxnx.convert(Unbound(), torch.zeros(3, 2, 4))
    (shape,) = {str(d["shape"]) for u, _, d in G.edges(data=True) if G.nodes[u]["target"] == "unbind"}
    assert shape == str([(2, 4)] * 3)
    text = fxnx.to_pydot(G).to_string()
    assert '" 3 of 2×4 "' in text and "2×4×2×4" not in text
