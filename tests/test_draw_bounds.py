"""Drawings keep their bounds on every model: a default PNG within the size draw promises, or an
error that names what works (a depth of 1 or more, a dpi, SVG, PDF, DOT or a part of the
graph), never a crash on a node named like a module (issue 27, item 5).

The oracles are Graphviz's own layout (``dot -Tplain``) and the PNG's header, never fxnx's
prediction of them.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import subprocess
import warnings
from pathlib import Path

import networkx as nx
import pytest
import torch

import fxnx
import fxnx._drawing.draw
from fxnx import _drawing as dr

from conftest import needs_dot

#: What draw promises a PNG drawn without depth (its docstring and the README): Graphviz's pixel
#: limit always, and about PNG_AREA square inches, dot's own layout within 1.5 times the
#: prediction that chose the depth.
AREA_SLACK = 1.5


def _png(path: Path) -> tuple[int, int]:
    """Width and height in pixels, from the PNG's header."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def _within_bound(path: Path, dpi: int = 96) -> None:
    width, height = _png(path)
    assert max(width, height) <= dr.fit.MAX_PIXELS
    assert width * height / dpi**2 <= AREA_SLACK * dr.fit.PNG_AREA, (width, height, dpi)


def _dot_inches(text: str) -> tuple[float, float]:
    """Width and height, in inches, of dot's own layout of DOT text."""
    plain = subprocess.run(["dot", "-Tplain"], input=text.encode(), capture_output=True,
                           check=True).stdout.decode()
    width, height = plain.split("\n", 1)[0].split()[2:4]
    return float(width), float(height)


def _no_depth_below_one(message: str) -> None:
    depths = [int(d) for d in re.findall(r"depth=(-?\d+)", message)]
    assert all(d >= 1 for d in depths), message
    assert "smaller depth" not in message


# --- a detector's post-processing: most nodes outside every module ---------------------------


class Tail(torch.nn.Module):
    """A small module, then ``n`` ops outside every module, as a detector's anchors, box
    decoding and non-maximum suppression are: no depth collapses them."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x):
        x = self.head(x)
        for _ in range(self.n):
            x = x * 0.5
        return x


@needs_dot
def test_a_png_that_fits_at_no_depth_is_refused_before_graphviz_runs(tmp_path, monkeypatch, dot_runs):
    G = fxnx.convert(Tail(300), torch.zeros(1, 4))
    with pytest.warns(UserWarning, match="too large for a readable PNG even with modules collapsed "
                                         "below depth 1"):
        text = fxnx.draw(G, tmp_path / "g.dot").read_text()  # DOT text is still written
    width, height = _dot_inches(text)
    assert width * height > AREA_SLACK * dr.fit.PNG_AREA  # the oracle: dot's layout at depth 1
    runs = dot_runs
    for path in (tmp_path / "g.png", None):  # a file, and a drawing for a notebook
        with pytest.raises(fxnx.errors.FxnxValueError) as info:
            fxnx.draw(G, path)
        message = str(info.value)
        assert "too large for a readable PNG even with modules collapsed below depth 1" in message
        assert ".svg or .pdf" in message
        assert "fxnx.scope_subgraph(G, scope): 'head' fits a PNG" in message  # the part that does
        _no_depth_below_one(message)
    assert runs == [] and not (tmp_path / "g.png").exists()
    # What the error advises works: the whole as SVG, a part as PNG within the bound.
    assert b"<svg" in fxnx.draw(G, tmp_path / "g.svg").read_bytes()[:500]
    _within_bound(fxnx.draw(fxnx.scope_subgraph(G, "head"), tmp_path / "head.png"))


@needs_dot
def test_a_png_past_graphvizs_limit_at_depth_1_names_a_dpi_that_fits(tmp_path, monkeypatch, dot_runs):
    G = fxnx.convert(Tail(500), torch.zeros(1, 4))
    runs = dot_runs
    with pytest.raises(fxnx.errors.FxnxValueError, match="32767-pixel limit") as info:
        fxnx.draw(G, tmp_path / "g.png", depth=1)
    assert runs == []
    message = str(info.value)
    _no_depth_below_one(message)  # SSD300's error told the user to choose a depth below 1
    dpi = int(re.search(r"dpi=(\d+) or less", message).group(1))
    assert dpi < 96
    width, height = _png(fxnx.draw(G, tmp_path / "g.png", depth=1, dpi=dpi))
    assert max(width, height) <= dr.fit.MAX_PIXELS  # the oracle: the PNG Graphviz wrote


class Stack(torch.nn.Module):
    """``stages`` stages of ``blocks`` residual blocks: nested two deep."""

    def __init__(self, stages: int, blocks: int) -> None:
        super().__init__()
        self.stages = torch.nn.Sequential(*(
            torch.nn.Sequential(*(_Residual() for _ in range(blocks))) for _ in range(stages)))

    def forward(self, x):
        return self.stages(x)


class _Residual(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


@needs_dot
def test_a_png_past_graphvizs_limit_at_an_asked_depth_names_a_depth_that_fits(tmp_path):
    G = fxnx.convert(Stack(4, 12), torch.zeros(1, 4))
    with pytest.raises(fxnx.errors.FxnxValueError, match="32767-pixel limit") as info:
        fxnx.draw(G, tmp_path / "g.png", depth=3, dpi=1200)
    message = str(info.value)
    _no_depth_below_one(message)
    depth = int(re.search(r"depth=(\d+) or less", message).group(1))
    assert 1 <= depth < 3
    width, height = _png(fxnx.draw(G, tmp_path / "g.png", depth=depth, dpi=1200))
    assert max(width, height) <= dr.fit.MAX_PIXELS


@needs_dot
@pytest.mark.parametrize("rankdir", ["TB", "LR"])
def test_a_default_png_is_within_its_bound(rankdir, tmp_path):
    G = fxnx.convert(Stack(6, 8), torch.zeros(1, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = fxnx.draw(G, tmp_path / "g.png", rankdir=rankdir)
    _within_bound(path)
    # Collapsed only as far as needed: in full it would not have been within the bound.
    assert any("collapsed below depth" in str(w.message) for w in caught)
    full = fxnx.draw(G, tmp_path / "full.dot", depth=dr.view.module_depth(G), rankdir=rankdir)
    width, height = _dot_inches(full.read_text())
    assert width * height > dr.fit.PNG_AREA


# --- a node named like a top-level module (XLNet's KeyError: 'members') -------------------------


def blk(x):
    """A function named like the model's module ``blk``."""
    return x * 2


