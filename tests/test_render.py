"""Drawings: golden DOT text, structure of the drawing, files Graphviz writes, and errors."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
import torch
import torchvision

import fxnx
from fxnx import _style, render

from zoo import CASES

GOLDEN = Path(__file__).parent / "golden"
needs_dot = pytest.mark.skipif(render.shutil.which("dot") is None, reason="Graphviz dot not installed")


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
    nodes = {n.get_name(): n.get_attributes() for n in _all_nodes(dot)}
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


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "densenet121", "mobilenet_v3_small"])
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
    assert "<B>lin</B><BR/><FONT POINT-SIZE=\"10\">Linear</FONT>" in text


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
    with pytest.raises(fxnx.FxnxValueError, match="run fxnx.route_credit on G first"):
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
    assert max(width, height) <= render.MAX_PIXELS
    assert height > 1000


@needs_dot
def test_a_png_too_large_at_the_asked_depth_is_refused(tmp_path, monkeypatch):
    chain = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(60)))
    G = fxnx.convert(chain, torch.zeros(1, 2))
    runs = _count_dot_runs(monkeypatch)
    with pytest.raises(fxnx.FxnxValueError, match="32767-pixel limit"):
        fxnx.draw(G, tmp_path / "g.png", dpi=1200, depth=1)  # 60 ranks x 0.75 in x 1200 dpi
    assert not (tmp_path / "g.png").exists()
    assert runs == []  # refused from the prediction, before running Graphviz


def _count_dot_runs(monkeypatch):
    runs = []
    real = render._run_dot

    def counted(*args, **kwargs):
        runs.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(render, "_run_dot", counted)
    return runs


def test_without_dot_a_clear_error_and_dot_text_still_works(tmp_path, monkeypatch):
    monkeypatch.setattr(render.shutil, "which", lambda name: None)
    G = _zoo("skip_block")
    with pytest.raises(fxnx.GraphvizNotFoundError, match="apt-get install graphviz") as info:
        fxnx.draw(G, tmp_path / "g.png")
    assert isinstance(info.value, ImportError)
    assert not (tmp_path / "g.png").exists()
    assert fxnx.draw(G, tmp_path / "g.dot").read_text().startswith("digraph fxnx {")


def test_bad_options_are_refused(tmp_path):
    G = _zoo("skip_block")
    with pytest.raises(fxnx.FxnxValueError, match=r"give a \.png, \.svg, \.pdf or \.dot"):
        fxnx.draw(G, tmp_path / "g.jpeg")
    with pytest.raises(fxnx.FxnxValueError, match="rankdir"):
        fxnx.to_pydot(G, rankdir="BT")
    with pytest.raises(fxnx.FxnxValueError, match="depth must be 1 or more"):
        fxnx.to_pydot(G, depth=0)


def test_drawing_is_deterministic():
    assert fxnx.to_pydot(_zoo("nested_skip")).to_string() == fxnx.to_pydot(_zoo("nested_skip")).to_string()
    assert re.search(r"digraph fxnx \{", fxnx.to_pydot(_zoo("nested_skip")).to_string())