torch.fx.wrap("blk")


class NamedLikeAModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x):
        return self.blk(blk(x))


def test_a_function_named_like_a_top_level_module_stays_its_own_node():
    G = fxnx.convert(NamedLikeAModule(), torch.zeros(1, 4))
    # The premise, from torch.fx: a call of the function blk, named blk, beside module blk.
    assert (G.nodes["blk"]["op"], G.nodes["blk"]["target"]) == ("call_function", f"{__name__}.blk")
    in_module = sorted(n for n, d in G.nodes(data=True) if d["scope"] == "blk"
                       or str(d["target"]).startswith("blk."))
    assert in_module == ["blk_0", "blk_1"]
    view = dr.view.collapse(G, 1)
    assert list(view) == ["x", "blk (node)", "blk", "output"]
    assert view.nodes["blk"]["op"] == "module" and view.nodes["blk"]["members"] == 2
    assert view.nodes["blk (node)"]["op"] == "call_function"
    assert list(view.edges()) == [("x", "blk (node)"), ("blk (node)", "blk"), ("blk", "output")]
    assert len(fxnx.to_pydot(G, depth=1).get_node("blk (node)")) == 1
    assert dr.view.collapsed_size(G, 1) == view.number_of_nodes()


class ReLUTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        return self.relu(self.relu(self.lin(x)))


def test_an_aten_node_named_like_its_module_is_collapsed_into_it():
    G = fxnx.convert(ReLUTwice(), torch.zeros(1, 4), routes="export")
    # The premise, from torch.export: the ATen op relu is named like the module it runs in.
    in_relu = sorted(n for n, d in G.nodes(data=True) if d["scope"] == "relu")
    assert in_relu == ["relu", "relu_1"]
    view = dr.view.collapse(G, 1)
    assert view.nodes["relu"]["op"] == "module" and view.nodes["relu"]["members"] == 2
    assert "relu_1" not in view
    text = fxnx.to_pydot(G, depth=1).to_string()
    assert "ReLU · 2 ops" in text


class TiedLM(torch.nn.Module):
    """A language model whose output layer shares the embedding's weight (GPT-2's LM head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.body[0].weight

    def forward(self, ids):
        return self.head(self.body(ids))


def test_a_weight_tied_across_modules_is_drawn_outside_both():
    """torch.export reads the tied weight once (one get_attr node) for the embedding inside
    ``body`` and for ``head``: it belongs to neither module's box, so each collapses whole.
    Oracle: the model's structure, by hand (depth 1: the input, body, head, the output and the
    shared weight)."""
    G = fxnx.convert(TiedLM(), torch.zeros(2, 5, dtype=torch.long), routes="export")
    shared = [n for n, d in G.nodes(data=True) if d["op"] == "get_attr" and G.out_degree(n) == 2]
    assert len(shared) == 1  # the premise: one node for the tied weight
    view = dr.view.collapse(G, 1)
    assert view.nodes["body"]["op"] == "module" and view.nodes["head"]["op"] == "module"
    assert not any(str(d.get("scope", "")).startswith("body") for n, d in view.nodes(data=True) if n != "body")
    assert view.number_of_nodes() == 5, sorted(view)
    assert nx.is_directed_acyclic_graph(view)


def test_drawing_a_collapsed_view_leaves_the_graph_as_it_was():
    G = fxnx.convert(NamedLikeAModule(), torch.zeros(1, 4))
    before = (dict(G.graph), list(G.nodes(data=True)), list(G.edges(keys=True, data=True)))
    fxnx.to_pydot(G, depth=1)
    fxnx.draw(G, depth=1)
    assert before == (dict(G.graph), list(G.nodes(data=True)), list(G.edges(keys=True, data=True)))


# --- the models of issue 27 ----------------------------------------------------------------------

DETECTORS = ["retinanet_resnet50_fpn", "fcos_resnet50_fpn", "ssd300_vgg16"]


@needs_dot
@pytest.mark.slow
@pytest.mark.parametrize("name", DETECTORS)
def test_detectors_png_is_within_its_bound_or_refused_with_what_works(name, tmp_path):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = fxnx.convert(model, [torch.rand(3, 224, 224)])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = fxnx.draw(G, tmp_path / "g.png")
    except fxnx.errors.FxnxValueError as err:
        message = str(err)
        _no_depth_below_one(message)
        assert ".svg or .pdf" in message and "fxnx.scope_subgraph(G, scope): " in message
        named = message.partition("fxnx.scope_subgraph(G, scope): ")[2]
        fit = re.findall(r"'(\w+)'", named.partition(" a PNG")[0])
        too_large = re.findall(r"'(\w+)'", named.partition(" a PNG")[2])
        assert "backbone" in fit
        for part in fit:  # every part it says fits draws, within the bound
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _within_bound(fxnx.draw(fxnx.scope_subgraph(G, part), tmp_path / f"{part}.png"))
        for part in too_large:  # and every other is refused as the whole was
            with pytest.raises(fxnx.errors.FxnxValueError, match="too large for a readable PNG"):
                fxnx.draw(fxnx.scope_subgraph(G, part), tmp_path / f"{part}.png")
    else:
        _within_bound(path)


@needs_dot
@pytest.mark.slow
def test_xlnet_draws_at_every_depth(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=100, d_model=32, n_layer=2, n_head=2, d_inner=64)
    model = transformers.XLNetModel(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        G = fxnx.convert(model, torch.randint(0, 100, (1, 8)), routes="export")
    assert "dropout" in G and G.nodes["dropout"]["scope"] == "dropout"  # the name that crashed
    for depth in range(1, dr.view.module_depth(G) + 1):
        fxnx.to_pydot(G, depth=depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _within_bound(fxnx.draw(G, tmp_path / "xlnet.png"))


@needs_dot
def test_a_view_the_estimate_puts_over_a_png_is_drawn_where_dots_layout_fits(tmp_path, monkeypatch):
    """Where the estimate puts even the shallowest view over a PNG's area (it errs large: GPT-2
    at depth 1, 208 square inches predicted, 155 laid out), dot's own layout decides. Here the
    estimate is made to err: every view predicted twice the limit's side. Oracle: the PNG's
    own size; and with dot's layout too large as well, the refusal."""
    G = fxnx.convert(NamedLikeAModule(), torch.zeros(1, 4))
    real = dr.draw.estimate_view

    def over(view, clusters, rankdir):
        e = real(view, clusters, rankdir)
        return dataclasses.replace(e, across=2 * 72 * dr.fit.PNG_AREA**0.5, along=2 * 72 * dr.fit.PNG_AREA**0.5)

    monkeypatch.setattr(dr.fit, "estimate_view", over)
    monkeypatch.setattr(dr.draw, "estimate_view", over)
    _within_bound(fxnx.draw(G, tmp_path / "g.png"))
    monkeypatch.setattr(dr.fit, "PNG_AREA", 1e-3)  # dot's layout too large as well
    with pytest.raises(fxnx.errors.FxnxValueError, match="too large for a readable PNG"):
        fxnx.draw(G, tmp_path / "h.png")
